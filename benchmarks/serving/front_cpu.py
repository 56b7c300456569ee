"""Where a `kiln serve` request's CPU goes: the event loop (HTTP, codecs, the data plane, metrics),
the engine threads outside the model (tokenizing, batching, answers) and the model itself, per
request, from /proc's per-thread CPU times of the server's processes and its own compute metric.

    python benchmarks/serving/front_cpu.py --artifact artifacts/all-MiniLM-L6-v2 --concurrency 1,16 --rounds 3
    python benchmarks/serving/front_cpu.py --artifact A --server-args '--workers 2' --label workers2

wrk drives ``/v2/models/bench/predict`` with STS-B sentences (one per request) for ``--duration``
seconds per concurrency; the server's CPU (utime + stime of every thread of the server and its
child processes) is read before and after, and grouped by thread: the event loop (each process's
main thread), the engine threads (``engine-*``) and the rest (onnxruntime's pool threads of the
lone-request session, gRPC). The model's own time is ``kiln_batch_compute_seconds_sum`` (the
batches' model run and postprocessing; one thread each, so wall ≈ CPU); ``front`` is everything
else: the server's CPU per request that no faster model would save. CPU times are far less
disturbed by other load on a shared machine than latencies are; requests/s and p50 are given too.
``--trivial-model`` serves, in the artifact's place, a copy whose every ONNX file is a graph of
four elementwise ops with the same inputs and outputs (the same tokenizer, task and
postprocessing): the model then costs next to nothing, and the server's CPU per request is its
front. Needs wrk (apt-get install wrk)."""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import shutil
import statistics
import tempfile
import urllib.request
from pathlib import Path

from modelkiln.data import sts_sentences
from modelkiln.tune.sweep import ServeProcess, process_tree
from wrk_load import run_wrk, write_script

TICK = os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds by thread group over the server's process tree: loop, engine, other."""
    groups = {"loop": 0.0, "engine": 0.0, "other": 0.0}
    for p in process_tree(pid):
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                stat = (task / "stat").read_text()
            except OSError:
                continue
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            fields = stat.rsplit(")", 1)[1].split()
            seconds = (int(fields[11]) + int(fields[12])) / TICK
            group = "loop" if task.name == str(p) else "engine" if name.startswith("engine-") else "other"
            groups[group] += seconds
    return groups


