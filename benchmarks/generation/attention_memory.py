"""What bounds KilnAttention in a decode step of many sequences: reading the KV cache, or computing.

KilnAttention's kernel alone (``kiln_attention``, one thread, no onnxruntime), SmolLM2's attention
shape (9 query heads, 3 key/value heads, head size 64), one layer: a decode step of ``--rows``
sequences, each one token at a position near ``--position``. Two cases of the same work, timed in
turns:

- ``own rows``: every sequence reads its own cache row, as in serving (the rows' keys and values,
  --rows × 3 heads × positions × 64 × 4 bytes × 2, stream from memory: 22 MB at 64 rows × 225);
- ``two rows``: the sequences read rows 0 and 1 in turn (the same positions, the same arithmetic:
  no two neighbours share a row, so each is still a unit of its own), whose ~700 KB stay in the
  core's caches;
- ``one row``: every sequence reads row 0: neighbours of one row share a unit (16 tokens, as a
  prompt chunk's do), so each block of keys is transposed once for 48 queries instead of 3.

own / two rows is what waiting on memory costs; two rows / one row what a unit's own work (above
all the transposition of each block of keys, position-major in the cache, for its 3 queries) costs.

    python benchmarks/generation/attention_memory.py [--rows 64] [--position 200] [--rounds 5]"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import numpy as np

from modelkiln.machine import cpu_description
from modelkiln.native import library_path

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--position", type=int, default=200)
    parser.add_argument("--capacity", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--key-blocks", type=int, choices=(0, 1), default=1,
                        help="the key cache's layout: 1 in blocks of 16 positions dimension-major (what the serving "
                             "graph keeps), 0 position-major (graphs written before it)")
    parser.add_argument("--halves", action="store_true", help="caches of halves (KilnAttentionF16; keys in blocks)")
    args = parser.parse_args()
    lib = ctypes.CDLL(library_path())
    lib.kiln_attention.restype = ctypes.c_int
    rng = np.random.default_rng(0)
    rows, capacity, half = args.rows, args.capacity, HEAD_DIM // 2
    q = rng.standard_normal((rows, HEADS, HEAD_DIM)).astype(np.float32)
    k = rng.standard_normal((rows, KV_HEADS, HEAD_DIM)).astype(np.float32)
    v = rng.standard_normal((rows, KV_HEADS, HEAD_DIM)).astype(np.float32)
    cache_type = np.float16 if args.halves else np.float32
    key_cache = rng.standard_normal((rows, KV_HEADS, capacity, HEAD_DIM)).astype(cache_type)
    value_cache = rng.standard_normal((rows, KV_HEADS, capacity, HEAD_DIM)).astype(cache_type)
    angles = np.arange(capacity)[:, None] / (10000 ** (np.arange(half) / half))[None]
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    positions = (args.position + (np.arange(rows) * 7) % 50).astype(np.int64)  # positions differ a little
    out = np.zeros((rows, HEADS, HEAD_DIM), np.float32)
    cases = {"own rows": np.arange(rows, dtype=np.int64), "two rows": np.arange(rows, dtype=np.int64) % 2,
             "one row": np.zeros(rows, dtype=np.int64)}

    def step(cache_rows: np.ndarray) -> float:
        def p(a: np.ndarray) -> ctypes.c_void_p:
            return a.ctypes.data_as(ctypes.c_void_p)
        started = time.perf_counter()
        ok = lib.kiln_attention(HEADS, KV_HEADS, HEAD_DIM, ctypes.c_int64(rows), p(q), p(k), p(v), p(cache_rows),
                                p(positions), ctypes.c_int64(rows), ctypes.c_int64(capacity), p(key_cache),
                                p(value_cache), p(cos), p(sin), ctypes.c_int64(capacity), half, p(out), args.key_blocks, int(args.halves))
        assert ok
        return time.perf_counter() - started

    cpu = cpu_description()
    print(f"{cpu['cpu']} ({cpu['isa']}), one thread; {rows} sequences at positions {positions.min()}-{positions.max()}, "
          f"SmolLM2's attention shape, one layer, key cache {'in blocks' if args.key_blocks else 'position-major'}, "
          f"{'halves' if args.halves else 'floats'}")
    medians: dict[str, list[float]] = {name: [] for name in cases}
    for round_ in range(args.rounds):
        for name, cache_rows in cases.items():
            step(cache_rows)
            medians[name].append(1000 * statistics.median(step(cache_rows) for _ in range(args.repeat)))
        print(f"round {round_ + 1}: " + ", ".join(f"{name} {medians[name][-1]:.3f} ms" for name in cases))
    own, two, one = (statistics.median(medians[name]) for name in cases)
    bytes_read = 2 * key_cache.itemsize * HEAD_DIM * KV_HEADS * int((positions + 1).sum())
    print(f"median: own rows {own:.3f} ms ({bytes_read / own / 1e6:.1f} GB/s of keys and values), "
          f"two rows {two:.3f} ms, one row {one:.3f} ms: from memory the step takes {own / two:.1f}x its time in "
          f"cache, and a unit of 3 queries {two / one:.1f}x one of 48")


if __name__ == "__main__":
    main()
