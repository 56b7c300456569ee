"""kiln against llama.cpp at the model sizes users deploy, on the same GGUF file, 2 threads each.

For each shape (a GGUF file; benchmarks/generation/model_shapes.py makes them with random weights):
- convert: `kiln convert FILE --task text-generation [--convert-args]` once, its wall time and peak RSS (`/usr/bin/time -v`'s
  maximum resident set size);
- perplexity on the same tokens: llama-perplexity on SQuAD paragraphs with -c 512 (its chunks: the
  first token of each replaced by BOS where the vocabulary adds one; the second half of each scored),
  and kiln serve scoring exactly those chunks through /v1/completions with echo + logprobs (the
  token ids come from llama-server's /tokenize, so both see the same ids);
- served, in interleaved rounds (the order reversed every other round), each server alone: one
  stream (concurrency 1, 128-token answers: output tokens/s and ITL p50), 16 streams (output tokens/s,
  `kiln loadtest --check`: every answer under load compared with the same prompt answered alone),
  time to first token of a 512-token prompt (five prompts new to the server, max_tokens 1, p50),
  and the server's peak RSS (VmHWM).
kiln serve runs the artifact's default variant with --cpus 2 --max-batch-size 16; llama-server
-t 2 -tb 2 -np 16 -cb. Results: one JSON line per measurement, and a table per shape.

    python benchmarks/generation/model_sizes.py --llama-bin /work/models/bin --rounds 2 \\
        --shape qwen2.5-0.5b=/work/models/Qwen2.5-0.5B-Instruct-random/Qwen2.5-0.5B-Instruct-random.Q4_K_M.gguf \\
        --out benchmarks/results/model-sizes
    python benchmarks/generation/model_sizes.py --report benchmarks/results/model-sizes/rows.jsonl   # the table"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generation_servers import load_average, process  # noqa: E402

from modelkiln.data import read_squad  # noqa: E402
from modelkiln.machine import cpu_description  # noqa: E402
from modelkiln.net import free_port  # noqa: E402

MODEL = "m"
PPL_CONTEXT = 512


def log(row: dict, out: Path) -> None:
    print(json.dumps(row), flush=True)
    with (out / "rows.jsonl").open("a") as f:
        f.write(json.dumps(row) + "\n")


# --- servers ------------------------------------------------------------------------------------------


@contextmanager
def kiln_serve(artifact: Path, threads: int, max_batch: int, variant: str | None = None):
    port = free_port()
    command = [sys.executable, "-m", "modelkiln", "serve", f"{MODEL}={artifact}", "--port", str(port), "--grpc-port", "0",
               "--cpus", str(threads), "--max-batch-size", str(max_batch)] + (["--variant", variant] if variant else [])
    with process(command, f"http://127.0.0.1:{port}/v2/health/ready", timeout=1800) as proc:
        yield f"http://127.0.0.1:{port}", proc.pid


@contextmanager
def llama_server(binary: Path, gguf: Path, threads: int, max_batch: int, context: int):
    port = free_port()
    command = [str(binary), "-m", str(gguf), "-a", MODEL, "--host", "127.0.0.1", "--port", str(port),
               "-t", str(threads), "-tb", str(threads), "-np", str(max_batch), "-cb", "-c", str(max_batch * context)]
    with process(command, f"http://127.0.0.1:{port}/health", timeout=1800) as proc:
        yield f"http://127.0.0.1:{port}", proc.pid


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident set (VmHWM), in MB."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) / 1024  # type: ignore[union-attr]


# --- measurements ---------------------------------------------------------------------------------------


def loadtest(url: str, concurrency: int, check: bool, out: Path, label: str, args: argparse.Namespace) -> dict:
    path = out / f"{label}.json"
    command = [sys.executable, "-m", "modelkiln", "loadtest", url, "-m", MODEL, "--protocol", "openai-chat",
               "--inputs", "sts", "--max-tokens", str(args.max_tokens), "--ignore-eos", "--concurrency", str(concurrency),
               "--max-inputs", str(args.max_inputs), "--warmup", str(args.warmup), "--window", str(args.window),
               "--max-windows", str(args.max_windows), "--metrics-url", "none", "--label", label, "--json", str(path)]
    subprocess.run(command + (["--check"] if check else []), check=True, stdout=subprocess.DEVNULL)
    step = json.loads(path.read_text())["steps"][0]
    return {k: step.get(k) for k in ("output_tokens_per_s", "ttft_p50_ms", "itl_p50_ms", "checked", "mismatches",
                                     "errors", "stable")}


def ttft_512(url: str, windows: list[list[int]]) -> float:
    """p50 seconds to the first (and only) token of prompts of 512 token ids new to the server."""
    seconds = []
    for ids in windows:
        started = time.perf_counter()
        r = httpx.post(f"{url}/v1/completions", timeout=1800,
                       json={"model": MODEL, "prompt": ids, "max_tokens": 1, "temperature": 0})
        r.raise_for_status()
        seconds.append(time.perf_counter() - started)
    return sorted(seconds)[len(seconds) // 2]


def tokenize(url: str, text: str) -> list[int]:
    r = httpx.post(f"{url}/tokenize", json={"content": text, "add_special": True}, timeout=600)
    r.raise_for_status()
    return r.json()["tokens"]


def ppl_chunks(tokens: list[int], chunks: int, bos: int | None) -> list[list[int]]:
    """llama-perplexity's chunks of PPL_CONTEXT tokens, the first replaced by BOS where it adds one."""
    out = []
    for i in range(min(chunks, len(tokens) // PPL_CONTEXT)):
        chunk = tokens[i * PPL_CONTEXT:(i + 1) * PPL_CONTEXT]
        if bos is not None:
            chunk = [bos, *chunk[1:]]
        out.append(chunk)
    return out


def kiln_perplexity(url: str, chunks: list[list[int]]) -> float:
    """exp(mean NLL) of each chunk's second half, from the prompt's own log-probabilities (echo)."""
    first = PPL_CONTEXT // 2
    nll, count = 0.0, 0
    for chunk in chunks:
        r = httpx.post(f"{url}/v1/completions", timeout=3600, json={
            "model": MODEL, "prompt": chunk, "max_tokens": 1, "echo": True, "logprobs": 0, "temperature": 0})
        r.raise_for_status()
        logprobs = r.json()["choices"][0]["logprobs"]["token_logprobs"]
        # position j (j >= 1) holds log p(token j | tokens before it); llama-perplexity scores tokens first+1..end
        nll -= sum(logprobs[first + 1:PPL_CONTEXT])
        count += PPL_CONTEXT - 1 - first
    return math.exp(nll / count)


def llama_perplexity(binary: Path, gguf: Path, text: Path, chunks: int, threads: int) -> float:
    r = subprocess.run([str(binary), "-m", str(gguf), "-f", str(text), "-c", str(PPL_CONTEXT), "-b", str(PPL_CONTEXT),
                        "--chunks", str(chunks), "-t", str(threads)], capture_output=True, text=True, check=True)
    return float(re.search(r"Final estimate: PPL = ([\d.]+)", r.stdout + r.stderr).group(1))  # type: ignore[union-attr]


def convert(gguf: Path, artifact: Path, extra: list[str]) -> dict:
    started = time.perf_counter()
    r = subprocess.run(["/usr/bin/time", "-v", sys.executable, "-m", "modelkiln", "convert", str(gguf), "--task",
                        "text-generation", "--out", str(artifact), "--force", *extra], capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if r.returncode:
        raise RuntimeError(f"kiln convert failed: {r.stderr[-3000:]}")
    peak_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr).group(1))  # type: ignore[union-attr]
    return {"convert_s": round(seconds, 1), "convert_peak_rss_mb": round(peak_kb / 1024, 1)}


# --- one shape ------------------------------------------------------------------------------------------


def run_shape(name: str, gguf: Path, args: argparse.Namespace) -> None:
    out = args.out / name
    out.mkdir(parents=True, exist_ok=True)
    artifact = args.artifacts / name
    if args.convert or not artifact.is_dir():
        log({"shape": name, "step": "convert", "gguf_mb": round(gguf.stat().st_size / 1e6, 1),
             "load_before": load_average(), "convert_args": args.convert_args,
             **convert(gguf, artifact, args.convert_args.split())}, args.out)
    llama_server_bin, perplexity_bin = args.llama_bin / "llama-server", args.llama_bin / "llama-perplexity"
    steps = set(args.steps.split(","))
    text = out / "squad.txt"
    text.write_text("\n\n".join(read_squad()[0]))
    with llama_server(llama_server_bin, gguf, args.threads, 1, 4096) as (url, _):
        tokens = tokenize(url, text.read_text())
        bos_probe = tokenize(url, "a")
        plain = httpx.post(f"{url}/tokenize", json={"content": "a", "add_special": False}).json()["tokens"]
    bos = bos_probe[0] if len(bos_probe) > len(plain) else None
    chunks = ppl_chunks(tokens, args.ppl_chunks, bos)
    rng = random.Random(0)
    windows = [tokens[s:s + 512] for s in (rng.randrange(0, len(tokens) - 512) for _ in range(5 * args.rounds * 2))]
    servers = {
        "kiln": lambda: kiln_serve(artifact, args.threads, 16, args.variant),
        "llama.cpp": lambda: llama_server(llama_server_bin, gguf, args.threads, 16, 1024),
    }
    for round_ in range(1, args.rounds + 1):
        order = list(servers) if round_ % 2 else list(reversed(servers))
        for server in order:
            started = time.perf_counter()
            with servers[server]() as (url, pid):
                base = {"shape": name, "server": server, "round": round_}
                log({**base, "step": "start", "ready_s": round(time.perf_counter() - started, 1)}, args.out)
                httpx.post(f"{url}/v1/chat/completions", timeout=1800, json={
                    "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hello"}]}).raise_for_status()
                if "1" in steps:
                    log({**base, "step": "1 stream", "load_before": load_average(),
                         **loadtest(url, 1, False, out, f"{server}-r{round_}-c1", args)}, args.out)
                if "16" in steps:
                    log({**base, "step": "16 streams", "load_before": load_average(),
                         **loadtest(url, 16, round_ == 1, out, f"{server}-r{round_}-c16", args)}, args.out)
                mine = windows[(round_ - 1) * 10 + (0 if server == "kiln" else 5):][:5]
                if "ttft" in steps:
                    log({**base, "step": "ttft 512", "load_before": load_average(),
                         "ttft_512_p50_ms": round(1000 * ttft_512(url, mine), 1)}, args.out)
                if round_ == 1 and server == "kiln" and "ppl" in steps:
                    log({**base, "step": "perplexity", "chunks": len(chunks), "ppl": kiln_perplexity(url, chunks)}, args.out)
                log({**base, "step": "memory", "peak_rss_mb": round(peak_rss_mb(pid), 1)}, args.out)
    if "ppl" in steps:
        log({"shape": name, "server": "llama.cpp", "step": "perplexity", "chunks": len(chunks),
             "ppl": llama_perplexity(perplexity_bin, gguf, text, len(chunks), args.threads)}, args.out)


