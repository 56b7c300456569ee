"""How much of a continuous-batching decode step is not onnxruntime's run: N streams of STS-B chats
(128 tokens each, end-of-sequence ignored) through the engine core as ``kiln serve`` steps it, the
second of two waves timed. Per step with all N rows decoding: the wall time, the time inside
``run_with_iobinding`` and inside the engine's choice of the tokens (``_pick_all``); the rest is
the host's (scheduling, inputs, delivery).

    python benchmarks/generation/host_share.py ARTIFACT [--streams 64] [--mode greedy|sampled]"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from modelkiln.generation.core import Request, greedy, run_to_completion
from modelkiln.generation.model import CoreOptions, TextGenerationModel
from modelkiln.loadtest.inputs import load_items, select


def timed(method, into: list[float]):
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - started)
    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--mode", choices=("greedy", "sampled"), default="greedy")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    model = TextGenerationModel(args.artifact)
    core = model.core(model.default_variant().name, CoreOptions(threads=args.threads, max_running=args.streams))
    engine = core.engine
    runs: list[float] = []
    picks: list[float] = []
    engine.session.run_with_iobinding = timed(engine.session.run_with_iobinding, runs)
    engine._pick_all = timed(engine._pick_all, picks)
    prompts = [model.prompt_ids(text, chat=True) for text in select(load_items("sts"), limit=args.streams)]
    sampled = {"temperature": 0.7, "top_p": 0.95} if args.mode == "sampled" else {}
    steps: list[tuple[float, float, float]] = []
    for wave in ("warm", "timed"):
        requests = [Request(f"{wave}-{i}", ids, greedy(128, **sampled, seed=i if sampled else None))
                    for i, ids in enumerate(prompts)]
        last, counts = time.perf_counter(), 0
        runs.clear(), picks.clear()
        for output in run_to_completion(core, requests):
            counts += 1
            if counts % args.streams:  # a step's outputs come together: time each step at its last one
                continue
            now = time.perf_counter()
            if wave == "timed" and len(runs) == 1 and len(picks) == 1:  # a decode step of all the rows
                steps.append((now - last, runs[0], picks[0]))
            runs.clear(), picks.clear()
            last = now
    wall, run, pick = (statistics.median(s[i] for s in steps) for i in range(3))
    print(f"{args.streams} streams, {args.mode}, {len(steps)} steps: wall {1000 * wall:.2f} ms, run "
          f"{1000 * run:.2f} ms, choosing the tokens {1000 * pick:.2f} ms, the rest {1000 * (wall - run - pick):.2f} ms "
          f"(the host: {100 * (wall - run) / wall:.1f}% of a step)")


if __name__ == "__main__":
    main()
