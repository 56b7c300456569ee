"""Server CPU time per request, HTTP (tritonclient.http, binary tensors) against gRPC
(tritonclient.grpc), on one `kiln serve`: sequential requests (one client), STS-B sentences,
interleaved rounds. The server process's CPU time (utime + stime from /proc) is far less disturbed
by other load on a shared machine than wall-clock latency, and it leaves the load generator's own
cost out, which benchmarks/serving/grpc_vs_http.py cannot (its client shares the two cores).

    python benchmarks/serving/grpc_cpu_per_request.py --artifact artifacts/all-MiniLM-L6-v2 --requests 300 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from modelkiln.loadtest.inputs import load_items
from modelkiln.tune.sweep import ServeProcess

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def run(pid: int, module, client, model: str, texts: list[str], binary: bool) -> tuple[float, float]:
    """(server CPU ms, client wall ms) per request."""
    extra = {"binary_data": True} if binary else {}
    cpu0, t0 = cpu_seconds(pid), time.perf_counter()
    for text in texts:
        tensor = module.InferInput("TEXT", [1], "BYTES")
        tensor.set_data_from_numpy(np.array([text.encode()], dtype=object), **extra)
        client.infer(model, [tensor], outputs=[module.InferRequestedOutput("EMBEDDINGS", **extra)])
    return (cpu_seconds(pid) - cpu0) / len(texts) * 1e3, (time.perf_counter() - t0) / len(texts) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", type=Path, required=True)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    texts = [t if isinstance(t, str) else t[0] for t in load_items("sts")][:args.requests]
    with ServeProcess(args.artifact.resolve(), "minilm", {}, grpc=True) as server:
        pid = server.proc.pid
        http = httpclient.InferenceServerClient(server.url.split("://", 1)[1])
        grpc = grpcclient.InferenceServerClient(server.grpc_url)
        transports = (("http", httpclient, http, True), ("grpc", grpcclient, grpc, False))
        for _, module, client, binary in transports:  # warm-up
            run(pid, module, client, "minilm", texts[:50], binary)
        for r in range(args.rounds):
            for name, module, client, binary in (transports if r % 2 == 0 else transports[::-1]):
                cpu_ms, wall_ms = run(pid, module, client, "minilm", texts, binary)
                print(f"round {r + 1} {name}: server CPU {cpu_ms:.2f} ms/request, client wall {wall_ms:.2f} ms/request",
                      flush=True)
    print("load average after:", Path("/proc/loadavg").read_text().split()[:3])


if __name__ == "__main__":
    main()
