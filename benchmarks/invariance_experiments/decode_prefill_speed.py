"""Decode step (batch 1, 8, 16; past 128) and prefill (128, 512 tokens) time of each decoder file,
through the product's GenerationEngine, 3 interleaved rounds, 2 threads.

    PYTHONPATH=src python benchmarks/invariance_experiments/decode_prefill_speed.py ARTIFACT_DIR model.onnx model.int4.onnx ...
"""
import sys, time, numpy as np
from modelkiln.generation.decoder import DecoderSession
from modelkiln.generation.engine import GenerationEngine
folder = sys.argv[1]; files = sys.argv[2:]
sess = {f: DecoderSession(f"{folder}/{f}", threads=2) for f in files}
rng = np.random.default_rng(0)
def decode(f, batch, past=128, steps=16):
    e = GenerationEngine(sess[f])
    for b in range(batch):
        e.add(b, list(rng.integers(100, 1000, past - b)))
    toks = {b: 200 for b in range(batch)}
    e.step(toks)
    t = time.perf_counter()
    for _ in range(steps): e.step(toks)
    return (time.perf_counter() - t) / steps * 1000
def prefill(f, n):
    e = GenerationEngine(sess[f]); ids = list(rng.integers(100, 1000, n))
    e.prefill("w", ids[:8]); e.remove("w")
    t = time.perf_counter(); e.prefill("a", ids); return (time.perf_counter() - t) * 1000
res = {}
for r in range(3):  # interleaved rounds: every file, every cell, then again
    for f in files:
        for k, fn in (("dec b1", lambda: decode(f, 1)), ("dec b8", lambda: decode(f, 8)), ("dec b16", lambda: decode(f, 16)), ("pre 128", lambda: prefill(f, 128)), ("pre 512", lambda: prefill(f, 512))):
            res.setdefault((f, k), []).append(fn())
for (f, k), v in sorted(res.items(), key=lambda x: (x[0][1], x[0][0])):
    print(f"{k:8s} {f:22s} median ms {np.median(v):8.1f}  all {[round(x,1) for x in v]}")
