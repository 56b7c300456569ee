"""HTTP against gRPC on one `kiln serve`, and gRPC against Triton's gRPC on the repository that
`kiln triton` writes for the same artifact: the same STS-B sentences, `kiln loadtest`.

    python benchmarks/serving/grpc_vs_http.py --artifact artifacts/all-MiniLM-L6-v2 --rounds 3 [--triton]

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
import os
import resource
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
TICK = os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def own_cpu_s() -> float:
    """This process's CPU time: the load generator (its grpc threads included) shares the server's cores."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


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
    ap.add_argument("--out", type=Path, default=Path(__file__).parents[1] / "results" / "grpc-vs-http")
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    load_before = Path("/proc/loadavg").read_text().split()[:3]

    from modelkiln.manifest import Manifest
    from modelkiln.triton.repository import model_name

    manifest = Manifest.load(args.artifact)
    variant = manifest.fastest_variant("cpu").name
    rows: list[dict] = []
    with contextlib.ExitStack() as stack:
        kiln = stack.enter_context(ServeProcess(args.artifact.resolve(), args.name, {**SETTINGS, "variant": variant},
                                                grpc=True))
        # (label, protocol, http url, grpc address, model name, server pid)
        targets = [("kiln", p, kiln.url, kiln.grpc_url, args.name, kiln.proc.pid) for p in KILN_PROTOCOLS]
        if args.triton:
            triton = start_triton(args.artifact, variant, stack)
            targets += [("triton", p, f"http://{triton.url}", f"127.0.0.1:{triton.grpc_port}", model_name(manifest),
                         None) for p in TRITON_PROTOCOLS]  # its python-backend stubs are other processes
        for r in range(args.rounds):
            order = targets[r % len(targets):] + targets[:r % len(targets)]
            for c in levels:
                for server, protocol, url, grpc_url, model, pid in order:
                    opts = LoadtestOptions(url=url, model=model, loads=(Load("concurrency", float(c)),),
                                           protocol=protocol, grpc_url=grpc_url, inputs="sts",
                                           warmup_s=1.0, window_s=args.window, stable_windows=3, max_windows=6)
                    server_cpu0, client_cpu0 = process_cpu_s(pid) if pid else 0.0, own_cpu_s()
                    step = run_loadtest(opts).steps[0]
                    # CPU per request over the whole step (warm-up included: ``sent`` counts it too)
                    server_ms = (process_cpu_s(pid) - server_cpu0) / step.sent * 1e3 if pid else None
                    client_ms = (own_cpu_s() - client_cpu0) / step.sent * 1e3
                    rows.append({"round": r + 1, "concurrency": c, "server": server, "protocol": protocol,
                                 "requests_per_s": step.throughput, "p50_ms": step.latency.p50 if step.latency else None,
                                 "p99_ms": step.latency.p99 if step.latency else None, "stable": step.stable,
                                 "errors": step.errors, "server_cpu_ms": server_ms, "client_cpu_ms": client_ms})
                    print(f"round {r + 1} c={c:<3} {server:<6} {protocol:<10} {step.throughput:7.1f} req/s  "
                          f"p50 {rows[-1]['p50_ms']:.2f} ms  p99 {rows[-1]['p99_ms']:.2f} ms  "
                          f"{'stable' if step.stable else 'UNSTABLE'} errors={step.errors}  CPU/request: server "
                          f"{'-' if server_ms is None else f'{server_ms:.2f}'} ms, client {client_ms:.2f} ms", flush=True)
        memory = process_memory_mb(kiln.proc.pid, "VmRSS")

    def median(values: list) -> float | None:
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    lines = ["| concurrency | server | protocol | requests/s (median) | p50 ms | p99 ms | rounds (req/s) | errors "
             "| server CPU ms/request | load generator CPU ms/request |", "|---|---|---|---|---|---|---|---|---|---|"]
    pairs = [("kiln", p) for p in KILN_PROTOCOLS] + ([("triton", p) for p in TRITON_PROTOCOLS] if args.triton else [])
    for c in levels:
        for server, protocol in pairs:
            mine = [x for x in rows if x["concurrency"] == c and x["protocol"] == protocol and x["server"] == server]
            med = {k: median([x[k] for x in mine]) for k in ("requests_per_s", "p50_ms", "p99_ms", "server_cpu_ms",
                                                              "client_cpu_ms")}
            lines.append(f"| {c} | {server} | {protocol} | {med['requests_per_s']:.1f} | {med['p50_ms']:.2f} | "
                         f"{med['p99_ms']:.2f} | " + ", ".join(f"{x['requests_per_s']:.0f}" for x in mine)
                         + f" | {sum(sum(x['errors'].values()) for x in mine)} | {ms(med['server_cpu_ms'])} | "
                         f"{ms(med['client_cpu_ms'])} |")
    # Per-round ratios on the same kiln server, measured minutes apart at most: the drift of this VM
    # cancels in them, not in the medians above.
    lines += ["", "| concurrency | gRPC / HTTP | requests/s ratio per round | median | p50 ratio per round | median |",
              "|---|---|---|---|---|---|"]
    for c in levels:
        for http in ("oip-binary", "oip-json"):
            by_round = {}
            for x in rows:
                if x["concurrency"] == c and x["server"] == "kiln":
                    by_round.setdefault(x["round"], {})[x["protocol"]] = x
            tput = [r["grpc"]["requests_per_s"] / r[http]["requests_per_s"] for r in by_round.values()]
            p50 = [r["grpc"]["p50_ms"] / r[http]["p50_ms"] for r in by_round.values()]
            lines.append(f"| {c} | grpc / {http} | " + ", ".join(f"{v:.2f}" for v in tput)
                         + f" | {statistics.median(tput):.2f} | " + ", ".join(f"{v:.2f}" for v in p50)
                         + f" | {statistics.median(p50):.2f} |")
    table = "\n".join(lines)
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    load = Path("/proc/loadavg").read_text().split()[:3]
    args.out.with_suffix(".json").write_text(json.dumps({"rows": rows, "kiln_rss_mb": memory, "variant": variant,
                                                         "settings": SETTINGS, "loadavg_before": load_before,
                                                         "loadavg_after": load}, indent=1))
    args.out.with_suffix(".txt").write_text(
        f"python benchmarks/serving/grpc_vs_http.py --artifact {args.artifact} --rounds {args.rounds}"
        f"{' --concurrency ' + args.concurrency if args.concurrency != '1,16' else ''}{' --triton' if args.triton else ''}\n"
        f"variant {variant}, {SETTINGS}; load average before: {' '.join(load_before)}, after: {' '.join(load)}\n"
        "CPU per request: utime+stime over the whole step (warm-up included) / requests sent; the load generator is\n"
        "this process (kiln loadtest, its grpc threads included) and shares the server's 2 cores.\n\n"
        f"{table}\n")


if __name__ == "__main__":
    main()
