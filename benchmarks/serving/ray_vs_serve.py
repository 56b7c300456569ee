"""kiln serve vs kiln ray with 1 and 2 replicas, on one machine, measured with kiln loadtest.

    python benchmarks/serving/ray_vs_serve.py /work/main/artifacts/all-MiniLM-L6-v2 --rounds 3 \\
        --out benchmarks/results/ray-vs-serve

Three servers over the same artifact and variant, each given the machine's cores:
  - kiln serve: one process, its default engine layout for the host's cores;
  - kiln ray, 1 replica with --cpus-per-replica CORES: the same engine layout inside one replica,
    so the difference to kiln serve is Ray's proxy hop (proxy actor → replica actor);
  - kiln ray, 2 replicas with CORES/2 CPUs each: the cores split between two replicas.
Each runs alone (started, measured, stopped; Ray's local cluster with it), in interleaved rounds
(serve, ray×1, ray×2, serve, ...), because the machine is shared and drifts minute to minute.
The load average is recorded before every run. Results: one kiln loadtest JSON per run and a
summary table (median over rounds) in summary.md."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from rich.console import Console

from modelkiln.loadtest.api import LoadtestOptions, run_loadtest
from modelkiln.loadtest.report import print_table, write_json
from modelkiln.loadtest.runner import Load
from modelkiln.manifest import Manifest
from modelkiln.ray.process import RayProcess
from modelkiln.tune.sweep import ServeProcess


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/ray-vs-serve"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--inputs", default="sts")
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--window", type=float, default=3.0)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    manifest = Manifest.load(args.artifact)
    name, variant = manifest.name, manifest.fastest_variant("cpu").name
    artifact = args.artifact.resolve()
    loads = tuple(Load("concurrency", float(c)) for c in args.concurrency.split(","))
    console = Console(width=160)
    half = max(1, args.cores // 2)

    def serve() -> ServeProcess:
        return ServeProcess(artifact, name, {"variant": variant})

    def ray(replicas: int, cpus: int):
        return lambda: RayProcess([f"{name}={artifact}", "--variant", variant, "--replicas", str(replicas),
                                   "--cpus-per-replica", str(cpus), "--num-cpus", str(args.cores),
                                   "--log-level", "warning"])

    servers = {"kiln serve": serve, "ray 1 replica": ray(1, args.cores), "ray 2 replicas": ray(2, half)}
    rows: list[dict] = []
    for round_ in range(1, args.rounds + 1):
        for label, start in servers.items():
            before = load_average()
            started = time.perf_counter()
            server = start()
            startup = time.perf_counter() - started
            try:
                opts = LoadtestOptions(url=server.url, model=name, loads=loads, inputs=args.inputs,
                                       warmup_s=args.warmup, window_s=args.window, metrics_url=None,
                                       label=f"{label} (round {round_})")
                result = run_loadtest(opts)
            finally:
                server.stop()
            print_table(console, result)
            slug = label.replace(" ", "-")
            write_json(args.out / f"{slug}-round{round_}.json", result)
            for step in result.steps:
                latency = step.latency
                rows.append({"server": label, "round": round_, "concurrency": int(step.value),
                             "throughput": step.throughput, "p50_ms": latency.p50 if latency else float("nan"),
                             "p95_ms": latency.p95 if latency else float("nan"), "errors": step.errors,
                             "load_before": before, "startup_s": round(startup, 1)})
            print(f"{label} round {round_}: load average before {before}, ready in {startup:.1f}s",
                  file=sys.stderr, flush=True)
    (args.out / "rows.json").write_text(json.dumps(rows, indent=1))
    write_summary(rows, args, name, variant)


def write_summary(rows: list[dict], args: argparse.Namespace, name: str, variant: str) -> None:
    lines = [f"# kiln serve vs kiln ray ({name}, {variant}, {args.inputs} inputs, OIP JSON /infer, "
             f"{args.cores} cores, {args.rounds} interleaved rounds; median over rounds)", "",
             "| server | concurrency | req/s | p50 ms | p95 ms | req/s vs kiln serve | rounds (req/s) |",
             "|---|---|---|---|---|---|---|"]
    for concurrency in sorted({r["concurrency"] for r in rows}):
        base = statistics.median(r["throughput"] for r in rows
                                 if r["server"] == "kiln serve" and r["concurrency"] == concurrency)
        for server in dict.fromkeys(r["server"] for r in rows):
            mine = [r for r in rows if r["server"] == server and r["concurrency"] == concurrency]
            rps = statistics.median(r["throughput"] for r in mine)
            each = ", ".join(f"{r['throughput']:.0f}" for r in mine)
            lines.append(f"| {server} | {concurrency} | {rps:.0f} | {statistics.median(r['p50_ms'] for r in mine):.1f} "
                         f"| {statistics.median(r['p95_ms'] for r in mine):.1f} | {rps / base:.2f} "
                         f"| {each} |")
    lines += ["", "Load average (1, 5, 15 min) before each run: " + "; ".join(
        f"{r['server']} r{r['round']}: {r['load_before']}" for r in rows if r["concurrency"] == rows[0]["concurrency"])]
    (args.out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
