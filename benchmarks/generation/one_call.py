"""One call a step against two, on a KilnAttention serving graph: the engine core with prompts arriving
while other streams decode, the step's prompt chunks and decode rows in one engine call (``mixed_steps``,
the engine's way) or in two (a prompt call, then a decode call: the way GroupQueryAttention graphs must).

    PYTHONPATH=src python benchmarks/generation/one_call.py ARTIFACT [--streams 16] [--requests 48] \
        [--prompt 256] [--new-tokens 64] [--rounds 3] [--out FILE]

Closed loop: ``--streams`` requests in flight, a new one added as one ends, ``--requests`` in all, each
a prompt of ``--prompt`` token ids (drawn at random from the vocabulary: the speed of a step does not
depend on which tokens) and ``--new-tokens`` greedy tokens. Per way: output tokens/s over the run,
time to first token and the gaps between a stream's tokens (p50, p90), and whether every answer equals
the other way's. The two ways run alternately ``--rounds`` times; the table gives the median of each."""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import numpy as np

from modelkiln.generation.core import Request, greedy
from modelkiln.generation.model import CoreOptions, TextGenerationModel
from modelkiln.machine import cpu_description


def run(core, prompts: list[list[int]], streams: int, new_tokens: int) -> dict:
    pending = list(enumerate(prompts))
    added: dict[int, float] = {}
    last: dict[int, float] = {}
    ttft, gaps, answers = [], [], {i: [] for i in range(len(prompts))}
    started = time.perf_counter()

    def add() -> None:
        i, ids = pending.pop(0)
        added[i] = time.perf_counter()
        core.add_request(Request(i, ids, greedy(new_tokens)))

    for _ in range(min(streams, len(pending))):
        add()
    while core.has_work():
        for output in core.step():
            if output.error is not None:
                raise output.error
            now, i = time.perf_counter(), output.request_id
            answers[i].append(output.delta.token_id)
            (ttft.append(now - added[i]) if i not in last else gaps.append(now - last[i]))
            last[i] = now
            if output.delta.finish_reason and pending:
                add()
    wall = time.perf_counter() - started
    return {"tok/s": sum(map(len, answers.values())) / wall, "ttft p50 ms": 1000 * statistics.median(ttft),
            "ttft p90 ms": 1000 * float(np.percentile(ttft, 90)), "itl p50 ms": 1000 * statistics.median(gaps),
            "itl p90 ms": 1000 * float(np.percentile(gaps, 90)), "answers": answers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--variant", default=None)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    model = TextGenerationModel(args.artifact)
    core = model.core(args.variant, CoreOptions(threads=args.threads, max_running=args.streams, warm_up=True,
                                                prefix_cache_tokens=0))
    one_call = core.engine.capabilities
    if not one_call.mixed_steps:
        raise SystemExit(f"{args.artifact}: its engine runs a step in two calls already (no KilnAttention graph)")
    ways = {"one call": one_call, "two calls": dataclasses.replace(one_call, mixed_steps=False)}
    vocab = model.tokenizer.get_vocab_size()
    prompts = np.random.default_rng(0).integers(100, vocab, (args.requests, args.prompt)).tolist()
    results: dict[str, list[dict]] = {way: [] for way in ways}
    for round_ in range(args.rounds):
        for way, capabilities in ways.items():
            core.engine.capabilities = capabilities
            results[way].append(run(core, prompts, args.streams, args.new_tokens))
            print(f"round {round_ + 1} {way}: " + ", ".join(f"{k} {v:.1f}" for k, v in results[way][-1].items()
                                                              if k != "answers"), flush=True)
    same = all(r["answers"] == results["one call"][0]["answers"] for rs in results.values() for r in rs)
    figures = [k for k in results["one call"][0] if k != "answers"]
    table = {way: {k: round(statistics.median(r[k] for r in rs), 2) for k in figures} for way, rs in results.items()}
    header = (f"{args.artifact.name}: {args.streams} streams, {args.requests} requests of {args.prompt} prompt tokens "
              f"and {args.new_tokens} new, prefill chunk {core.prefill_chunk}, {args.threads} threads, "
              f"{args.rounds} rounds (medians); CPU {cpu_description()}")
    lines = [header, f"{'way':<10} " + " ".join(f"{k:>12}" for k in figures)]
    lines += [f"{way:<10} " + " ".join(f"{row[k]:>12.2f}" for k in figures) for way, row in table.items()]
    lines.append(f"every answer the same both ways, every round: {same}")
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
        args.out.with_suffix(".json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                             "table": table, "same_answers": same}, indent=2) + "\n")


if __name__ == "__main__":
    main()
