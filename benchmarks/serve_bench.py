"""Load-test ``kiln serve`` with wrk, driving STS-B sentences (../shared/data), and compare with the
in-process batch-1 latency of the same artifact.

    python benchmarks/serve_bench.py --artifact /tmp/serve-art/all-MiniLM-L6-v2 --duration 20

Prints one JSON document and a Markdown table for the README. Needs ``wrk`` (apt-get install wrk).
Acceptance targets (2 CPU cores): concurrency 1 p50 <= in-process batch-1 latency + 0.5 ms;
concurrency 16 >= 800 requests/s with zero errors."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from modelkiln.data import sts_sentences
from wrk_load import print_table, run_wrk, write_script

def in_process_latency(artifact: str, sentences: list[str], threads: int | None, seconds: float) -> float:
    """Median ms of the full pipeline (tokenize + model + postprocess) at batch 1, in this process."""
    from modelkiln.runtime.pipeline import load_pipeline

    pipe = load_pipeline(artifact, threads=threads)
    for s in sentences[:20]:
        pipe([s])
    times, k, end = [], 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        pipe([sentences[k % len(sentences)]])
        times.append(time.perf_counter() - t)
        k += 1
    return statistics.median(times) * 1000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/v2/health/ready", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise SystemExit("server not ready")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", required=True, help="artifact folder (e.g. a converted all-MiniLM-L6-v2)")
    ap.add_argument("--route", default="predict", choices=["predict", "infer", "embeddings"])
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--duration", type=int, default=20, help="seconds per wrk run")
    ap.add_argument("--warmup", type=int, default=3, help="seconds of load before measuring")
    ap.add_argument("--threads", type=int, default=None, help="server onnxruntime threads (KILN_THREADS)")
    ap.add_argument("--server-args", default="", help="extra `kiln serve` flags, e.g. '--max-batch-size 64'")
    ap.add_argument("--json", type=Path, help="also write results here")
    args = ap.parse_args()
    if not shutil.which("wrk"):
        raise SystemExit("wrk not found: apt-get install -y wrk")

    sentences = sts_sentences()
    name = "bench"
    if args.route == "predict":
        path, bodies = f"/v2/models/{name}/predict", [json.dumps({"inputs": s}) for s in sentences]
    elif args.route == "embeddings":
        path, bodies = "/v1/embeddings", [json.dumps({"model": name, "input": s}) for s in sentences]
    else:
        path = f"/v2/models/{name}/infer"
        bodies = [json.dumps({"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1], "data": [s]}]})
                  for s in sentences]
    script = write_script(Path(tempfile.mkdtemp()), path, bodies)

    from modelkiln.serve.settings import ServeSettings

    # the same session layout the server uses (threads per engine instance)
    _, engine_threads = ServeSettings(threads=args.threads).engine_layout()
    baseline = in_process_latency(args.artifact, sentences, engine_threads, seconds=5)
    port = free_port()
    env = dict(os.environ)
    if args.threads:
        env["KILN_THREADS"] = str(args.threads)
    cmd = [sys.executable, "-m", "modelkiln", "serve", f"{name}={args.artifact}", "--port", str(port),
           "--log-level", "warning", *args.server_args.split()]
    proc = subprocess.Popen(cmd, env=env)
    url = f"http://127.0.0.1:{port}"
    results = []
    try:
        wait_ready(url, proc)
        if args.warmup:
            run_wrk(url, script, 16, args.warmup, 1)
        for c in (int(x) for x in args.concurrency.split(",")):
            results.append(run_wrk(url, script, c, args.duration, threads=1 if c == 1 else 2))
        rss_mb = int(next(ln for ln in Path(f"/proc/{proc.pid}/status").read_text().splitlines()
                          if ln.startswith("VmRSS")).split()[1]) / 1024
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    report = {"artifact": args.artifact, "route": args.route, "sentences": len(sentences), "cpus": os.cpu_count(),
              "in_process_batch1_ms": baseline, "server_rss_mb": rss_mb, "server_exit": code, "runs": results}
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nin-process batch-1 latency: {baseline:.2f} ms; server RSS {rss_mb:.0f} MB\n")
    print_table(results)


if __name__ == "__main__":
    main()
