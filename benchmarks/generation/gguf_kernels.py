"""kiln's native GgufMatMul kernels alone: one thread, random blocks of every type they read, a
matrix bigger than the caches (32768 × 4096: 75 MB as Q4_K, 110 MB as Q6_K, 143 MB as Q8_0) at 1, 4,
16 and 64 rows of X, each instruction set this CPU has: AMX (where the CPU has AMX-INT8 and the
kernels' check passes), AVX-512 VNNI, AVX2. Rows are the batch of a decode
step (one per sequence), or a prompt chunk's tokens.

    python benchmarks/generation/gguf_kernels.py [--rows 1,4,16,64] [--types Q4_K,Q3_K] [--repeat 10] [--json out.json]

Prints milliseconds per product, the weight bytes read per second and the int8 multiply-adds per
second; the library is the one ``pip install`` built (``src/modelkiln/native``)."""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time

import numpy as np

from modelkiln.convert.gguf.blocks import FP16_FIELDS
from modelkiln.convert.gguf.tiles import BLOCK_BYTES, tiles
from modelkiln.machine import cpu_description
from modelkiln.native import GGML_TYPES, library_path


def random_blocks(kind: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes with small positive fp16 scales (speed does not depend on values)."""
    size = 256 if kind.endswith("_K") else 32
    raw = rng.integers(0, 256, (n, k // size, BLOCK_BYTES[kind]), dtype=np.uint8)
    scales = (rng.random((n, k // size, 1)) * 0.02 + 0.001).astype(np.float16).view(np.uint8)
    for at in FP16_FIELDS[kind]:
        raw[..., at:at + 2] = scales
    return raw.reshape(n, -1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=32768)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--rows", default="1,4,16,64")
    parser.add_argument("--types", default=",".join(GGML_TYPES), help="the GGUF types, comma-separated (default: all)")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--json")
    args = parser.parse_args()
    lib = ctypes.CDLL(library_path())
    cpu = cpu_description()
    print(f"{cpu['cpu']} ({cpu['isa']}), one thread, W {args.n} x {args.k}")
    rng = np.random.default_rng(0)
    rows_out = []
    for kind in args.types.split(","):
        weights = tiles(kind, random_blocks(kind, args.n, args.k, rng))
        for isa, avx512, amx in (("amx", 1, 1), ("avx512", 1, 0), ("avx2", 0, 0)):
            lib.kiln_gguf_use_avx512(avx512)
            if avx512 and "VNNI" not in cpu["isa"]:
                continue
            if not lib.kiln_gguf_use_amx(amx):  # AMX: where the CPU has it and the kernels' check passes
                continue
            for m in (int(r) for r in args.rows.split(",")):
                x = rng.standard_normal((m, args.k)).astype(np.float32)
                y = np.zeros((m, args.n), np.float32)
                call = lambda: lib.kiln_gguf_matmul(  # noqa: E731
                    GGML_TYPES[kind], x.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(m), ctypes.c_int64(args.k),
                    weights.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(args.n), y.ctypes.data_as(ctypes.c_void_p))
                call()
                times = []
                for _ in range(args.repeat):
                    started = time.perf_counter()
                    call()
                    times.append(time.perf_counter() - started)
                seconds = statistics.median(times)
                row = {"type": kind, "isa": isa, "rows": m, "ms": round(1000 * seconds, 3),
                       "weight_gb_s": round(weights.nbytes / seconds / 1e9, 1),
                       "gmac_s": round(m * args.n * args.k / seconds / 1e9, 1)}
                rows_out.append(row)
                print(f"{kind} {isa:6s} rows {m:2d}: {row['ms']:7.3f} ms  {row['weight_gb_s']:5.1f} GB/s of weights  "
                      f"{row['gmac_s']:6.1f} G multiply-adds/s", flush=True)
    lib.kiln_gguf_use_avx512(1)
    lib.kiln_gguf_use_amx(0)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": f"{cpu['cpu']} ({cpu['isa']})", "n": args.n, "k": args.k, "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