def report(rows_file: Path) -> str:
    """A Markdown table of the recorded rows: per shape, medians over rounds, kiln/llama.cpp ratios."""
    rows = [json.loads(line) for line in rows_file.read_text().splitlines() if line.strip()]

    def values(shape: str, server: str | None, step: str, key: str) -> list[float]:
        return [r[key] for r in rows if r.get("shape") == shape and r.get("step") == step
                and (server is None or r.get("server") == server) and r.get(key) is not None]

    def median(xs: list[float]) -> float | None:
        return statistics.median(xs) if xs else None

    def pair(shape: str, step: str, key: str, fmt: str, lower_is_better: bool = False) -> str:
        k, ll = median(values(shape, "kiln", step, key)), median(values(shape, "llama.cpp", step, key))
        if k is None or ll is None:
            return "-"
        return f"{k:{fmt}} / {ll:{fmt}} ({k / ll:.2f}x)"

    lines = ["| shape | convert: s, peak RSS | perplexity kiln / llama.cpp | 1 stream tok/s | 16 streams tok/s "
             "| TTFT 512 p50 ms | answers changed at 16 streams | server peak RSS MB | ready in s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for shape in dict.fromkeys(r["shape"] for r in rows if "shape" in r):
        conv = [r for r in rows if r.get("shape") == shape and r.get("step") == "convert"]
        convert = f"{conv[-1]['convert_s']} s, {conv[-1]['convert_peak_rss_mb'] / 1024:.2f} GB (file {conv[-1]['gguf_mb'] / 1000:.2f} GB)" \
            if conv else "-"
        ppl_k, ppl_l = values(shape, "kiln", "perplexity", "ppl"), values(shape, "llama.cpp", "perplexity", "ppl")
        ppl = f"{ppl_k[-1]:.6g} / {ppl_l[-1]:.6g} ({100 * (ppl_k[-1] / ppl_l[-1] - 1):+.2f}%)" if ppl_k and ppl_l else "-"
        changed = []
        for server in ("kiln", "llama.cpp"):
            checked = values(shape, server, "16 streams", "checked")
            if checked:
                changed.append(f"{server} {int(sum(values(shape, server, '16 streams', 'mismatches')))} of {int(sum(checked))}")
        lines.append(f"| {shape} | {convert} | {ppl} | {pair(shape, '1 stream', 'output_tokens_per_s', '.1f')} "
                     f"| {pair(shape, '16 streams', 'output_tokens_per_s', '.1f')} "
                     f"| {pair(shape, 'ttft 512', 'ttft_512_p50_ms', '.0f')} | {'; '.join(changed) or '-'} "
                     f"| {pair(shape, 'memory', 'peak_rss_mb', '.0f')} | {pair(shape, 'start', 'ready_s', '.1f')} |")
    return "\n".join(lines)


def main() -> None:
    if sys.argv[1:2] == ["--report"]:  # python model_sizes.py --report OUT/rows.jsonl
        print(report(Path(sys.argv[2])))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", action="append", required=True, help="NAME=GGUF (repeatable)")
    parser.add_argument("--llama-bin", type=Path, required=True, help="folder with llama-server and llama-perplexity")
    parser.add_argument("--artifacts", type=Path, default=Path("artifacts"))
    parser.add_argument("--convert", action="store_true", help="convert even when the artifact exists")
    parser.add_argument("--variant")
    parser.add_argument("--convert-args", default="", help="more options for kiln convert, e.g. --native-gguf")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-inputs", type=int, default=64)
    parser.add_argument("--warmup", type=float, default=3)
    parser.add_argument("--window", type=float, default=20)
    parser.add_argument("--max-windows", type=int, default=3)
    parser.add_argument("--ppl-chunks", type=int, default=8)
    parser.add_argument("--steps", default="1,16,ttft,ppl",
                        help="what to measure besides convert, start and memory: 1 (one stream), 16 (16 streams), ttft, ppl")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cpu = cpu_description()
    log({"machine": f"{cpu['cpu']} ({cpu['isa']})", "cores": os.cpu_count(), "threads": args.threads,
         "date": time.strftime("%Y-%m-%d %H:%M")}, args.out)
    for spec in args.shape:
        name, _, path = spec.partition("=")
        run_shape(name, Path(path), args)


if __name__ == "__main__":
    main()
