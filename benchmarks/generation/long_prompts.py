"""Long prompts served: the first token of a 4k- and an 8k-token prompt (prefill tokens/s) and the decode speed
after it, kiln serve against llama-server on the same GGUF file, one request at a time, 2 threads each.

    LLAMA_SERVER=PATH python benchmarks/generation/long_prompts.py --artifact ARTIFACT --gguf FILE \
        [--lengths 4096,8192] [--new-tokens 32] [--rounds 2] [--out FILE]

The prompts are SQuAD dev paragraphs (../shared/data) one after another, each request its own stretch of exactly
that many token ids of the GGUF's tokenizer, starting where no other does (so no prompt cache helps), sent as token
ids to each server's OpenAI completions route (streamed, greedy, end of sequence ignored). Per server and length: prefill tokens/s = prompt tokens / time to the first token, and
decode tokens/s = (new tokens - 1) / (last chunk's time - first chunk's). The servers take turns, the order
turned every round; medians of the rounds."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "src"))

from generation_servers import process  # noqa: E402
from modelkiln.data import read_squad  # noqa: E402
from modelkiln.machine import cpu_description  # noqa: E402
from modelkiln.net import free_port  # noqa: E402


def one(port: int, model: str, ids: list[int], new_tokens: int) -> tuple[float, float, int]:
    """(seconds to the first token, decode tokens/s after it, tokens) of one streamed completion."""
    body = {"model": model, "prompt": ids, "max_tokens": new_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    started = time.perf_counter()
    times = []
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices"):  # a random model's token may decode to no text: every chunk counts
                    times.append(time.perf_counter())
    # the answer is new_tokens long (end of sequence ignored), however its chunks came
    return times[0] - started, (new_tokens - 1) / (times[-1] - times[0]), len(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", type=Path, required=True)
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--lengths", default="4096,8192")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from tokenizers import Tokenizer

    lengths = [int(n) for n in args.lengths.split(",")]
    tokenizer = Tokenizer.from_file(str(args.artifact / "tokenizer.json"))
    contexts, _ = read_squad()
    text = "\n\n".join(dict.fromkeys(contexts))
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    # each request its own stretch of the text, starting where no other does, so none shares a first
    # token with another and no server's prompt cache (a common prefix) can help; stretches may overlap
    starts = [256 + 509 * i for i in range(args.rounds * len(lengths))]
    if starts[-1] + max(lengths) > len(ids):
        raise SystemExit(f"the SQuAD subset holds {len(ids)} tokens, fewer than these requests take")
    stretches = {(round_, n): ids[starts[round_ * len(lengths) + i]:][:n]
                 for round_ in range(args.rounds) for i, n in enumerate(lengths)}
    assert len({tuple(s[:64]) for s in stretches.values()}) == len(stretches)  # no shared beginnings
    context = max(lengths) + args.new_tokens + 64
    kiln_port, llama_port = free_port(), free_port()
    commands = {  # (command, its readiness route, its port)
        "kiln serve": ([sys.executable, "-m", "modelkiln", "serve", str(args.artifact), "--port", str(kiln_port),
                        "--grpc-port", "0", "--cpus", "2", "--threads", "2"], "/v2/health/ready", kiln_port),
        "llama-server": ([os.environ["LLAMA_SERVER"], "-m", str(args.gguf), "-t", "2", "-tb", "2", "-c", str(context),
                          "--parallel", "1", "--host", "127.0.0.1", "--port", str(llama_port)], "/health", llama_port),
    }
    results: dict[str, dict[int, list[tuple[float, float]]]] = {s: {n: [] for n in lengths} for s in commands}
    with ExitStack() as servers:
        models = {}
        for name, (command, ready, port) in commands.items():
            servers.enter_context(process(command, f"http://127.0.0.1:{port}{ready}"))
            # each server's own name for the model, then a warm-up request
            models[name] = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"][0]["id"]
            one(port, models[name], ids[:256], 4)
        for round_ in range(args.rounds):
            order = list(commands) if round_ % 2 == 0 else list(reversed(commands))
            for n in lengths:
                for name in order:
                    ttft, decode, _ = one(commands[name][2], models[name], stretches[round_, n], args.new_tokens)
                    results[name][n].append((n / ttft, decode))
                    print(f"round {round_ + 1} {name} {n}: prefill {n / ttft:.1f} tok/s, decode {decode:.2f} tok/s",
                          flush=True)
    lines = [f"{args.gguf.name}: one request at a time, {args.new_tokens} new tokens, 2 threads each, {args.rounds} "
             f"rounds (medians); CPU {cpu_description()}",
             f"{'server':<14} {'prompt':>7} {'prefill tok/s':>14} {'decode tok/s':>13}"]
    table = {}
    for name in commands:
        for n in lengths:
            prefill = statistics.median(r[0] for r in results[name][n])
            decode = statistics.median(r[1] for r in results[name][n])
            table[f"{name} {n}"] = {"prefill": round(prefill, 1), "decode": round(decode, 2)}
            lines.append(f"{name:<14} {n:>7} {prefill:>14.1f} {decode:>13.2f}")
    for n in lengths:
        k, ll = table[f"kiln serve {n}"], table[f"llama-server {n}"]
        lines.append(f"kiln / llama-server at {n}: prefill x{k['prefill'] / ll['prefill']:.2f}, "
                     f"decode x{k['decode'] / ll['decode']:.2f}")
    print("\n".join(lines))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
