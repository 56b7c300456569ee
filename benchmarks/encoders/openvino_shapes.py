"""What a change of input shape costs OpenVINO's CPU plugin, and what running rows padded to buckets
of their length buys back (runtime/openvino.py's BUCKET), against onnxruntime on kiln's int8.

1. One compiled model, batch 1: the same shape call after call (16 tokens, 20 tokens), then 16 and
   20 alternating, then 16/20/32 in turn: the difference is what each shape change costs. 1b: the
   same for the number of rows (1 to 4 rows of 16 tokens, each repeated, then in turn).
2. STS-B sentences (shuffled, seed 0) in batches of 4 of neighbouring lengths, as a server forms them,
   and one at a time: ms per text with each row run at its exact length, in buckets of 8 and of 16
   tokens, and onnxruntime's int8 on the same batches (padded to the longest, one call).

    PYTHONPATH=src python benchmarks/encoders/openvino_shapes.py ARTIFACT --threads 1 --out OUT

ARTIFACT: `kiln convert MODEL --precision fp32,int8,openvino-int8` (openvino and nncf installed)."""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from modelkiln.bench.runner import make_feeds
from modelkiln.data import sts_sentences
from modelkiln.machine import cpu_description
from modelkiln.manifest import Manifest
from modelkiln.runtime import openvino as ov_engine
from modelkiln.runtime.pipeline import load_encoder, load_variant

Feeds = dict[str, np.ndarray]


def per_call_ms(run: Callable[[Feeds], object], feeds: list[Feeds], calls: int = 300) -> float:
    start = time.perf_counter()
    for i in range(calls):
        run(feeds[i % len(feeds)])
    return (time.perf_counter() - start) / calls * 1e3


def per_text_ms(run: Callable[[Feeds], object], batches: list[Feeds]) -> float:
    start = time.perf_counter()
    for feeds in batches:
        run(feeds)
    return (time.perf_counter() - start) / sum(len(f["input_ids"]) for f in batches) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--variant", default="openvino-int8")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True, help="writes OUT.txt")
    args = parser.parse_args()
    manifest = Manifest.load(args.artifact)
    lines = [f"{cpu_description()}, {args.threads} thread(s), {args.variant} against onnxruntime int8"]

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    engine = load_variant(args.artifact, manifest, manifest.variant(args.variant), threads=args.threads)
    onnx = load_variant(args.artifact, manifest, manifest.variant("int8"), threads=args.threads)
    assert isinstance(engine, ov_engine.OpenVinoEngine)
    f16, f20, f32 = (make_feeds(args.artifact, manifest, 1, n) for n in (16, 20, 32))
    say("1. ms a call, batch 1: same 16 | same 20 | 16/20 alternating | 16/20/32 in turn")
    for _ in range(args.rounds):
        for label, run in (("openvino (one call, as given)", engine._infer), ("onnxruntime int8", onnx.run)):
            for f in (f16, f20, f32):
                run(f)
            cells = [per_call_ms(run, seq) for seq in ([f16], [f20], [f16, f20], [f16, f20, f32])]
            say(f"   {label:32s} " + " | ".join(f"{c:.3f}" for c in cells))
    # a server's batches differ in their number of rows too, which buckets of width do not cover
    sizes = [make_feeds(args.artifact, manifest, rows, 16) for rows in (1, 2, 3, 4)]
    say("1b. ms a call, 16 tokens: 1 | 2 | 3 | 4 rows, each repeated; their mean; the four sizes in turn")
    for _ in range(args.rounds):
        for label, run in (("openvino (one call, as given)", engine._infer), ("onnxruntime int8", onnx.run)):
            for f in sizes:
                run(f)
            repeated = [per_call_ms(run, [f]) for f in sizes]
            cells = [*repeated, float(np.mean(repeated)), per_call_ms(run, sizes)]
            say(f"   {label:32s} " + " | ".join(f"{c:.3f}" for c in cells))

    encoder = load_encoder(args.artifact, manifest)
    sentences = sts_sentences()
    random.Random(0).shuffle(sentences)
    batches = []
    for i in range(0, 1600, 16):
        window = sorted(sentences[i:i + 16], key=len)
        batches += [encoder.encode(window[j:j + 4])[0] for j in range(0, 16, 4)]
    singles = [encoder.encode([s])[0] for s in sentences[:400]]
    mean_tokens = np.mean([f["attention_mask"].sum() for f in singles])
    runs = {}
    for bucket in (1, 8, 16):
        runs[f"openvino, buckets of {bucket}" if bucket > 1 else "openvino, each exact length"] = bucket
    say(f"2. ms a text, STS-B sentences ({mean_tokens:.1f} tokens on average): in batches of 4 | one at a time")
    for _ in range(args.rounds):
        for label, bucket in runs.items():
            ov_engine.BUCKET = bucket  # OpenVinoEngine.run reads the module's bucket width on each call
            for f in batches[:40]:
                engine.run(f)
            say(f"   {label:32s} {per_text_ms(engine.run, batches):.3f} | {per_text_ms(engine.run, singles):.3f}")
        say(f"   {'onnxruntime int8':32s} {per_text_ms(onnx.run, batches):.3f} | {per_text_ms(onnx.run, singles):.3f}")
    args.out.with_suffix(".txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
