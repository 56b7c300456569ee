"""The serving graphs' KV cache regions (generation/engines/onnx/kv_cache.py): ``read`` and ``write``
take position-major arrays of the cache's type whichever layout the region keeps, and a region kept
in blocks (of floats or of halves) holds its keys exactly where KilnAttention (native/attention.c,
``key_blocks = 1``) writes and reads them."""
import ctypes

import numpy as np
import pytest

from modelkiln.generation.engines.onnx.kv_cache import CacheShape, RowRegion
from modelkiln.native import library_path

LAYERS, KV_HEADS, HEAD_DIM, LENGTH = 2, 2, 32, 64


LAYOUTS = [(False, False), (True, False), (True, True)]  # (key_blocks, halves)


def region(key_blocks: bool, rows: int = 3, halves: bool = False) -> RowRegion:
    return RowRegion(CacheShape(LAYERS, KV_HEADS, HEAD_DIM, LENGTH, key_blocks, halves), rows)


def positions(start: int, stop: int, seed: int = 0, halves: bool = False) -> np.ndarray:
    """Random keys and values of positions [start, stop) as ``read`` gives them."""
    shape = (2 * LAYERS, KV_HEADS, stop - start, HEAD_DIM)
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float16 if halves else np.float32)


@pytest.mark.parametrize("key_blocks, halves", LAYOUTS)
def test_what_is_written_at_any_positions_reads_back(key_blocks, halves):
    cache = region(key_blocks, halves=halves)
    assert cache.shape.bytes_per_token == 2 * LAYERS * KV_HEADS * HEAD_DIM * (2 if halves else 4)
    pieces = [(0, 5), (5, 16), (16, 37), (37, 40), (40, 64)]  # inside, up to and across block edges
    for i, (start, stop) in enumerate(pieces):
        cache.write(1, start, positions(start, stop, seed=i, halves=halves))
    for i, (start, stop) in enumerate(pieces):
        assert np.array_equal(cache.read(1, start, stop), positions(start, stop, seed=i, halves=halves))
    whole = np.concatenate([positions(start, stop, seed=i, halves=halves) for i, (start, stop) in enumerate(pieces)],
                           axis=2)
    assert np.array_equal(cache.read(1, 3, 50), whole[:, :, 3:50])
    assert not cache.read(0, 0, LENGTH).any() and not cache.read(2, 0, LENGTH).any()  # other rows untouched


def test_keys_in_blocks_are_kept_dimension_major_and_values_as_they_are():
    cache = region(True)
    kv = positions(0, 20)
    cache.write(0, 0, kv)
    key = cache.all[0, 0, 0].reshape(-1)  # layer 0's key, head 0: the first block's 16 · D floats, then the next
    assert np.array_equal(key[:16 * HEAD_DIM].reshape(HEAD_DIM, 16), kv[0, 0, :16].T)
    assert np.array_equal(key[16 * HEAD_DIM:16 * HEAD_DIM + 16 * 4].reshape(4, 16)[:, :4], kv[0, 0, 16:20, :4].T)
    assert np.array_equal(cache.all[1, 0, :, :20], kv[1])


@pytest.mark.parametrize("key_blocks, halves", LAYOUTS)
def test_copy_row_moves_the_positions_asked_for(key_blocks, halves):
    staging, running = region(key_blocks, halves=halves), region(key_blocks, rows=2, halves=halves)
    kv = positions(0, 21, halves=halves)
    staging.write(2, 0, kv)
    running.copy_row(staging, 2, 1, 21)
    assert np.array_equal(running.read(1, 0, 21), kv)
    with pytest.raises(AssertionError):
        running.copy_row(region(not key_blocks), 0, 0, 1)  # the layouts must agree


def test_a_region_in_blocks_holds_whole_blocks():
    with pytest.raises(ValueError, match="multiple of 16"):
        CacheShape(LAYERS, KV_HEADS, HEAD_DIM, 40, key_blocks=True)


@pytest.mark.skipif(library_path() is None, reason="the native library is not built on this machine")
def test_a_region_in_blocks_reads_what_kiln_attention_wrote():
    """The kernel writes keys into a region's layer-0 buffer; ``read`` gives them position-major,
    equal to what it writes into a position-major region (halves: rounded to the nearest)."""
    lib = ctypes.CDLL(library_path())
    heads, tokens, half = 4, 23, HEAD_DIM // 2
    rng = np.random.default_rng(1)
    q = rng.standard_normal((tokens, heads, HEAD_DIM)).astype(np.float32)
    k, v = (rng.standard_normal((tokens, KV_HEADS, HEAD_DIM)).astype(np.float32) for _ in range(2))
    angles = np.arange(LENGTH)[:, None] * (10000.0 ** (-np.arange(half) / half))[None]
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    rows, where = np.full(tokens, 1, np.int64), np.arange(tokens, dtype=np.int64)
    read = []
    for key_blocks, halves in LAYOUTS:
        cache = region(key_blocks, halves=halves)
        out = np.empty_like(q)
        p = ctypes.c_void_p
        ok = lib.kiln_attention(heads, KV_HEADS, HEAD_DIM, ctypes.c_int64(tokens), q.ctypes.data_as(p), k.ctypes.data_as(p),
                                v.ctypes.data_as(p), rows.ctypes.data_as(p), where.ctypes.data_as(p),
                                ctypes.c_int64(cache.rows), ctypes.c_int64(LENGTH), cache.buffers[0].ctypes.data_as(p),
                                cache.buffers[1].ctypes.data_as(p), cos.ctypes.data_as(p), sin.ctypes.data_as(p),
                                ctypes.c_int64(LENGTH), half, out.ctypes.data_as(p), int(key_blocks), int(halves))
        assert ok
        read.append(cache.read(1, 0, tokens)[:2])
    assert read[0][0].any() and np.array_equal(read[0], read[1])
    assert read[2].dtype == np.float16 and np.array_equal(read[2], read[0].astype(np.float16))
