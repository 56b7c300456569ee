"""What loading and unloading models costs the requests to another model, and whether an unload
gives the memory back (serve/repository.py).

    python benchmarks/serving/repository_churn.py REPOSITORY STEADY CHURNED [--rounds 3] [--seconds 3]

Starts ``kiln serve --model-repository REPOSITORY --model-control-mode explicit``, loads STEADY,
then alternates (interleaved, so a noisy shared machine hurts both alike) a quiet window and a
churn window of the same length; in both, CLIENTS async clients call STEADY's /predict, and in the
churn window CHURNED is loaded and unloaded back to back. Prints the latency of STEADY's requests
(p50, p99, max) and their failures per window, then the server's RSS after each of 10 load/unload
cycles of CHURNED."""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time

import httpx
import numpy as np

from modelkiln.net import free_port

CLIENTS = 4
BODY = {"inputs": ["a good day", "the weather is bad today"]}


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


async def window(url: str, steady: str, churned: str | None, seconds: float) -> tuple[list[float], int, int]:
    """(latencies of STEADY's answered requests, failures, load+unload cycles done)."""
    latencies: list[float] = []
    failures = 0
    cycles = 0
    stop = time.monotonic() + seconds

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal failures
        while time.monotonic() < stop:
            started = time.perf_counter()
            try:
                r = await http.post(f"{url}/v2/models/{steady}/predict", json=BODY)
                if r.status_code == 200:
                    latencies.append(time.perf_counter() - started)
                else:
                    failures += 1
            except httpx.HTTPError:
                failures += 1

    async def churn(http: httpx.AsyncClient) -> None:
        nonlocal cycles
        while churned and time.monotonic() < stop:
            for action in ("load", "unload"):
                r = await http.post(f"{url}/v2/repository/models/{churned}/{action}")
                r.raise_for_status()
            cycles += 1

    async with httpx.AsyncClient(timeout=30) as http:
        await asyncio.gather(*(client(http) for _ in range(CLIENTS)), churn(http))
    return latencies, failures, cycles


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("repository")
    parser.add_argument("steady")
    parser.add_argument("churned")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "modelkiln", "serve", "--model-repository", args.repository,
                               "--model-control-mode", "explicit", "--port", str(port)],
                              env={**os.environ, "KILN_THREADS": "1"}, stderr=subprocess.DEVNULL)
    try:
        while True:
            try:
                if httpx.get(url + "/v2/health/ready").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        httpx.post(f"{url}/v2/repository/models/{args.steady}/load", timeout=60).raise_for_status()
        print(f"{CLIENTS} clients on {args.steady}, {args.seconds:g} s windows; churn = load + unload {args.churned}")
        print("round  window  requests  failures  cycles  p50 ms  p99 ms  max ms")
        for r in range(args.rounds):
            for name, churned in (("quiet", None), ("churn", args.churned)):
                lat, failures, cycles = asyncio.run(window(url, args.steady, churned, args.seconds))
                ms = np.array(lat) * 1000
                print(f"{r:5d}  {name:6s}  {len(lat):8d}  {failures:8d}  {cycles:6d}  {np.percentile(ms, 50):6.1f}"
                      f"  {np.percentile(ms, 99):6.1f}  {ms.max():6.1f}")
        print(f"RSS after loading {args.steady}: {rss_mb(server.pid):.0f} MB")
        for cycle in range(10):
            httpx.post(f"{url}/v2/repository/models/{args.churned}/load", timeout=60).raise_for_status()
            loaded = rss_mb(server.pid)
            httpx.post(f"{url}/v2/repository/models/{args.churned}/unload", timeout=60).raise_for_status()
            print(f"cycle {cycle}: RSS {loaded:.0f} MB loaded, {rss_mb(server.pid):.0f} MB unloaded")
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
