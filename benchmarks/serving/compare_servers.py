"""kiln serve against another embedding server on this machine: the same int8 ONNX file, the same
OpenAI embeddings requests, wrk.

    python benchmarks/serving/compare_servers.py --artifact artifacts/all-MiniLM-L6-v2 --against infinity \\
        --infinity /tmp/infvenv/bin/infinity_emb --model-folder /tmp/minilm --rounds 3
    python benchmarks/serving/compare_servers.py --artifact artifacts/all-MiniLM-L6-v2 --against fastapi --rounds 3

``--against fastapi``: the FastAPI wrapper in ``fastapi_wrapper.py`` (one model call per request,
no batching), started with uvicorn from this environment.

``--against infinity``: michaelfeil/infinity, the server behind the issue's 365 req/s reference.
It runs from its own virtual environment (it pins old optimum/transformers/typer; the set-up
is in the README). ``--model-folder`` is the sentence-transformers folder with the artifact's
``model.int8.onnx`` copied to ``onnx/model_quantized.onnx``: infinity's ONNX engine takes the
``*quantize*`` file on CPU and exports nothing itself. Its pooling is given as ``mean``: its
``auto`` picked another pooling for this local folder and answered vectors at cosine 0.34-0.59
from the PyTorch reference.

Before measuring, both servers' answers are compared on STS-B sentences. Each round starts both servers fresh, one after the other, and runs wrk at each
concurrency; the report gives every round and the medians. STS-B sentences (packaged with modelkiln),
shuffled with a fixed seed, one body per sentence."""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

from modelkiln.data import sts_sentences
from modelkiln.net import free_port
from modelkiln.tune.sweep import ServeProcess, process_memory_mb
from wrk_load import median_runs, print_table, run_wrk, write_script

CHECK_SENTENCES = 16


