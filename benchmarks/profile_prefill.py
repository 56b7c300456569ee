"""Where a prefill's time goes: onnxruntime's own profiler (``SessionOptions.enable_profiling``)
on a prefill of LENGTH real tokens at batch 1, each op type's share of the kernel time, for each
graph given. The session options are the engine's (runtime/onnx.py session_options). With
``--past P --length 1``: a decode step after a (random) cache of P tokens instead.

    python benchmarks/profile_prefill.py ARTIFACT [--variant fp32 ...] [--onnx NAME=PATH ...]
        [--length 512] [--past 0] [--runs 3] [--threads 2]"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import onnxruntime as ort

from modelkiln.bench.generation import real_token_windows
from modelkiln.generation.model import TextGenerationModel
from modelkiln.runtime.onnx import session_options


def profile(path: Path, ids: list[int], runs: int, threads: int, past: int = 0) -> tuple[list[float], dict[str, float]]:
    """Wall seconds per run, and kernel milliseconds per op type averaged over the runs after the first."""
    options = session_options(threads)
    options.enable_profiling = True
    with tempfile.TemporaryDirectory() as scratch:
        options.profile_file_prefix = str(Path(scratch) / "prefill")
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        inputs = session.get_inputs()
        kv_heads, head_dim = inputs[3].shape[1], inputs[3].shape[3]
        feeds = {"input_ids": np.asarray([ids], np.int64), "attention_mask": np.ones((1, past + len(ids)), np.int64),
                 "position_ids": np.arange(past, past + len(ids), dtype=np.int64)[None]}
        rng = np.random.default_rng(0)
        for i in inputs[3:]:
            feeds[i.name] = rng.standard_normal((1, kv_heads, past, head_dim)).astype(np.float32)
        walls = []
        for _ in range(runs):  # the first run is a warm-up, left out of the per-op times
            started = time.perf_counter()
            session.run(["logits"], feeds)
            walls.append(time.perf_counter() - started)
        events = json.loads(Path(session.end_profiling()).read_text())
    run_spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "model_run")
    first_end = run_spans[0][1]
    per_op: dict[str, float] = defaultdict(float)
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] > first_end:
            per_op[e["args"]["op_name"]] += e["dur"] / 1000 / (runs - 1)
    return walls, dict(per_op)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("artifact")
    parser.add_argument("--variant", action="append", default=[])
    parser.add_argument("--onnx", action="append", default=[], help="NAME=PATH")
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--past", type=int, default=0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    model = TextGenerationModel(args.artifact)
    graphs = {name: model.variant_path(name)[1] for name in args.variant or ["fp32"]}
    graphs.update({spec.split("=", 1)[0]: Path(spec.split("=", 1)[1]) for spec in args.onnx})
    ids = real_token_windows(model, args.length, 1)[0]
    for name, path in graphs.items():
        walls, per_op = profile(path, ids, args.runs, args.threads, args.past)
        total = sum(per_op.values())
        print(f"{name}: {args.length} tokens after a past of {args.past}, wall s per run {', '.join(f'{w:.2f}' for w in walls)}; "
              f"kernel time {total:.0f} ms per run (runs after the first)")
        for op, ms in sorted(per_op.items(), key=lambda kv: -kv[1])[:8]:
            print(f"  {op:24s} {ms:8.1f} ms  {100 * ms / total:5.1f}%")


if __name__ == "__main__":
    main()
