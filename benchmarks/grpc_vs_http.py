"""HTTP against gRPC on one `kiln serve`: the same model, the same STS-B sentences, `kiln loadtest`.

    python benchmarks/grpc_vs_http.py --artifact artifacts/all-MiniLM-L6-v2 --rounds 3

One server with both transports (HTTP and `--grpc-port`). Each round runs every protocol at
every concurrency, the protocols in a rotated order per round (this VM drifts by up to 25% from
minute to minute: interleaving keeps that drift out of the comparison). The report gives every
round and the medians: requests/s and p50/p99 latency of successful requests."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from modelkiln.loadtest.api import LoadtestOptions, run_loadtest
from modelkiln.loadtest.runner import Load
from modelkiln.tune.sweep import ServeProcess, process_memory_mb

PROTOCOLS = ("oip-json", "oip-binary", "grpc")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", type=Path, required=True)
    ap.add_argument("--name", default="minilm")
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--window", type=float, default=2.0)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "grpc-vs-http")
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]

    server = ServeProcess(args.artifact, args.name, {}, grpc=True)
    rows: list[dict] = []
    try:
        for r in range(args.rounds):
            order = PROTOCOLS[r % len(PROTOCOLS):] + PROTOCOLS[:r % len(PROTOCOLS)]
            for c in levels:
                for protocol in order:
                    opts = LoadtestOptions(url=server.url, model=args.name, loads=(Load("concurrency", float(c)),),
                                           protocol=protocol, grpc_url=server.grpc_url, inputs="sts",
                                           warmup_s=1.0, window_s=args.window, stable_windows=3, max_windows=6)
                    step = run_loadtest(opts).steps[0]
                    rows.append({"round": r + 1, "concurrency": c, "protocol": protocol,
                                 "requests_per_s": step.throughput, "p50_ms": step.latency.p50 if step.latency else None,
                                 "p99_ms": step.latency.p99 if step.latency else None, "stable": step.stable,
                                 "errors": step.errors})
                    print(f"round {r + 1} c={c:<3} {protocol:<10} {step.throughput:7.1f} req/s  "
                          f"p50 {rows[-1]['p50_ms']:.2f} ms  p99 {rows[-1]['p99_ms']:.2f} ms  "
                          f"{'stable' if step.stable else 'UNSTABLE'} errors={step.errors}", flush=True)
        memory = process_memory_mb(server.proc.pid, "VmRSS")
    finally:
        server.stop()

    lines = ["| concurrency | protocol | requests/s (median) | p50 ms | p99 ms | rounds (req/s) |", "|---|---|---|---|---|---|"]
    for c in levels:
        for protocol in PROTOCOLS:
            mine = [x for x in rows if x["concurrency"] == c and x["protocol"] == protocol]
            med = {k: statistics.median(x[k] for x in mine) for k in ("requests_per_s", "p50_ms", "p99_ms")}
            lines.append(f"| {c} | {protocol} | {med['requests_per_s']:.1f} | {med['p50_ms']:.2f} | {med['p99_ms']:.2f} | "
                         + ", ".join(f"{x['requests_per_s']:.0f}" for x in mine) + " |")
    table = "\n".join(lines)
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"rows": rows, "server_rss_mb": memory}, indent=1))
    args.out.with_suffix(".txt").write_text(
        f"python benchmarks/grpc_vs_http.py --artifact {args.artifact} --rounds {args.rounds}\n\n{table}\n")


if __name__ == "__main__":
    main()
