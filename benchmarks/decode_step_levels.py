"""One decode step (batch 1, past 64) of a SmolLM2 artifact's fp32, int8 (level 4) and an int8 built at accuracy
level 0 (variants.quantize_int8_weights(model.onnx, FILE, 32, 0)), 3 interleaved rounds: a coarse check on the
real model of what benchmarks/matmulnbits_levels.py measures per node. Paths are the ones of the recorded run."""
import os, time, numpy as np
from modelkiln.generation.decoder import DecoderSession
files = {"fp32": "/work/main/artifacts/smollm2/model.onnx", "int8 l4": "/work/main/artifacts/smollm2/model.int8.onnx",
         "int8 l0": "/work/geninv-art/exp/model.int8l0.onnx"}
print("load", os.getloadavg())
s = {k: DecoderSession(v, threads=2) for k, v in files.items()}
d = s["fp32"]
past = [np.random.default_rng(0).standard_normal((1, d.kv_heads, 64, d.head_dim)).astype(np.float32) for _ in d.past_names]
ids, mask, pos = np.ones((1, 1), np.int64), np.ones((1, 65), np.int64), np.full((1, 1), 64, np.int64)
t = {k: [] for k in s}
for r in range(3):
    for k, x in s.items():
        t0 = time.perf_counter(); x.forward(ids, mask, pos, past); t[k].append(time.perf_counter() - t0)
for k, v in t.items(): print(f"{k}: decode step batch 1 past 64, median of 3 interleaved: {np.median(v)*1e3:.0f} ms")
print("load", os.getloadavg())
