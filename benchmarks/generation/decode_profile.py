"""Where a continuous-batching run's engine time goes, by operator type: onnxruntime's own profiler
over N streams decoding at once (each a 64-token prompt of random ids and 48 greedy tokens), the
engine core stepping as it does when serving.

    python benchmarks/generation/decode_profile.py ARTIFACT [--streams 16,64] [--threads 2]

Prints, per number of streams, the engine calls and the summed node time by operator type (the
eight largest). Node time is what onnxruntime's kernels took, not the host's work between calls."""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
from pathlib import Path

import numpy as np

import modelkiln.generation.engines.onnx.decoder as decoder
import modelkiln.runtime.onnx as runtime
from modelkiln.generation.core import Request, greedy
from modelkiln.generation.model import CoreOptions, TextGenerationModel
from modelkiln.machine import cpu_description


def profile(artifact: Path, streams: int, threads: int, folder: str) -> str:
    plain = runtime.session_options

    def profiled(threads: int | None, memory_arena: bool = True):
        options = plain(threads, memory_arena)
        options.enable_profiling = True
        options.profile_file_prefix = f"{folder}/ort-{streams}"
        return options

    decoder.session_options = profiled  # the engine's sessions are opened through this name
    try:
        model = TextGenerationModel(artifact)
        core = model.core(None, CoreOptions(threads=threads, max_running=streams, prefix_cache_tokens=0))
    finally:
        decoder.session_options = plain
    prompts = np.random.default_rng(0).integers(100, model.tokenizer.get_vocab_size(), (streams, 64)).tolist()
    for i, ids in enumerate(prompts):
        core.add_request(Request(i, ids, greedy(48)))
    while core.has_work():
        core.step()
    events = json.loads(Path(core.engine.session.end_profiling()).read_text())
    by_op: collections.Counter[str] = collections.Counter()
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            by_op[event["args"].get("op_name", "?")] += event["dur"]
    calls = sum(1 for e in events if e.get("cat") == "Session" and e["name"] == "model_run")
    total = sum(by_op.values())
    lines = [f"{streams} streams: {calls} engine calls, node time {total / 1000:.1f} ms"]
    lines += [f"  {op:34s} {us / 1000:9.1f} ms  {100 * us / total:5.1f}%" for op, us in by_op.most_common(8)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--streams", default="16,64")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    print(f"{args.artifact.name}, {args.threads} threads; CPU {cpu_description()}")
    with tempfile.TemporaryDirectory() as folder:
        for streams in (int(s) for s in args.streams.split(",")):
            print(profile(args.artifact, streams, args.threads, folder), flush=True)


if __name__ == "__main__":
    main()
