"""CPU time the server side spends per request: kiln serve vs kiln ray (1 and 2 replicas, through the
router; 2 replicas with --direct-encoders: Ray's proxy straight to a replica, the router left out).

    python benchmarks/serving/ray_cpu_per_request.py /work/main/artifacts/all-MiniLM-L6-v2 --requests 1500 \\
        --out benchmarks/results/ray-cpu-per-request.md

Throughput on a shared 2-core machine mostly measures who wins the CPU; the CPU a server burns per
request does not depend much on what else runs. For each server: warm up, read the utime+stime of
every server process (kiln serve: its one process; kiln ray: every process of its session: proxy,
replicas, router, controller, GCS, raylet...), send N OIP JSON requests from 16 concurrent clients
(the client's CPU is not counted), read again. Rounds interleave the three servers."""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from pathlib import Path

import httpx

from modelkiln.manifest import Manifest
from modelkiln.ray.process import RayProcess
from modelkiln.samples import SAMPLE_TEXTS
from modelkiln.tune.sweep import ServeProcess

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / TICK


async def send(url: str, model: str, requests: int, concurrency: int = 16) -> float:
    counter = iter(range(requests))

    async def client(http: httpx.AsyncClient) -> None:
        for i in counter:
            text = SAMPLE_TEXTS[i % len(SAMPLE_TEXTS)]
            body = {"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1], "data": [text]}]}
            r = await http.post(f"{url}/v2/models/{model}/infer", json=body)
            r.raise_for_status()

    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=concurrency)) as http:
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
    return time.perf_counter() - started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--requests", type=int, default=1500)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/ray-cpu-per-request.md"))
    args = ap.parse_args()
    manifest = Manifest.load(args.artifact)
    name, variant, artifact = manifest.name, manifest.fastest_variant("cpu").name, args.artifact.resolve()

    def ray(replicas: int, cpus: int, *layout: str):
        return lambda: RayProcess([f"{name}={artifact}", "--variant", variant, "--replicas", str(replicas),
                                   "--cpus-per-replica", str(cpus), "--num-cpus", str(args.cores),
                                   "--log-level", "warning", *layout])

    half = max(1, args.cores // 2)
    servers = {"kiln serve": lambda: ServeProcess(artifact, name, {"variant": variant}),
               "ray 1 replica": ray(1, args.cores), "ray 2 replicas": ray(2, half),
               "ray 2 replicas, direct": ray(2, half, "--direct-encoders", "--proxy-location", "EveryNode")}
    results: dict[str, list[tuple[float, float, str]]] = {label: [] for label in servers}
    for _ in range(args.rounds):
        for label, start in servers.items():
            server = start()
            try:
                pids = [server.proc.pid] if isinstance(server, ServeProcess) else server.session_pids()
                asyncio.run(send(server.url, name, 200))  # warm-up
                load = " ".join(f"{x:.2f}" for x in os.getloadavg())
                before = cpu_seconds(pids)
                wall = asyncio.run(send(server.url, name, args.requests))
                used = cpu_seconds(pids) - before
            finally:
                server.stop()
            results[label].append((1000 * used / args.requests, args.requests / wall, load))
            print(f"{label}: {1000 * used / args.requests:.2f} CPU ms/request, {args.requests / wall:.0f} req/s "
                  f"(load {load})", flush=True)
    lines = [f"# Server CPU per request ({name} {variant}, OIP JSON /infer, 16 clients, {args.requests} requests "
             f"per run, {args.rounds} interleaved rounds, median)", "",
             "| server | CPU ms / request | vs kiln serve | rounds (CPU ms) | req/s (rounds) |", "|---|---|---|---|---|"]
    base = statistics.median(r[0] for r in results["kiln serve"])
    for label, rows in results.items():
        cpu = statistics.median(r[0] for r in rows)
        lines.append(f"| {label} | {cpu:.2f} | {cpu / base:.2f} | {', '.join(f'{r[0]:.2f}' for r in rows)} "
                     f"| {', '.join(f'{r[1]:.0f}' for r in rows)} |")
    lines += ["", "Load average before each measurement: " + "; ".join(
        f"{label} r{i + 1}: {r[2]}" for label, rows in results.items() for i, r in enumerate(rows))]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
