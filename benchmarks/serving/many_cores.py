"""`kiln serve` on a given set of cores: its defaults against hand-set layouts (worker processes x
engine instances x threads), each server pinned with taskset, the load generator on the other
cores where there are any. Written for a many-core machine (the defaults' rule, docs/serve.md:
"Worker processes", was set from 16-core figures), and it runs on 2 cores too.

    python benchmarks/serving/many_cores.py --artifact artifacts/all-MiniLM-L6-v2 --cores 0-15 \\
        --layouts auto,1x8x2,2x4x2,4x2x2,8x1x2,4x4x1,1x16x1 --concurrency 256 --duration 20
    python benchmarks/serving/many_cores.py --artifact A --cores "0;0-1" --layouts auto,1x1x1,1x2x1,2x1x1

``--cores``: taskset CPU lists separated by ``;`` (``"0;0-1;0-15"``). For each list the server runs under ``taskset -c LIST`` (its CPU budget comes from that mask: ``CPU budget:
N (affinity)``) with each layout: ``auto`` (no flag: the defaults), ``WxIxT`` (``--workers W
--instances I --threads T``), or ``cpus=N`` (``--cpus N``). The load generator (wrk, rotating the
STS-B sentences, or ``--tool hey`` with one 18-token sentence, as the figures in docs/serve.md)
runs under ``taskset`` on the cores outside the list, when there are any. Each layout runs
``--rounds`` times on a fresh server, rounds interleaved; the report gives each layout's median
req/s and p50/p99, and each list's defaults as a fraction of its best layout."""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path

from modelkiln.data import sts_sentences
from modelkiln.tune.sweep import ServeProcess
from wrk_load import run_wrk, write_script

HEY_SENTENCE = "A man is playing a large flute while a woman sings along."  # 18 tokens with its specials


def cpu_list(text: str) -> list[int]:
    cpus: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus += list(range(int(lo), int(hi or lo) + 1))
    return cpus


def layout_flags(layout: str) -> list[str]:
    if layout == "auto":
        return []
    if layout.startswith("cpus="):
        return ["--cpus", layout.split("=", 1)[1]]
    workers, instances, threads = layout.split("x")
    return ["--workers", workers, "--instances", instances, "--threads", threads]


def run_hey(url: str, body: Path, concurrency: int, seconds: int, prefix: list[str]) -> dict:
    out = subprocess.run([*prefix, "hey", "-z", f"{seconds}s", "-c", str(concurrency), "-m", "POST", "-T",
                          "application/json", "-D", str(body), url + "/v2/models/bench/predict"],
                         capture_output=True, text=True, check=True).stdout
    rps = float(re.search(r"Requests/sec:\s+(\S+)", out).group(1))  # type: ignore[union-attr]

    def percentile(p: int) -> float:
        found = re.search(rf"{p}%% in (\S+) secs".replace("%%", "%"), out)
        return float(found.group(1)) * 1000 if found else float("nan")

    codes = dict(re.findall(r"\[(\d+)\]\s+(\d+) responses", out))
    errors = sum(int(n) for code, n in codes.items() if code != "200")
    return {"rps": rps, "p50_ms": percentile(50), "p99_ms": percentile(99), "errors": errors}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", required=True, type=Path)
    ap.add_argument("--cores", default=f"0-{(os.cpu_count() or 1) - 1}",
                    help="taskset CPU lists to pin the server to, separated by ';'")
    ap.add_argument("--layouts", default="auto", help="comma-separated: auto, WxIxT, cpus=N")
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--duration", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tool", choices=["wrk", "hey"], default="wrk")
    ap.add_argument("--server-args", default="", help="extra kiln serve flags for every layout")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not shutil.which(args.tool):
        raise SystemExit(f"{args.tool} not found: apt-get install -y {args.tool}")
    lists = args.cores.split(";")
    work = Path(tempfile.mkdtemp())
    sentences = sts_sentences()
    random.Random(0).shuffle(sentences)
    script = write_script(work, "/v2/models/bench/predict", [json.dumps({"inputs": s}) for s in sentences])
    body = work / "body.json"
    body.write_text(json.dumps({"inputs": HEY_SENTENCE}))
    every = set(range(os.cpu_count() or 1))
    rows = []
    for r in range(args.rounds):
        for cores in lists:
            others = sorted(every - set(cpu_list(cores)))
            load_prefix = ["taskset", "-c", ",".join(map(str, others))] if others else []
            for layout in args.layouts.split(","):
                extra = layout_flags(layout) + shlex.split(args.server_args)
                with ServeProcess(args.artifact.resolve(), "bench", {}, extra_args=extra, timeout=300,
                                  prefix=["taskset", "-c", cores]) as server:
                    budget = re.search(r"CPU budget: .*", server.log_tail(20000))
                    if args.tool == "wrk":
                        threads = max(1, min(4, len(others) or 2))
                        run_wrk(server.url, script, min(args.concurrency, 64), args.warmup, threads, load_prefix)
                        run = run_wrk(server.url, script, args.concurrency, args.duration, threads, load_prefix)
                    else:
                        run_hey(server.url, body, min(args.concurrency, 64), args.warmup, load_prefix)
                        run = run_hey(server.url, body, args.concurrency, args.duration, load_prefix)
                row = {"round": r + 1, "cores": cores, "layout": layout, "budget": budget.group(0) if budget else "",
                       **{k: run[k] for k in ("rps", "p50_ms", "p99_ms", "errors")}}
                rows.append(row)
                print(f"round {r + 1} taskset -c {cores} {layout}: {row['rps']:.0f} req/s, p50 {row['p50_ms']:.1f} ms, "
                      f"p99 {row['p99_ms']:.1f} ms, errors {row['errors']} ({row['budget']})", flush=True)
    print(f"\n{args.tool} at {args.concurrency} connections for {args.duration} s; medians of {args.rounds} rounds; "
          f"load average {Path('/proc/loadavg').read_text().split()[0]} after\n")
    print("| cores | layout | req/s | p50 ms | p99 ms | errors | vs best |")
    print("|---|---|---:|---:|---:|---:|---:|")
    summary = []
    for cores in lists:
        medians = {}
        for layout in args.layouts.split(","):
            same = [x for x in rows if x["cores"] == cores and x["layout"] == layout]
            medians[layout] = {k: statistics.median(x[k] for x in same) for k in ("rps", "p50_ms", "p99_ms")}
            medians[layout]["errors"] = sum(x["errors"] for x in same)
        best = max(m["rps"] for m in medians.values())
        for layout, m in medians.items():
            summary.append({"cores": cores, "layout": layout, **m, "vs_best": m["rps"] / best})
            print(f"| {cores} | {layout} | {m['rps']:.0f} | {m['p50_ms']:.1f} | {m['p99_ms']:.1f} | {m['errors']} "
                  f"| {m['rps'] / best:.2f} |")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"artifact": str(args.artifact), "json": str(args.json)},
                                         "rows": rows, "median": summary}, indent=2) + "\n")


if __name__ == "__main__":
    main()
