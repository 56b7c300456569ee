"""Speculative decoding served: kiln serve plain, kiln serve with ``--speculate ngram``, llama-server plain
and with its own speculation (``--llama-spec``, by default its n-gram lookup ``--spec-type ngram-simple``) on
the same GGUF, one request at a time, on the benchmark's prompts whose answers quote them (and the open
ones), through each server's OpenAI chat route with its own chat template, greedy:

    LLAMA_SERVER=.../llama-server python benchmarks/generation/speculation_served.py --artifact ARTIFACT \
        --gguf SmolLM2-135M-Instruct.Q4_1.gguf [--rounds 2] [--out FILE]

Each server runs alone on the machine's cores in turn (2 threads each), started once and warmed up; the
prompts go one after another, the servers in interleaved rounds (the order reversed every other round).
Per server and prompt set: decode tokens/s = the answers' tokens after their first, over the seconds from
each answer's first streamed token to its last, summed over the prompts (time to first token apart). The
answers end where each server's model ends them (at most ``--max-tokens``); kiln's two ways must give the
same text (speculation changes no answer), counted in the output."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generation_servers import process  # noqa: E402
from modelkiln.machine import cpu_description  # noqa: E402
from modelkiln.net import free_port  # noqa: E402

PROMPTS = Path(__file__).parent / "prompts" / "speculation.json"


def one(port: int, model: str, prompt: str, max_tokens: int) -> tuple[str, int, float]:
    """(text, tokens, seconds from the first streamed token to the last) of one greedy chat answer."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    times, pieces, tokens = [], [], 0
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    times.append(time.perf_counter())
                    pieces.append(choice["delta"]["content"])
    return "".join(pieces), tokens or len(times), times[-1] - times[0] if len(times) > 1 else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", type=Path, required=True)
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--llama-spec", default="--spec-type ngram-simple",
                        help="llama-server's own speculative decoding, run as a fourth server (its defaults)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    prompts = json.loads(PROMPTS.read_text())
    sets = {name: prompts[name] for name in ("grounded", "open")}

    def kiln(port: int, *more: str) -> list[str]:
        return [sys.executable, "-m", "modelkiln", "serve", str(args.artifact), "--port", str(port), "--grpc-port", "0",
                "--cpus", "2", "--threads", "2", *more]

    llama_spec = f"llama-server {args.llama_spec}"
    ports = {name: free_port() for name in ("kiln serve", "kiln serve --speculate ngram", "llama-server", llama_spec)}

    def llama(port: int, *more: str) -> list[str]:
        return [os.environ["LLAMA_SERVER"], "-m", str(args.gguf), "-t", "2", "-tb", "2", "-c", "4096", "--parallel", "1",
                "--host", "127.0.0.1", "--port", str(port), *more]

    commands = {
        "kiln serve": (kiln(ports["kiln serve"]), "/v2/health/ready"),
        "kiln serve --speculate ngram": (kiln(ports["kiln serve --speculate ngram"], "--speculate", "ngram"),
                                         "/v2/health/ready"),
        "llama-server": (llama(ports["llama-server"]), "/health"),
        llama_spec: (llama(ports[llama_spec], *args.llama_spec.split()), "/health"),  # its own speculation
    }
    rates: dict[str, dict[str, list[float]]] = {s: {k: [] for k in sets} for s in commands}
    texts: dict[str, dict[tuple[str, int], str]] = {s: {} for s in commands}
    for round_ in range(args.rounds):
        order = list(commands) if round_ % 2 == 0 else list(reversed(commands))
        for name in order:  # each server alone on the cores while it is measured
            command, ready = commands[name]
            port = ports[name]
            with process(command, f"http://127.0.0.1:{port}{ready}"):
                model = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"][0]["id"]
                one(port, model, "Hello", 8)  # warm-up
                for kind, texts_of_kind in sets.items():
                    tokens, seconds = 0, 0.0
                    for i, prompt in enumerate(texts_of_kind):
                        text, n, s = one(port, model, prompt, args.max_tokens)
                        texts[name][kind, i] = text
                        tokens, seconds = tokens + max(n - 1, 0), seconds + s
                    rates[name][kind].append(tokens / seconds)
                    print(f"round {round_ + 1} {name} {kind}: {tokens / seconds:.1f} decode tok/s", flush=True)
    same = sum(texts["kiln serve"][k] == texts["kiln serve --speculate ngram"][k] for k in texts["kiln serve"])
    lines = [f"{args.gguf.name}: one request at a time, greedy, at most {args.max_tokens} tokens, 2 threads each, "
             f"{args.rounds} rounds (medians); CPU {cpu_description()}",
             f"{'server':<30} " + " ".join(f"{k + ' tok/s':>16}" for k in sets)]
    table = {name: {k: statistics.median(v) for k, v in by_kind.items()} for name, by_kind in rates.items()}
    lines += [f"{name:<30} " + " ".join(f"{table[name][k]:>16.1f}" for k in sets) for name in commands]
    for k in sets:
        spec = table["kiln serve --speculate ngram"][k]
        lines.append(f"{k}: speculating x{spec / table['kiln serve'][k]:.2f} plain kiln, "
                     f"x{spec / table['llama-server'][k]:.2f} llama-server, x{spec / table[llama_spec][k]:.2f} {llama_spec}")
    lines.append(f"kiln's answers the same with and without speculation: {same} of {len(texts['kiln serve'])}")
    print("\n".join(lines))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
