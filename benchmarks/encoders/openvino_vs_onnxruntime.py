"""OpenVINO's variants against onnxruntime's on one artifact, timed in interleaved rounds.

Every variant runs the same feeds (real text, as `kiln bench` builds them) at each shape; within a
shape the variants take turns, round after round, so load from elsewhere on the machine hits them
alike (timings on a shared 2-core machine drift by ±25%). Records the CPU, its flags that decide the
matrix engine, the matrix engine of each variant, and the load average before and after.

    PYTHONPATH=src python benchmarks/encoders/openvino_vs_onnxruntime.py ARTIFACT --threads 2 --rounds 7 \
        --out benchmarks/results/openvino-minilm

ARTIFACT: `kiln convert MODEL --precision fp32,optimized,int8,openvino-fp32,openvino-bf16,openvino-int8`."""

from __future__ import annotations

import argparse
import json
import os
from functools import partial
from pathlib import Path

from modelkiln.bench.runner import make_feeds, machine_info
from modelkiln.machine import cpu_flags, matrix_engine
from modelkiln.manifest import Manifest
from modelkiln.runtime.pipeline import load_variant
from modelkiln.runtime.registry import BACKEND_LABELS, engine_kind
from modelkiln.timing import measure_interleaved

SHAPES = ((1, 16), (1, 128), (8, 128))
FLAGS_SHOWN = ("avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--variants", default="fp32,int8,openvino-fp32,openvino-bf16,openvino-int8")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seconds-per-round", type=float, default=0.4)
    parser.add_argument("--out", type=Path, required=True, help="writes OUT.json and OUT.txt")
    args = parser.parse_args()

    manifest = Manifest.load(args.artifact)
    variants = [manifest.variant(name) for name in args.variants.split(",")]
    flags = cpu_flags()
    engines = {v.name: load_variant(args.artifact, manifest, v, args.threads) for v in variants}
    units = {v.name: matrix_engine(v.precision, v.device, flags) for v in variants}
    labels = {v.name: f"{BACKEND_LABELS[engine_kind(v)]} {v.name}" for v in variants}
    load_before = os.getloadavg()
    rows = []
    for batch, seq in SHAPES:
        feeds = make_feeds(args.artifact, manifest, batch, seq)
        stats = measure_interleaved({n: partial(e.run, feeds) for n, e in engines.items()},
                                    rounds=args.rounds, seconds_per_round=args.seconds_per_round)
        rows += [{"batch": batch, "seq": seq, "variant": n, "backend": labels[n], "matrix_engine": units[n],
                  "median_ms": s.median, "min_ms": s.min, "p95_ms": s.p95, "runs": s.iterations} for n, s in stats.items()]
    result = {"model": manifest.name, "machine": machine_info(args.threads),
              "flags": sorted(f for f in FLAGS_SHOWN if f in flags), "rounds": args.rounds,
              "seconds_per_round": args.seconds_per_round, "load_average_before": load_before,
              "load_average_after": os.getloadavg(), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"{manifest.name}, {result['machine']['cpu']} ({result['machine']['isa']}; flags: "
             f"{' '.join(result['flags'])}), {args.threads} threads, onnxruntime {result['machine']['onnxruntime']}, "
             f"openvino {result['machine'].get('openvino', '-')}",
             f"{args.rounds} interleaved rounds of {args.seconds_per_round} s per shape; load average "
             f"{' '.join(f'{x:.2f}' for x in load_before)} before, "
             f"{' '.join(f'{x:.2f}' for x in result['load_average_after'])} after", "",
             f"{'batch x seq':>11}  {'backend':<30} {'matrix engine':<14} {'median ms':>9} {'min ms':>8} {'p95 ms':>8}"]
    for r in rows:
        lines.append(f"{r['batch']:>5} x {r['seq']:<3}  {r['backend']:<30} {r['matrix_engine']:<14} "
                     f"{r['median_ms']:>9.2f} {r['min_ms']:>8.2f} {r['p95_ms']:>8.2f}")
    args.out.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