def post_json(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def embeddings(url: str, model: str, texts: list[str]) -> np.ndarray:
    """One request per text, one at a time: each runs at batch 1, where dynamic int8 gives the same
    numbers on both servers (in a batch, the activation scales depend on the batch's other rows)."""
    return np.asarray([post_json(url, {"model": model, "input": [t]})["data"][0]["embedding"] for t in texts],
                      dtype=np.float64)


class OtherServer:
    """Another embedding server as a child process on a free port, until stopped."""

    def __init__(self, command: list[str], env: dict[str, str], path: str, model: str, cwd: str | None = None,
                 timeout: float = 300.0):
        self.path, self.model = path, model
        self.url = f"http://127.0.0.1:{env['PORT']}"
        self.log = tempfile.NamedTemporaryFile(prefix="other-server-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                     cwd=cwd)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"{command[0]} exited with {self.proc.returncode}; log: {self.log.name}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise SystemExit(f"{command[0]} did not become ready; log: {self.log.name}")
                time.sleep(0.5)

    def memory_mb(self, field: str) -> float | None:
        return process_memory_mb(self.proc.pid, field)

    def stop(self) -> int:
        self.proc.terminate()
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


# (path, model name) of each server's OpenAI embeddings route
ENDPOINTS = {"infinity": lambda args: ("/embeddings", args.model_folder),
             "fastapi": lambda args: ("/v1/embeddings", "bench")}


def infinity(args: argparse.Namespace) -> OtherServer:
    """``infinity_emb v2``, ONNX engine on CPU."""
    port = str(free_port())
    env = {"PORT": port, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "INFINITY_ONNX_DISABLE_OPTIMIZE": "1"}  # the artifact's int8 file is already fused and quantized
    return OtherServer([args.infinity, "v2", "--model-id", args.model_folder, "--engine", "optimum", "--device", "cpu",
                        "--port", port, "--host", "127.0.0.1", "--batch-size", str(args.batch_size),
                        "--pooling-method", "mean"], env, *ENDPOINTS["infinity"](args))


def fastapi_wrapper(args: argparse.Namespace) -> OtherServer:
    """``fastapi_wrapper.py`` under uvicorn (httptools and uvloop, as kiln serve), one worker."""
    port = str(free_port())
    env = {"PORT": port, "KILN_WRAPPER_ARTIFACT": str(Path(args.artifact).resolve())}
    return OtherServer([sys.executable, "-m", "uvicorn", "fastapi_wrapper:app", "--host", "127.0.0.1", "--port", port,
                        "--log-level", "warning", "--no-access-log"], env, *ENDPOINTS["fastapi"](args),
                       cwd=str(Path(__file__).parent))


OTHERS = {"infinity": infinity, "fastapi": fastapi_wrapper}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", required=True)
    ap.add_argument("--against", choices=sorted(OTHERS), required=True)
    ap.add_argument("--infinity", help="the infinity_emb executable (in its own venv)")
    ap.add_argument("--model-folder", help="for infinity: sentence-transformers folder with onnx/model_quantized.onnx")
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--duration", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=32, help="max batch for both servers")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not shutil.which("wrk"):
        raise SystemExit("wrk not found: apt-get install -y wrk")
    if args.against == "infinity" and not (args.infinity and args.model_folder):
        raise SystemExit("--against infinity needs --infinity and --model-folder")
    other = args.against

    sentences = sts_sentences()
    random.Random(0).shuffle(sentences)
    name = "bench"

    def script(path: str, model: str) -> Path:
        return write_script(Path(tempfile.mkdtemp()), path, [json.dumps({"model": model, "input": s}) for s in sentences])

    scripts = {"kiln": script("/v1/embeddings", name), other: script(*ENDPOINTS[other](args))}
    levels = [int(x) for x in args.concurrency.split(",")]

    rounds = []
    for r in range(args.rounds):
        row: dict = {}
        for server in ("kiln", other):
            if server == "kiln":
                srv = ServeProcess(Path(args.artifact), name, {"max_batch_size": args.batch_size})
                url, path, model = srv.url, "/v1/embeddings", name
            else:
                srv = OTHERS[other](args)
                url, path, model = srv.url, srv.path, srv.model
            try:
                if r == 0:  # the same answers, or the comparison means nothing
                    row[f"{server}_check"] = embeddings(url + path, model, sentences[:CHECK_SENTENCES])
                run_wrk(url, scripts[server], 16, args.warmup, 1)
                row[server] = [run_wrk(url, scripts[server], c, args.duration, threads=1 if c == 1 else 2)
                               for c in levels]
                row[f"{server}_rss_mb"] = srv.memory_mb("VmRSS") or 0.0
            finally:
                srv.stop()
        if r == 0:
            a, b = row.pop("kiln_check"), row.pop(f"{other}_check")
            cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
            print(f"answers agree: cosine kiln vs {other} over {len(cos)} sentences, min {cos.min():.6f}", flush=True)
            if cos.min() < 0.999:
                raise SystemExit("the two servers answer differently: fix the set-up before timing them")
        rounds.append(row)
        print(f"round {r + 1}: " + "; ".join(
            f"{s} c={x['concurrency']} {x['rps']:.0f} req/s p50 {x['p50_ms']:.2f} ms"
            for s in ("kiln", other) for x in row[s]), flush=True)

    median = {}
    for server in ("kiln", other):
        median[server] = median_runs([rd[server] for rd in rounds])
        median[f"{server}_rss_mb"] = statistics.median(rd[f"{server}_rss_mb"] for rd in rounds)
    report = {"artifact": args.artifact, "against": other, "rounds": rounds, "median": median, "cpus": os.cpu_count()}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nmedians of {args.rounds} rounds; RSS kiln {median['kiln_rss_mb']:.0f} MB, "
          f"{other} {median[f'{other}_rss_mb']:.0f} MB\n")
    print_table(median["kiln"], server="kiln")
    print_table(median[other], server=other, header=False)


if __name__ == "__main__":
    main()
