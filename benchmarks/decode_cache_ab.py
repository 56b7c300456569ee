"""A/B: how the KV cache travels between decode steps, measured as decode tokens/s.

    python benchmarks/decode_cache_ab.py ARTIFACT_OR_ONNX [--variant int4] [--batch 1,8] [--past 128]

Modes (``DecoderSession(io_binding=...)``):
  ortvalue  the graph's present buffers come back as OrtValues and go in again as the next past
            (``run_with_ort_values``): nothing is converted between steps.
  numpy     ``session.run``: the outputs come back as numpy arrays over onnxruntime's own buffers
            (no copy since onnxruntime 1.20) and go in again as the next step's inputs.
Rounds alternate the modes (the machine is shared: compare the ratio within a round)."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from modelkiln.generation.decoder import DecoderSession
from modelkiln.generation.engine import GenerationEngine


def onnx_path(target: str, variant: str | None) -> Path:
    path = Path(target)
    if path.suffix == ".onnx":
        return path
    from modelkiln.manifest import Manifest

    manifest = Manifest.load(path)
    chosen = manifest.variant(variant) if variant else manifest.fastest_variant()
    return path / chosen.file


def decode_rate(decoder: DecoderSession, batch: int, past: int, steps: int) -> float:
    engine = GenerationEngine(decoder)
    rng = np.random.default_rng(0)
    for row in range(batch):  # rows of slightly different lengths, as in real batches
        engine.add(row, rng.integers(10, 1000, size=past - row % 4).tolist())
    tokens = {row: 42 for row in range(batch)}
    engine.step(tokens)  # warm-up
    started = time.perf_counter()
    for _ in range(steps):
        engine.step(tokens)
    return batch * steps / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("target")
    parser.add_argument("--variant")
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--past", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    path = onnx_path(args.target, args.variant)
    decoders = {mode: DecoderSession(path, threads=args.threads, io_binding=(mode == "ortvalue"))
                for mode in ("ortvalue", "numpy")}
    for batch in [int(b) for b in args.batch.split(",")]:
        rates: dict[str, list[float]] = {mode: [] for mode in decoders}
        for round_ in range(args.rounds):
            order = list(decoders) if round_ % 2 == 0 else list(reversed(decoders))
            for mode in order:
                rates[mode].append(decode_rate(decoders[mode], batch, args.past, args.steps))
        ratios = [a / b for a, b in zip(rates["ortvalue"], rates["numpy"])]
        print(f"{path.name} batch {batch} past {args.past}: "
              + ", ".join(f"{m} {statistics.median(r):.1f} tok/s" for m, r in rates.items())
              + f"; ortvalue/numpy per round {', '.join(f'{x:.2f}' for x in ratios)}")


if __name__ == "__main__":
    main()
