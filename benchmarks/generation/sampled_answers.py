"""Greedy and seeded sampled answers, written down so that two builds of kiln can be compared answer by answer.

Runs STS-B sentences as chat prompts through the engine core (as ``kiln serve`` runs it), 16 at a time,
under several sampling settings, each request with its own seed, and writes every answer's token ids.
Run it once with one build and once with another (``PYTHONPATH=OTHER/src``), then ``--compare`` the two
files: a sampler that changed no token gives 0 differing answers.

    python benchmarks/generation/sampled_answers.py ARTIFACT --out before.json   # with the old build
    python benchmarks/generation/sampled_answers.py ARTIFACT --out after.json
    python benchmarks/generation/sampled_answers.py --compare before.json after.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from modelkiln.data import sts_sentences
from modelkiln.generation.core import Request
from modelkiln.generation.model import CoreOptions, TextGenerationModel
from modelkiln.generation.sampling import SamplingParams

# Settings every build compared has (min_p is newer than some of them).
SETTINGS = {
    "greedy": dict(temperature=0.0),
    "t0.7 top_p0.95": dict(temperature=0.7, top_p=0.95),
    "t1.0": dict(temperature=1.0),
    "t1.0 top_k40": dict(temperature=1.0, top_k=40),
    "t0.8 top_k50 top_p0.9 penalties": dict(temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.1,
                                            frequency_penalty=0.4, presence_penalty=0.2),
    "t1.3 top_p0.8 bias": dict(temperature=1.3, top_p=0.8, logit_bias=((28, 3.0), (30, -4.0))),
}


def answers(artifact: Path, prompts: int, tokens: int, running: int) -> dict:
    model = TextGenerationModel(artifact)
    core = model.core(options=CoreOptions(threads=2, max_running=running))
    texts = sts_sentences()[:prompts]
    out: dict[str, list[list[int]]] = {}
    started = time.perf_counter()
    for name, settings in SETTINGS.items():
        tokens_of: dict[int, list[int]] = {i: [] for i in range(len(texts))}
        for i, text in enumerate(texts):
            params = SamplingParams(max_new_tokens=tokens, seed=1000 + i, **settings)
            core.add_request(Request(i, model.prompt_ids(text, chat=True), params))
        while core.has_work():
            for output in core.step():
                if output.error is not None:
                    raise output.error
                tokens_of[output.request.request_id].append(output.delta.token_id)
        out[name] = [tokens_of[i] for i in range(len(texts))]
        print(f"{name}: {len(texts)} answers, {sum(map(len, out[name]))} tokens", file=sys.stderr, flush=True)
    return {"artifact": str(artifact), "tokens": tokens, "running": running, "seconds": time.perf_counter() - started,
            "answers": out}


def compare(first: Path, second: Path) -> int:
    a, b = json.loads(first.read_text())["answers"], json.loads(second.read_text())["answers"]
    differ = compared = 0
    for name in a:
        for i, (x, y) in enumerate(zip(a[name], b[name])):
            compared += 1
            if x != y:
                differ += 1
                where = next((k for k, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
                print(f"{name} #{i}: differs from token {where}")
    print(f"{differ} of {compared} answers differ ({first} vs {second})")
    return differ


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", type=Path, nargs="?")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--running", type=int, default=16)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--settings", help="comma-separated names of SETTINGS (default: all)")
    parser.add_argument("--compare", type=Path, nargs=2)
    args = parser.parse_args()
    if args.compare:
        sys.exit(1 if compare(*args.compare) else 0)
    if args.settings:
        for name in set(SETTINGS) - set(args.settings.split(",")):
            del SETTINGS[name]
    result = answers(args.artifact, args.prompts, args.tokens, args.running)
    args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
