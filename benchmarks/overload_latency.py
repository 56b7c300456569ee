"""How fast is a 503 under overload? Issue 15 saw up to 3.4 s with 256 connections sending 8
inputs each; a refusal should cost the client nothing but a round trip.

Starts ``kiln serve`` on an artifact, runs ``--connections`` keep-alive clients that each send
``/predict`` requests of ``--inputs`` texts back to back for ``--seconds``, and prints the latency
percentiles of the 200s and of the 503s (the client-side time from the first byte sent to the
last byte received), as JSON.

    python benchmarks/overload_latency.py /tmp/minilm --connections 256 --inputs 8 --seconds 15
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from modelkiln.net import free_port  # noqa: E402
from modelkiln.samples import SAMPLE_TEXTS  # noqa: E402


async def client(port: int, body: bytes, until: float, latencies: dict[int, list[float]]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    request = (b"POST /v2/models/m/predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    try:
        while time.perf_counter() < until:
            started = time.perf_counter()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            await reader.readexactly(length)
            latencies.setdefault(status, []).append(time.perf_counter() - started)
            if b"connection: close" in head.lower():
                break
    finally:
        writer.close()


def summary(values: list[float]) -> dict[str, float]:
    a = np.array(values) * 1000
    return {"count": len(a), "p50_ms": round(float(np.percentile(a, 50)), 1),
            "p99_ms": round(float(np.percentile(a, 99)), 1), "max_ms": round(float(a.max()), 1)}


async def load(port: int, connections: int, inputs: int, seconds: float) -> dict[int, list[float]]:
    texts = [f"{SAMPLE_TEXTS[i % len(SAMPLE_TEXTS)]} ({i})" for i in range(inputs)]
    body = json.dumps({"inputs": texts}).encode()
    latencies: dict[int, list[float]] = {}
    until = time.perf_counter() + seconds
    await asyncio.gather(*(client(port, body, until, latencies) for _ in range(connections)))
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("artifact")
    parser.add_argument("--connections", type=int, default=256)
    parser.add_argument("--inputs", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=15)
    parser.add_argument("--serve-arg", action="append", default=[], help="extra `kiln serve` argument")
    parser.add_argument("--log-lines-per-s", type=float, default=0,
                        help="read the server's log through a pipe at this many lines/s (a slow terminal or "
                             "log shipper); 0: discard it")
    args = parser.parse_args()
    port = free_port()
    env = {**os.environ, "KILN_PORT": str(port)}
    log = subprocess.DEVNULL
    if args.log_lines_per_s:
        reader = ("import sys, time\nfor line in sys.stdin: time.sleep(1 / float(sys.argv[1]))")
        log_reader = subprocess.Popen([sys.executable, "-c", reader, str(args.log_lines_per_s)], stdin=subprocess.PIPE,
                                      stdout=subprocess.DEVNULL)
        log = log_reader.stdin
    server = subprocess.Popen([sys.executable, "-m", "modelkiln", "serve", f"m={args.artifact}", *args.serve_arg],
                              env=env, stderr=log)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v2/health/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit("the server did not start")
            time.sleep(0.2)
        latencies = asyncio.run(load(port, args.connections, args.inputs, args.seconds))
    finally:
        server.terminate()
        server.wait(30)
    print(json.dumps({"connections": args.connections, "inputs": args.inputs, "seconds": args.seconds,
                      **{str(status): summary(v) for status, v in sorted(latencies.items())}}))


if __name__ == "__main__":
    main()
