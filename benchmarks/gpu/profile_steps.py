"""Where a torch-engine step's time goes: PyTorch's profiler over decode steps at 1 and 64 rows and
one prompt step of 2048 tokens, through the engine core as `kiln serve` runs it (warm-up and decode
graphs included). Prints, per kind of step, its wall time and the operators that took the most host
time and the most device time: on a GPU a step that is all host time is waiting on Python and
kernel launches, not on the device.

    python benchmarks/gpu/profile_steps.py --artifact ARTIFACT [--device cuda] [--rows 64]

ARTIFACT: a text-generation artifact with a torch variant (``kiln convert MODEL --task
text-generation --engine torch``)."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from modelkiln.generation.core import Request, greedy  # noqa: E402
from modelkiln.generation.model import CoreOptions, TextGenerationModel  # noqa: E402


def steps(core, count: int) -> list[float]:
    took = []
    for _ in range(count):
        started = time.perf_counter()
        core.step()
        if core.engine.device.type == "cuda":
            torch.cuda.synchronize()
        took.append(time.perf_counter() - started)
    return took


def report(name: str, prof, took: list[float], device: str) -> None:
    what = f"a step (median of {len(took)})" if len(took) > 1 else "in all"
    print(f"\n== {name}: {statistics.median(took) * 1000:.2f} ms {what}", flush=True)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15), flush=True)
    if device == "cuda":
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=10), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=2048, help="tokens of the one long prompt")
    args = parser.parse_args()
    model = TextGenerationModel(args.artifact)
    # every row as long as the long prompt: on CUDA each sequence's slot holds the budget / rows
    core = model.core(None, CoreOptions(device=args.device, max_running=args.rows, warm_up=True,
                                        kv_budget=args.rows * (args.prompt + 64)))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    print(f"prompt tokens a step: {core.prefill_chunk}; device: {args.device}", flush=True)
    for rows in (1, args.rows):
        ids = [(rows, i) for i in range(rows)]
        for request_id in ids:
            core.add_request(Request(request_id, list(range(10, 42)), greedy(64)))  # aborted after 25 steps
        while core.decoding < rows:
            core.step()
        steps(core, 5)
        with profile(activities=activities) as prof:
            took = steps(core, 20)
        report(f"decode, {rows} rows", prof, took, args.device)
        for request_id in ids:
            core.abort(request_id)
        while core.has_work():
            core.step()
    core.add_request(Request("long", [10 + i % 300 for i in range(args.prompt)], greedy(1)))
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        while core.has_work():
            core.step()
        if args.device == "cuda":
            torch.cuda.synchronize()
        took = [time.perf_counter() - started]
    report(f"a {args.prompt}-token prompt to its first token", prof, took, args.device)


if __name__ == "__main__":
    main()
