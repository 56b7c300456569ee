"""Batch invariance of int8 methods on a real sentence-embeddings model, with their speed and STS-B accuracy.

For each candidate variant (built here from the artifact's fp32 ``model.onnx``, in a scratch folder):
- batch invariance: every STS-B sentence alone vs inside padded batches of mixed lengths (the
  validation gate's check, convert/validate.py ``batch_invariance``), lowest cosine and answers agreeing;
- STS-B dev Spearman ×100 (as ``kiln eval``);
- latency, median ms, batch 1/8/32 × seq 16/128 of real SQuAD tokens (as ``kiln bench``), all
  candidates timed in interleaved rounds so load from elsewhere hits them alike.

    PYTHONPATH=src python benchmarks/encoders/batch_invariance.py --artifact /work/main/artifacts/all-MiniLM-L6-v2

Writes benchmarks/results/batch-invariance.{txt,json}."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from modelkiln.bench.accuracy import sts_spearman
from modelkiln.bench.runner import machine_info, make_feeds
from modelkiln.timing import measure_interleaved
from modelkiln.convert import variants as build
from modelkiln.convert.validate import batch_invariance
from modelkiln.data import read_sts, sts_sentences
from modelkiln.manifest import Manifest
from modelkiln.runtime.onnx import OnnxEngine
from modelkiln.runtime.pipeline import Pipeline, load_encoder
from modelkiln.tasks import make_task

RESULTS = Path(__file__).parents[1] / "results"
CELLS = [(1, 16), (1, 128), (8, 16), (8, 128), (32, 16), (32, 128)]


def build_candidates(fp32: Path, work: Path, config: object) -> dict[str, tuple[Path, str]]:
    """name → (file, how it was built)."""
    opt = work / "optimized.onnx"
    build.optimize(fp32, opt, config)
    out = {"fp32": (fp32, "export"), "optimized": (opt, "ORT transformer fusions")}
    steps = [
        ("int8-dynamic (today)", lambda p: build.quantize_int8(opt, p, per_channel=True),
         "quantize_dynamic on the fused graph, per-channel weights, one activation scale per tensor"),
        ("int8-per-row", lambda p: build.quantize_int8_per_row(fp32, p),
         "every MatMul: int8 weights per column, int8 activations per row (unfused graph)"),
        ("int4 weight-only MatMulNBits", lambda p: build.quantize_int4(opt, p, 32, 4),
         "MatMulNBits bits=4 block 32 accuracy_level 4, fused graph"),
    ]
    for i, (name, make, how) in enumerate(steps):
        path = work / f"candidate{i}.onnx"
        make(path)
        out[name] = (path, how)
    return out


def file_size(path: Path) -> int:
    """Graph plus external weights, if any."""
    data = path.with_name(path.name + ".data")
    return path.stat().st_size + (data.stat().st_size if data.is_file() else 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", type=Path, default=Path("/work/main/artifacts/all-MiniLM-L6-v2"))
    parser.add_argument("--sentences", type=int, default=256, help="STS-B sentences for the invariance check")
    parser.add_argument("--pairs", type=int, default=1500, help="STS-B dev pairs for the accuracy (1500: all)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds-per-round", type=float, default=0.4)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS / "batch-invariance")
    args = parser.parse_args()

    from transformers import AutoConfig  # build-time only, like convert

    manifest = Manifest.load(args.artifact)
    task, encoder = make_task(manifest), load_encoder(args.artifact, manifest)
    texts = sts_sentences()[: args.sentences]
    pairs = read_sts()[: args.pairs]
    load = {"before": os.getloadavg()}
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="kiln-invariance-") as tmp:
        candidates = build_candidates(args.artifact / "model.onnx", Path(tmp), AutoConfig.from_pretrained(args.artifact))
        engines = {name: OnnxEngine(path, threads=args.threads, label=name) for name, (path, _) in candidates.items()}
        for name, engine in engines.items():
            started = time.perf_counter()
            mixed = batch_invariance(task, encoder, engine, texts, size=8)
            one32 = batch_invariance(task, encoder, engine, texts[:32], size=32)
            spearman = sts_spearman(Pipeline(task, encoder, engine), pairs)
            rows[name] = {"built": candidates[name][1], "size_mb": round(file_size(candidates[name][0]) / 2**20, 1),
                          "invariance_batch8": mixed.__dict__, "invariance_batch32": one32.__dict__,
                          "batch_invariant": mixed.passed and one32.passed,
                          "stsb_spearman": round(spearman, 3), "latency_ms": {}}
            print(f"{name}: min cos {mixed.min_cosine:.6f} / {one32.min_cosine:.6f}, STS-B {spearman:.3f} "
                  f"({time.perf_counter() - started:.0f}s)", flush=True)
        load["after_accuracy"] = os.getloadavg()
        for batch, seq in CELLS:
            feeds = make_feeds(args.artifact, manifest, batch, seq)
            stats = measure_interleaved({n: (lambda e=e: e.run(feeds)) for n, e in engines.items()},
                                        rounds=args.rounds, seconds_per_round=args.seconds_per_round)
            for name, s in stats.items():
                rows[name]["latency_ms"][f"{batch}x{seq}"] = round(s.median, 3)
            print(f"b{batch} s{seq}: " + "  ".join(f"{n}={s.median:.1f}" for n, s in stats.items()), flush=True)
    load["after"] = os.getloadavg()

    result = {"model": manifest.name, "sentences": len(texts), "stsb_pairs": len(pairs), "cells": [f"{b}x{s}" for b, s in CELLS],
              "machine": machine_info(args.threads), "loadavg": load, "candidates": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    args.out.with_suffix(".txt").write_text(render(result))
    print(render(result))


def render(result: dict) -> str:
    base = result["candidates"]["int8-dynamic (today)"]["latency_ms"]
    lines = [f"Batch invariance of {result['model']} variants: {result['sentences']} STS-B sentences alone vs in "
             f"padded mixed-length batches of 8, and 32 in one batch; STS-B dev Spearman x100 on {result['stsb_pairs']} "
             "pairs; median ms",
             f"machine: {result['machine']['cpu']}, {result['machine']['threads']} threads, onnxruntime "
             f"{result['machine']['onnxruntime']}; load average {result['loadavg']}", ""]
    header = f"{'variant':32} {'min cos b8':>11} {'min cos b32':>11} {'invariant':>9} {'STS-B':>7} {'MB':>6}  " + \
        "  ".join(f"{c:>9}" for c in result["cells"]) + "   (ms; x = / today's int8)"
    lines.append(header)
    for name, r in result["candidates"].items():
        ms = r["latency_ms"]
        lines.append(f"{name:32} {r['invariance_batch8']['min_cosine']:11.6f} {r['invariance_batch32']['min_cosine']:11.6f} "
                     f"{'yes' if r['batch_invariant'] else 'NO':>9} {r['stsb_spearman']:7.3f} {r['size_mb']:6.1f}  "
                     + "  ".join(f"{ms[c]:9.2f}" for c in result["cells"]))
        lines.append(" " * 91 + "  ".join(f"{ms[c] / base[c]:8.2f}x" for c in result["cells"]))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
