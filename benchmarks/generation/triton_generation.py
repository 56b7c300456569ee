"""Streaming generation on the Triton repository `kiln triton` writes for a text-generation artifact:
time to first token, inter-token latency and output tokens/s with 1, 2 and 4 concurrent streaming
clients (`/generate_stream`, `stream: true`, greedy, `ignore_eos` so every answer has the same length).

    python benchmarks/generation/triton_generation.py /work/main/artifacts/smollm2 --tokens 32 --rounds 2 \\
        --out benchmarks/results/triton-generation

Aggregate tokens/s rising with clients shows requests batched across one another (one decode step
serves every running sequence). kiln serve has no generation routes yet, so there is no kiln serve
row; `kiln generate`'s own single-stream decode rate is printed for reference."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from modelkiln.manifest import Manifest
from modelkiln.triton import server as triton_server
from modelkiln.triton.config import Options
from modelkiln.triton.repository import model_name, write_repository

PROMPTS = ["The capital of France is", "Write a short story about a robot:", "Explain photosynthesis simply.",
           "List three uses of copper:"]


def stream_one(url: str, prompt: str, tokens: int) -> dict:
    body = {"text_input": prompt, "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True, "stream": True}
    started = time.perf_counter()
    arrivals = []
    with httpx.stream("POST", url, json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: "):
                arrivals.append(time.perf_counter())
                assert "error" not in json.loads(line[6:]), line
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return {"ttft_s": arrivals[0] - started, "itl_s": gaps, "events": len(arrivals),
            "total_s": arrivals[-1] - started}


def run_level(url: str, clients: int, tokens: int) -> dict:
    results: list[dict] = [None] * clients  # type: ignore[list-item]

    def client(i: int) -> None:
        results[i] = stream_one(url, PROMPTS[i % len(PROMPTS)], tokens)

    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    gaps = [g for r in results for g in r["itl_s"]]
    return {"clients": clients, "ttft_ms_median": 1000 * statistics.median(r["ttft_s"] for r in results),
            "itl_ms_median": 1000 * statistics.median(gaps), "itl_ms_p95": 1000 * sorted(gaps)[int(0.95 * (len(gaps) - 1))],
            "output_tokens_per_s": clients * tokens / wall, "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--clients", default="1,2,4")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/triton-generation"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    name = model_name(Manifest.load(args.artifact))
    generate = subprocess.run([sys.executable, "-m", "modelkiln", "generate", str(args.artifact), PROMPTS[0], "-n",
                               str(args.tokens), "--temperature", "0", "--ignore-eos", "--threads", str(args.threads),
                               "--json"], capture_output=True, text=True, check=True)
    reference = json.loads(generate.stdout)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kiln-triton-gen-") as tmp:
        repo = write_repository(args.artifact, Path(tmp) / "repo", Options(threads=args.threads, max_batch_size=8))
        srv = triton_server.start(repo, timeout=600)
        try:
            url = f"http://{srv.url}/v2/models/{name}/generate_stream"
            stream_one(url, PROMPTS[0], 4)  # warm-up
            for round_ in range(1, args.rounds + 1):
                for clients in (int(c) for c in args.clients.split(",")):
                    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
                    row = {"round": round_, **run_level(url, clients, args.tokens), "load_before": load}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        finally:
            srv.stop()
    lines = [f"# Triton generation ({name}, {reference['variant']}, {args.tokens} tokens per answer, greedy, "
             f"{args.threads} threads, {args.rounds} rounds; median over rounds)", "",
             "| clients | TTFT ms | ITL ms (p50) | ITL ms (p95) | output tokens/s (all clients) | rounds (tokens/s) |",
             "|---|---|---|---|---|---|"]
    for clients in dict.fromkeys(r["clients"] for r in rows):
        mine = [r for r in rows if r["clients"] == clients]
        med = {k: statistics.median(r[k] for r in mine) for k in ("ttft_ms_median", "itl_ms_median", "itl_ms_p95",
                                                                  "output_tokens_per_s")}
        each = ", ".join(f"{r['output_tokens_per_s']:.1f}" for r in mine)
        lines.append(f"| {clients} | {med['ttft_ms_median']:.0f} | {med['itl_ms_median']:.0f} | {med['itl_ms_p95']:.0f} "
                     f"| {med['output_tokens_per_s']:.1f} | {each} |")
    lines += ["", f"kiln generate (one stream, same prompt and settings): first token "
              f"{1000 * reference['time_to_first_token_s']:.0f} ms, decode {reference['decode_tokens_per_s']} tokens/s.",
              "Load average before each level: " + "; ".join(f"r{r['round']} c{r['clients']}: {r['load_before']}"
                                                            for r in rows)]
    (args.out / "rows.json").write_text(json.dumps(rows, indent=1))
    (args.out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
