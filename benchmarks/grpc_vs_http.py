"""HTTP against gRPC on one `kiln serve`, and gRPC against Triton's gRPC on the repository that
`kiln triton` writes for the same artifact: the same STS-B sentences, `kiln loadtest`.

    python benchmarks/grpc_vs_http.py --artifact artifacts/all-MiniLM-L6-v2 --rounds 3 [--triton]

One kiln server with both transports (HTTP and `--grpc-port`); with --triton also tritonserver
(python backend, the CPU build in nvidia-pytriton) with matched settings: the same variant, 2
instances of 1 intra-op thread, max batch 32, no queue delay. Both servers stay up; each round runs
every (server, protocol) pair at every concurrency in a rotated order (this VM drifts by up to 25%
from minute to minute: interleaving keeps that drift out of the comparison). The report gives every
round and the medians: requests/s and p50/p99 latency of successful requests."""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
from pathlib import Path

from modelkiln.loadtest.api import LoadtestOptions, run_loadtest
from modelkiln.loadtest.runner import Load
from modelkiln.tune.sweep import ServeProcess, process_memory_mb

KILN_PROTOCOLS = ("oip-json", "oip-binary", "grpc")
TRITON_PROTOCOLS = ("oip-binary", "grpc")
# kiln serve's defaults on 2 cores, spelled out so that Triton gets the same
SETTINGS = {"instances": 2, "threads": 1, "max_batch_size": 32, "max_queue_delay_ms": 0.0}


def start_triton(artifact: Path, variant: str, stack: contextlib.ExitStack):
    from modelkiln.triton import server as triton_server
    from modelkiln.triton.config import Options
    from modelkiln.triton.repository import write_repository

    tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="kiln-triton-repo-"))
    repo = write_repository(artifact, Path(tmp) / "repo",
                            Options(model_backend="python", max_batch_size=SETTINGS["max_batch_size"],
                                    max_queue_delay_us=0, instances=SETTINGS["instances"],
                                    threads=SETTINGS["threads"]), variant=variant)
    server = triton_server.start(repo, timeout=300)
    stack.callback(server.stop)
    return server


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", type=Path, required=True)
    ap.add_argument("--name", default="minilm")
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--window", type=float, default=2.0)
    ap.add_argument("--triton", action="store_true", help="also Triton's gRPC and HTTP on the kiln triton repository")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "grpc-vs-http")
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]

    from modelkiln.manifest import Manifest
    from modelkiln.triton.repository import model_name

    manifest = Manifest.load(args.artifact)
    variant = manifest.fastest_variant("cpu").name
    rows: list[dict] = []
    with contextlib.ExitStack() as stack:
        kiln = stack.enter_context(ServeProcess(args.artifact.resolve(), args.name, {**SETTINGS, "variant": variant},
                                                grpc=True))
        # (label, protocol, http url, grpc address, model name)
        targets = [("kiln", p, kiln.url, kiln.grpc_url, args.name) for p in KILN_PROTOCOLS]
        if args.triton:
            triton = start_triton(args.artifact, variant, stack)
            targets += [("triton", p, f"http://{triton.url}", f"127.0.0.1:{triton.grpc_port}", model_name(manifest))
                        for p in TRITON_PROTOCOLS]
        for r in range(args.rounds):
            order = targets[r % len(targets):] + targets[:r % len(targets)]
            for c in levels:
                for server, protocol, url, grpc_url, model in order:
                    opts = LoadtestOptions(url=url, model=model, loads=(Load("concurrency", float(c)),),
                                           protocol=protocol, grpc_url=grpc_url, inputs="sts",
                                           warmup_s=1.0, window_s=args.window, stable_windows=3, max_windows=6)
                    step = run_loadtest(opts).steps[0]
                    rows.append({"round": r + 1, "concurrency": c, "server": server, "protocol": protocol,
                                 "requests_per_s": step.throughput, "p50_ms": step.latency.p50 if step.latency else None,
                                 "p99_ms": step.latency.p99 if step.latency else None, "stable": step.stable,
                                 "errors": step.errors})
                    print(f"round {r + 1} c={c:<3} {server:<6} {protocol:<10} {step.throughput:7.1f} req/s  "
                          f"p50 {rows[-1]['p50_ms']:.2f} ms  p99 {rows[-1]['p99_ms']:.2f} ms  "
                          f"{'stable' if step.stable else 'UNSTABLE'} errors={step.errors}", flush=True)
        memory = process_memory_mb(kiln.proc.pid, "VmRSS")

    lines = ["| concurrency | server | protocol | requests/s (median) | p50 ms | p99 ms | rounds (req/s) | errors |",
             "|---|---|---|---|---|---|---|---|"]
    pairs = [("kiln", p) for p in KILN_PROTOCOLS] + ([("triton", p) for p in TRITON_PROTOCOLS] if args.triton else [])
    for c in levels:
        for server, protocol in pairs:
            mine = [x for x in rows if x["concurrency"] == c and x["protocol"] == protocol and x["server"] == server]
            med = {k: statistics.median(x[k] for x in mine) for k in ("requests_per_s", "p50_ms", "p99_ms")}
            lines.append(f"| {c} | {server} | {protocol} | {med['requests_per_s']:.1f} | {med['p50_ms']:.2f} | "
                         f"{med['p99_ms']:.2f} | " + ", ".join(f"{x['requests_per_s']:.0f}" for x in mine)
                         + f" | {sum(sum(x['errors'].values()) for x in mine)} |")
    table = "\n".join(lines)
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    load = Path("/proc/loadavg").read_text().split()[:3]
    args.out.with_suffix(".json").write_text(json.dumps({"rows": rows, "kiln_rss_mb": memory, "variant": variant,
                                                         "settings": SETTINGS, "loadavg_after": load}, indent=1))
    args.out.with_suffix(".txt").write_text(
        f"python benchmarks/grpc_vs_http.py --artifact {args.artifact} --rounds {args.rounds}"
        f"{' --triton' if args.triton else ''}\nvariant {variant}, {SETTINGS}; load average after: {' '.join(load)}\n\n"
        f"{table}\n")


if __name__ == "__main__":
    main()