def metric_sum(url: str, name: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def measure(url: str, pid: int, script: Path, concurrency: int, seconds: int, load_prefix: list[str]) -> dict:
    cpu0, compute0 = thread_cpu(pid), metric_sum(url, "kiln_batch_compute_seconds_sum")
    run = run_wrk(url, script, concurrency, seconds, threads=1 if concurrency == 1 else 2, prefix=load_prefix)
    cpu1, compute1 = thread_cpu(pid), metric_sum(url, "kiln_batch_compute_seconds_sum")
    n = max(run["requests"], 1)
    per = {k: (cpu1[k] - cpu0[k]) / n * 1e6 for k in cpu0}
    total = sum(per.values())
    model = (compute1 - compute0) / n * 1e6
    return {"concurrency": concurrency, "rps": run["rps"], "p50_ms": run["p50_ms"], "errors": run["errors"],
            "cpu_us": total, "loop_us": per["loop"], "engine_us": per["engine"], "other_us": per["other"],
            "model_us": model, "front_us": total - model}


def trivial_copy(artifact: Path, folder: Path) -> Path:
    """The artifact with every variant's ONNX file replaced by ``last_hidden_state`` = the input
    ids (as floats) repeated over the hidden size: next to no compute, the real tokenizer and
    postprocessing (an encoder's ``last_hidden_state`` output; a sentence-embeddings artifact)."""
    import onnx
    from onnx import TensorProto, helper

    from modelkiln.manifest import Manifest

    manifest = Manifest.load(artifact)
    hidden = json.loads((artifact / "config.json").read_text())["hidden_size"]
    if manifest.output_names != ["last_hidden_state"]:
        raise SystemExit(f"--trivial-model needs an encoder with last_hidden_state, not {manifest.output_names}")
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "seq"]) for n in manifest.input_names]
    nodes = [helper.make_node("Cast", ["input_ids"], ["ids"], to=TensorProto.FLOAT),
             helper.make_node("Constant", [], ["axes"], value=helper.make_tensor("a", TensorProto.INT64, [1], [2])),
             helper.make_node("Unsqueeze", ["ids", "axes"], ["column"]),
             helper.make_node("Constant", [], ["repeats"],
                              value=helper.make_tensor("r", TensorProto.INT64, [3], [1, 1, hidden])),
             helper.make_node("Tile", ["column", "repeats"], ["last_hidden_state"])]
    output = helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, ["batch", "seq", hidden])
    graph = helper.make_graph(nodes, "trivial", inputs, [output])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    target = folder / artifact.name
    shutil.copytree(artifact, target, ignore=shutil.ignore_patterns("*.onnx", "*.data"))
    for variant in manifest.variants:
        if variant.file:
            onnx.save(model, target / variant.file)
    return target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", required=True, type=Path)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--duration", type=int, default=10, help="seconds per window")
    ap.add_argument("--rounds", type=int, default=3, help="fresh servers, one after another")
    ap.add_argument("--pairs", type=int, default=1, help="windows per concurrency and round (alternating servers)")
    ap.add_argument("--server-args", default="", help="extra kiln serve flags")
    ap.add_argument("--prefix", default="", help="a command the server runs under, e.g. 'taskset -c 0'")
    ap.add_argument("--load-prefix", default="", help="a command wrk runs under, e.g. 'taskset -c 1'")
    ap.add_argument("--baseline-src", type=Path,
                    help="also serve from this source tree (a worktree of the commit to compare with: its src/ is "
                         "put first on PYTHONPATH), the two servers measured in alternating windows, so that load "
                         "elsewhere on the machine falls on both alike")
    ap.add_argument("--baseline-args", help="a baseline server with these kiln serve flags instead (e.g. --workers 1)")
    ap.add_argument("--baseline-prefix", help="a baseline server run under this command instead")
    ap.add_argument("--label", default="")
    ap.add_argument("--trivial-model", action="store_true", help="serve a copy whose model costs next to nothing")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    sentences = sts_sentences()
    random.Random(0).shuffle(sentences)
    script = write_script(Path(tempfile.mkdtemp()), "/v2/models/bench/predict",
                          [json.dumps({"inputs": s}) for s in sentences])
    artifact = args.artifact.resolve()
    if args.trivial_model:
        artifact = trivial_copy(artifact, Path(tempfile.mkdtemp()))
    kinds = [(args.label or "this tree", shlex.split(args.prefix), shlex.split(args.server_args))]
    compared = args.baseline_src or args.baseline_args is not None or args.baseline_prefix is not None
    if compared:
        source = ["env", f"PYTHONPATH={args.baseline_src.resolve() / 'src'}"] if args.baseline_src else []
        prefix = args.prefix if args.baseline_prefix is None else args.baseline_prefix
        server_args = args.server_args if args.baseline_args is None else args.baseline_args
        kinds.append(("baseline", [*source, *shlex.split(prefix)], shlex.split(server_args)))
    rows = []
    for r in range(args.rounds):
        servers = [(label, ServeProcess(artifact, "bench", {}, extra_args=extra, prefix=prefix))
                   for label, prefix, extra in kinds]
        try:
            for _, server in servers:
                run_wrk(server.url, script, 16, 3, 2)  # warm-up
            for c in (int(x) for x in args.concurrency.split(",")):
                for pair in range(args.pairs):
                    for label, server in (servers if (r + pair) % 2 == 0 else servers[::-1]):
                        row = {"round": r + 1, "pair": pair, "server": label,
                               **measure(server.url, server.proc.pid, script, c, args.duration,
                                         shlex.split(args.load_prefix))}
                        rows.append(row)
                        print(f"{label} round {r + 1} c={c}: {row['rps']:.0f} req/s, p50 {row['p50_ms']:.2f} ms; "
                              f"CPU/request {row['cpu_us']:.0f} us = loop {row['loop_us']:.0f} + other threads "
                              f"{row['engine_us'] + row['other_us']:.0f}; model {row['model_us']:.0f}, "
                              f"front {row['front_us']:.0f}", flush=True)
        finally:
            for _, server in servers:
                server.stop()
    print(f"\nmedians over {args.rounds} rounds x {args.pairs} windows (load average "
          f"{Path('/proc/loadavg').read_text().split()[0]} after)")
    print("| server | concurrency | req/s | p50 ms | CPU us/req | loop | other threads | model | front |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    summary = []
    for label, _, _ in kinds:
        for c in sorted({row["concurrency"] for row in rows}):
            same = [row for row in rows if row["concurrency"] == c and row["server"] == label]
            med = {k: statistics.median(row[k] for row in same) for k in same[0]
                   if k not in ("round", "pair", "server", "concurrency")}
            summary.append({"server": label, "concurrency": c, **med})
            print(f"| {label} | {c} | {med['rps']:.0f} | {med['p50_ms']:.2f} | {med['cpu_us']:.0f} | {med['loop_us']:.0f} "
                  f"| {med['engine_us'] + med['other_us']:.0f} | {med['model_us']:.0f} | {med['front_us']:.0f} |")
    if compared:
        print("\npaired windows, this tree / baseline (median ratio):")
        for c in sorted({row["concurrency"] for row in rows}):
            pairs = {}
            for row in rows:
                if row["concurrency"] == c:
                    pairs.setdefault((row["round"], row["pair"]), {})[row["server"]] = row
            both = [p for p in pairs.values() if len(p) == 2]
            ratio = {k: statistics.median(p[kinds[0][0]][k] / p["baseline"][k] for p in both)
                     for k in ("rps", "p50_ms", "cpu_us", "loop_us")}
            print(f"c={c}: req/s x{ratio['rps']:.3f}, p50 x{ratio['p50_ms']:.3f}, CPU/request x{ratio['cpu_us']:.3f}, "
                  f"loop CPU/request x{ratio['loop_us']:.3f} ({len(both)} pairs)")
    if args.json:
        args.json.write_text(json.dumps({"label": args.label, "server_args": args.server_args, "prefix": args.prefix,
                                         "baseline_src": str(args.baseline_src or ""),
                                         "baseline_args": args.baseline_args, "baseline_prefix": args.baseline_prefix,
                                         "rows": rows,
                                         "median": summary}, indent=2) + "\n")


if __name__ == "__main__":
    main()
