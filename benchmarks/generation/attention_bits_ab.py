"""Two builds of kiln_attention given the same inputs, every output compared bit for bit.

For a change to the kernel that must not move a bit (another loop order, more chains in flight): each attention
shape below (query heads, key/value heads, head size) and each cache form (floats position-major or in blocks,
halves) runs a few random sequences' prompts in chunks of random lengths, then decode steps of every row together,
through both libraries. The AVX-512 form by default (where the CPU has it), ``--avx2`` for the other.

    python benchmarks/generation/attention_bits_ab.py OLD/_gguf_ops.cpython-311-x86_64-linux-gnu.so NEW/...so
"""

from __future__ import annotations

import argparse
import ctypes

import numpy as np

P = ctypes.c_void_p
# (query heads, key/value heads, head size): SmolLM2-135M, Llama-3.2-1B, Qwen2.5-0.5B, and groups of 1 to 8
SHAPES = [(9, 3, 64), (32, 8, 64), (14, 2, 64), (6, 2, 64), (4, 4, 64), (8, 2, 128), (12, 2, 128), (16, 16, 80),
          (24, 6, 64), (40, 5, 64), (2, 1, 16)]
CACHES = [(0, False), (1, False), (1, True)]  # (keys in blocks, halves)
ROWS, CAPACITY = 4, 320


def calls_for(rng: np.random.Generator) -> list[list[tuple[int, int, int]]]:
    """Each call's (row, first position, tokens) pieces: prompts in chunks of 1 to 39 tokens, then decode steps."""
    lengths = [int(n) for n in rng.integers(1, 200, ROWS)]
    done, calls = [0] * ROWS, []
    while any(d < n for d, n in zip(done, lengths)):
        pieces = []
        for row in range(ROWS):
            if done[row] < lengths[row]:
                n = min(int(rng.integers(1, 40)), lengths[row] - done[row])
                pieces.append((row, done[row], n))
                done[row] += n
        calls.append(pieces)
    return calls + [[(row, done[row] + step, 1) for row in range(ROWS)] for step in range(int(rng.integers(5, 40)))]


def run(lib: ctypes.CDLL, shape: tuple[int, int, int], cache: tuple[int, bool], calls, seed: int) -> list[np.ndarray]:
    heads, kv_heads, head_dim = shape
    key_blocks, halves = cache
    rng = np.random.default_rng(seed)
    key_cache = np.zeros((ROWS, kv_heads, CAPACITY, head_dim), np.float16 if halves else np.float32)
    value_cache = np.zeros_like(key_cache)
    half = head_dim // 2
    angles = np.arange(CAPACITY)[:, None] * (10000.0 ** (-np.arange(half) / half))[None]
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    outputs = []
    for pieces in calls:
        places = [(row, p) for row, start, n in pieces for p in range(start, start + n)]
        q = (rng.standard_normal((len(places), heads, head_dim)) * 2).astype(np.float32)
        k = rng.standard_normal((len(places), kv_heads, head_dim)).astype(np.float32)
        v = rng.standard_normal((len(places), kv_heads, head_dim)).astype(np.float32)
        rows = np.asarray([row for row, _ in places], np.int64)
        positions = np.asarray([p for _, p in places], np.int64)
        out = np.empty_like(q)
        ok = lib.kiln_attention(heads, kv_heads, head_dim, ctypes.c_int64(len(places)), q.ctypes.data_as(P),
                                k.ctypes.data_as(P), v.ctypes.data_as(P), rows.ctypes.data_as(P),
                                positions.ctypes.data_as(P), ctypes.c_int64(ROWS), ctypes.c_int64(CAPACITY),
                                key_cache.ctypes.data_as(P), value_cache.ctypes.data_as(P), cos.ctypes.data_as(P),
                                sin.ctypes.data_as(P), ctypes.c_int64(CAPACITY), half, out.ctypes.data_as(P),
                                key_blocks, int(halves))
        if not ok:
            raise SystemExit(f"kiln_attention refused the shape {shape}")
        outputs.append(out)
    return outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--avx2", action="store_true", help="the AVX2 form of both")
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    libs = [ctypes.CDLL(path) for path in (args.old, args.new)]
    for lib in libs:
        lib.kiln_attention.restype = ctypes.c_int
        lib.kiln_attention_use_avx512(0 if args.avx2 else 1)
    compared = differing = 0
    for shape in SHAPES:
        for cache in CACHES:
            for seed in range(args.seeds):
                calls = calls_for(np.random.default_rng(100 + seed))
                old, new = (run(lib, shape, cache, calls, seed) for lib in libs)
                compared += len(calls)
                differing += sum(not np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in zip(old, new))
    print(f"{'AVX2' if args.avx2 else 'AVX-512'} form: {compared} calls compared over {len(SHAPES)} shapes x "
          f"{len(CACHES)} cache forms x {args.seeds} seeds; {differing} with any output bit different")


if __name__ == "__main__":
    main()
