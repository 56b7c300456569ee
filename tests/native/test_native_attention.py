"""KilnAttention (src/modelkiln/native/attention.c): against a float64 numpy reference, and against
itself: a position's output is the same bits in a decode step, in a chunk of any length, among
other rows' tokens, on the AVX2 and the AVX-512 form, with either key cache layout and caches of
floats or of halves; then through onnxruntime, cache bound in place."""
import ctypes

import numpy as np
import pytest

from modelkiln.native import DOMAIN, library_path

pytestmark = pytest.mark.skipif(library_path() is None, reason="the native library is not built on this machine")

HEADS, KV_HEADS, HEAD_DIM, CAPACITY = 6, 2, 64, 96
P = ctypes.c_void_p


def has_avx512() -> bool:
    flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    return "avx512f" in flags and "avx512dq" in flags


FORMS = [0, pytest.param(1, marks=pytest.mark.skipif(not has_avx512(), reason="this CPU has no AVX-512"))]
# the caches: (key_blocks, halves) — floats with keys position-major or in blocks, halves (keys in blocks)
CACHES = [pytest.param((0, False), id="f32-positions"), pytest.param((1, False), id="f32-blocks"),
          pytest.param((1, True), id="f16-blocks")]


@pytest.fixture(scope="module")
def lib():
    library = ctypes.CDLL(library_path())
    library.kiln_attention.restype = ctypes.c_int
    yield library
    library.kiln_attention_use_avx512(1)


def rotary_tables(positions: int, half: int) -> tuple[np.ndarray, np.ndarray]:
    angles = np.arange(positions)[:, None] * (10000.0 ** (-np.arange(half) / half))[None]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


class Sequences:
    """Random q, k, v for a few sequences (rows of the cache), a token per position."""

    def __init__(self, lengths: list[int], half: int = HEAD_DIM // 2, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.lengths = lengths
        self.q = [rng.standard_normal((n, HEADS, HEAD_DIM)).astype(np.float32) for n in lengths]
        self.k = [rng.standard_normal((n, KV_HEADS, HEAD_DIM)).astype(np.float32) for n in lengths]
        self.v = [rng.standard_normal((n, KV_HEADS, HEAD_DIM)).astype(np.float32) for n in lengths]
        self.cos, self.sin = rotary_tables(CAPACITY, half)

    def caches(self, fill: float = 0.0, halves: bool = False) -> tuple[np.ndarray, np.ndarray]:
        shape, dtype = (len(self.lengths), KV_HEADS, CAPACITY, HEAD_DIM), np.float16 if halves else np.float32
        return np.full(shape, fill, dtype), np.full(shape, fill, dtype)

    def run(self, lib, calls: list[list[tuple[int, int, int]]], cache: tuple[int, bool] = (0, False),
            fill: float = 0.0) -> dict[tuple[int, int], np.ndarray]:
        """Each call: (sequence, first position, tokens) pieces packed into one call, in order, over
        caches (``CACHES``) that hold ``fill`` where nothing was written. Returns every position's
        output by (sequence, position)."""
        key_blocks, halves = cache
        key_cache, value_cache = self.caches(fill, halves)
        outputs = {}
        for pieces in calls:
            places = [(seq, p) for seq, start, n in pieces for p in range(start, start + n)]
            q = np.stack([self.q[s][p] for s, p in places])
            k = np.stack([self.k[s][p] for s, p in places])
            v = np.stack([self.v[s][p] for s, p in places])
            rows = np.asarray([s for s, _ in places], np.int64)
            positions = np.asarray([p for _, p in places], np.int64)
            out = attention(lib, q, k, v, rows, positions, key_cache, value_cache, self.cos, self.sin, key_blocks)
            outputs.update({place: out[i] for i, place in enumerate(places)})
        return outputs


def call(lib, q, k, v, rows, positions, key_cache, value_cache, cos, sin, key_blocks: int = 0) -> tuple[int, np.ndarray]:
    """One call of the library's kernel (1: done, 0: refused) and its output; the caches' dtype says
    floats or halves."""
    out = np.empty_like(q)
    ok = lib.kiln_attention(HEADS, KV_HEADS, HEAD_DIM, ctypes.c_int64(len(q)), q.ctypes.data_as(P), k.ctypes.data_as(P),
                            v.ctypes.data_as(P), rows.ctypes.data_as(P), positions.ctypes.data_as(P),
                            ctypes.c_int64(key_cache.shape[0]), ctypes.c_int64(key_cache.shape[2]),
                            key_cache.ctypes.data_as(P), value_cache.ctypes.data_as(P), cos.ctypes.data_as(P),
                            sin.ctypes.data_as(P), ctypes.c_int64(len(cos)), cos.shape[1], out.ctypes.data_as(P),
                            key_blocks, int(key_cache.dtype == np.float16))
    return ok, out


def attention(lib, q, k, v, rows, positions, key_cache, value_cache, cos, sin, key_blocks: int = 0) -> np.ndarray:
    ok, out = call(lib, q, k, v, rows, positions, key_cache, value_cache, cos, sin, key_blocks)
    assert ok
    return out


def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    half = cos.shape[-1]
    x1, x2 = x[..., :half], x[..., half:2 * half]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., 2 * half:]], axis=-1)


def reference(seqs: Sequences, seq: int, halves: bool = False) -> np.ndarray:
    """Causal grouped-query attention over the whole sequence, in float64; ``halves``: over keys and
    values as a cache of halves keeps them (the key rotated in float32, as the kernel rotates it
    without contraction, then rounded to the nearest half)."""
    n = seqs.lengths[seq]
    cos, sin = seqs.cos[:n, None].astype(np.float64), seqs.sin[:n, None].astype(np.float64)
    q, k = rotate(seqs.q[seq].astype(np.float64), cos, sin), rotate(seqs.k[seq].astype(np.float64), cos, sin)
    v = seqs.v[seq].astype(np.float64)
    if halves:
        k = rotate(seqs.k[seq], seqs.cos[:n, None], seqs.sin[:n, None]).astype(np.float16).astype(np.float64)
        v = v.astype(np.float16).astype(np.float64)
    out = np.zeros((n, HEADS, HEAD_DIM))
    for t in range(n):
        for h in range(HEADS):
            g = h // (HEADS // KV_HEADS)
            scores = k[:t + 1, g] @ q[t, h] / np.sqrt(HEAD_DIM)
            weights = np.exp(scores - scores.max())
            out[t, h] = weights / weights.sum() @ v[:t + 1, g]
    return out


@pytest.mark.parametrize("avx512", FORMS)
@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("half", [HEAD_DIM // 2, 16])  # full and partial rotary
def test_matches_a_float64_reference(lib, avx512, cache, half):
    lib.kiln_attention_use_avx512(avx512)
    seqs = Sequences([37, 70], half=half)
    got = seqs.run(lib, [[(0, 0, 37), (1, 0, 70)]], cache)
    for seq, n in enumerate(seqs.lengths):
        np.testing.assert_allclose(np.stack([got[seq, p] for p in range(n)]), reference(seqs, seq, halves=cache[1]),
                                   atol=2e-6, rtol=1e-5)


def test_halves_move_the_output_by_their_rounding_only(lib):
    """Against floats, a cache of halves moves each output by about its rounding (2^-11 relative)."""
    seqs = Sequences([70])
    floats, halves = (seqs.run(lib, [[(0, 0, 70)]], cache) for cache in ((1, False), (1, True)))
    difference = max(np.abs(floats[0, p] - halves[0, p]).max() for p in range(70))
    assert 1e-5 < difference < 5e-3


def chunked(length: int, size: int) -> list[tuple[int, int]]:
    return [(start, min(size, length - start)) for start in range(0, length, size)]


@pytest.mark.parametrize("avx512", FORMS)
@pytest.mark.parametrize("cache", CACHES)
def test_every_position_is_the_same_bits_however_it_is_computed(lib, avx512, cache):
    """Decode one token at a time, chunks of 1..17 tokens, the whole prompt at once, and the same
    tokens packed among another sequence's: bit for bit the same output at every position."""
    lib.kiln_attention_use_avx512(avx512)
    seqs = Sequences([53, 40])
    decode = seqs.run(lib, [[(0, p, 1)] for p in range(53)], cache)
    for size in (2, 3, 4, 5, 7, 16, 17, 53):
        chunks = seqs.run(lib, [[(0, start, n)] for start, n in chunked(53, size)], cache)
        assert all(np.array_equal(decode[0, p], chunks[0, p]) for p in range(53)), size
    # with the other sequence's decode steps and chunks in the same calls, in either order
    steps = [[(0, p, 1), (1, 8 + p, 1)][::1 if p % 2 else -1] for p in range(1, 32)]
    mixed = seqs.run(lib, [[(1, 0, 9), (0, 0, 1)]] + steps + [[(0, 32, 21)]], cache)
    assert all(np.array_equal(decode[0, p], mixed[0, p]) for p in range(53))
    alone = seqs.run(lib, [[(1, 0, 40)]], cache)
    assert all(np.array_equal(alone[1, p], mixed[1, p]) for p in range(40))


@pytest.mark.skipif(not has_avx512(), reason="this CPU has no AVX-512")
@pytest.mark.parametrize("cache", CACHES)
def test_the_avx2_and_avx512_forms_agree_bit_for_bit(lib, cache):
    seqs = Sequences([77, 20, 5], seed=3)
    calls = [[(0, 0, 30), (1, 0, 20), (2, 0, 5)], [(0, 30, 47)]]
    outputs = []
    for avx512 in (0, 1):
        lib.kiln_attention_use_avx512(avx512)
        outputs.append(seqs.run(lib, calls, cache))
    assert outputs[0].keys() == outputs[1].keys()
    assert all(np.array_equal(outputs[0][place], outputs[1][place]) for place in outputs[0])


@pytest.mark.parametrize("avx512", FORMS)
@pytest.mark.parametrize("halves", [False, True])
def test_what_a_slot_held_before_changes_no_bit(lib, avx512, halves):
    """Caches full of NaN where nothing was written (a slot's stale or unwritten lanes, read past a
    position's last key within its block, and masked): the same bits as over zeroed caches."""
    lib.kiln_attention_use_avx512(avx512)
    seqs = Sequences([53, 40], seed=5)
    calls = [[(1, 0, 9), (0, 0, 1)]] + [[(0, p, 1), (1, 8 + p, 1)] for p in range(1, 20)] + [[(0, 20, 33), (1, 28, 12)]]
    zeros, nans = (seqs.run(lib, calls, (1, halves), fill) for fill in (0.0, np.nan))
    assert all(np.array_equal(zeros[place], nans[place]) for place in zeros)


@pytest.mark.parametrize("avx512", FORMS)
def test_the_key_cache_layout_changes_no_bit(lib, avx512):
    """Keys in blocks of 16 positions, dimension-major, over caches full of NaN where nothing was
    written (a slot's stale or unwritten lanes): every position the same bits as position-major
    keys over zeroed caches, decoded, chunked and packed among another sequence."""
    lib.kiln_attention_use_avx512(avx512)
    seqs = Sequences([53, 40], seed=5)
    calls = [[(1, 0, 9), (0, 0, 1)]] + [[(0, p, 1), (1, 8 + p, 1)] for p in range(1, 20)] + [[(0, 20, 17), (1, 28, 12)],
                                                                                          [(0, 37, 16)]]
    position_major = seqs.run(lib, calls)
    blocks = seqs.run(lib, calls, (1, False), fill=np.nan)
    assert position_major.keys() == blocks.keys()
    assert all(np.array_equal(position_major[place], blocks[place]) for place in blocks)


def blocks_to_positions(key_cache: np.ndarray) -> np.ndarray:
    """A key cache kept in blocks ([rows, heads, capacity / 16, D, 16] in memory) as position-major."""
    rows, heads, capacity, dim = key_cache.shape
    return key_cache.reshape(rows, heads, capacity // 16, dim, 16).swapaxes(3, 4).reshape(key_cache.shape)


@pytest.mark.parametrize("cache", CACHES)
def test_keys_and_values_are_written_rotated_at_their_rows_and_positions(lib, cache):
    key_blocks, halves = cache
    seqs = Sequences([10, 6])
    key_cache, value_cache = seqs.caches(halves=halves)
    rows = np.asarray([1] * 6 + [0] * 10, np.int64)
    positions = np.asarray(list(range(6)) + list(range(10)), np.int64)
    q = np.concatenate([seqs.q[1], seqs.q[0]])
    k = np.concatenate([seqs.k[1], seqs.k[0]])
    v = np.concatenate([seqs.v[1], seqs.v[0]])
    attention(lib, q, k, v, rows, positions, key_cache, value_cache, seqs.cos, seqs.sin, key_blocks)
    keys = blocks_to_positions(key_cache) if key_blocks else key_cache
    for seq, n in ((0, 10), (1, 6)):  # rotated in float32 as numpy does it, then stored (halves: rounded to nearest)
        rotated = rotate(seqs.k[seq], seqs.cos[:n, None], seqs.sin[:n, None])
        assert np.array_equal(keys[seq, :, :n].transpose(1, 0, 2), rotated.astype(key_cache.dtype))
        assert np.array_equal(value_cache[seq, :, :n].transpose(1, 0, 2), seqs.v[seq].astype(key_cache.dtype))
        assert not keys[seq, :, n:].any() and not value_cache[seq, :, n:].any()


@pytest.mark.parametrize("capacity, key_blocks, halves", [(40, 1, 0), (48, 0, 1)])
def test_keys_in_blocks_need_whole_blocks_and_halves_need_blocks(lib, capacity, key_blocks, halves):
    seqs = Sequences([4])
    key_cache, value_cache = (np.zeros((1, KV_HEADS, capacity, HEAD_DIM), np.float16 if halves else np.float32)
                              for _ in range(2))
    one = np.zeros(1, np.int64)
    ok, _ = call(lib, seqs.q[0][:1], seqs.k[0][:1], seqs.v[0][:1], one, one, key_cache, value_cache, seqs.cos, seqs.sin,
                 key_blocks)
    assert ok == 0 and not key_cache.any()


def attention_session(key_blocks: int | None = None, halves: bool = False):
    """One KilnAttention node (KilnAttentionF16 over caches of halves); key_blocks None: no attribute."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from modelkiln.runtime.onnx import session_options

    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    c = TensorProto.FLOAT16 if halves else f
    cache = [None, KV_HEADS, None, HEAD_DIM]
    inputs = [helper.make_tensor_value_info("q", f, [None, None, HEADS * HEAD_DIM]),
              helper.make_tensor_value_info("k", f, [None, None, KV_HEADS * HEAD_DIM]),
              helper.make_tensor_value_info("v", f, [None, None, KV_HEADS * HEAD_DIM]),
              helper.make_tensor_value_info("past_key", c, cache), helper.make_tensor_value_info("past_value", c, cache),
              helper.make_tensor_value_info("rows", i64, [None, None]), helper.make_tensor_value_info("positions", i64, [None, None]),
              helper.make_tensor_value_info("cos", f, [None, None]), helper.make_tensor_value_info("sin", f, [None, None])]
    outputs = [helper.make_tensor_value_info("out", f, [None, None, HEADS * HEAD_DIM]),
               helper.make_tensor_value_info("present_key", c, cache), helper.make_tensor_value_info("present_value", c, cache)]
    layout = {} if key_blocks is None else {"key_blocks": key_blocks}  # None: a graph written before the attribute
    op = "KilnAttentionF16" if halves else "KilnAttention"
    node = helper.make_node(op, [i.name for i in inputs], [o.name for o in outputs], domain=DOMAIN, num_heads=HEADS,
                            kv_num_heads=KV_HEADS, **layout)
    model = helper.make_model(helper.make_graph([node], "g", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)])
    return ort.InferenceSession(model.SerializeToString(), session_options(2))


@pytest.mark.parametrize("key_blocks, halves", [(None, False), (0, False), (1, False), (1, True)])
def test_through_onnxruntime_in_place_and_copied(lib, key_blocks, halves):
    """Two rows of a chunk each plus padding, on onnxruntime's threads: the same bits as the
    library's own call; the cache bound as past and present is written in place (in the layout the
    node's key_blocks names), and an unbound present is the past with the new tokens written."""
    import onnxruntime as ort

    lib.kiln_attention_use_avx512(1)
    seqs = Sequences([12, 7])
    expected = seqs.run(lib, [[(0, 0, 12), (1, 0, 7)]], (key_blocks or 0, halves))
    q = np.zeros((2, 12, HEADS * HEAD_DIM), np.float32)
    k = np.zeros((2, 12, KV_HEADS * HEAD_DIM), np.float32)
    v = np.zeros_like(k)
    positions = np.full((2, 12), -1, np.int64)
    for seq, n in enumerate(seqs.lengths):
        q[seq, :n], k[seq, :n], v[seq, :n] = (x[seq].reshape(n, -1) for x in (seqs.q, seqs.k, seqs.v))
        positions[seq, :n] = np.arange(n)
    rows = np.repeat(np.arange(2, dtype=np.int64)[:, None], 12, axis=1)
    feeds = {"q": q, "k": k, "v": v, "rows": rows, "positions": positions, "cos": seqs.cos, "sin": seqs.sin}
    session = attention_session(key_blocks, halves)

    key_cache, value_cache = seqs.caches(halves=halves)
    binding = session.io_binding()
    binding.bind_output("out")  # output 0
    for name, array in feeds.items():
        binding.bind_cpu_input(name, array)
    for past, present, array in (("past_key", "present_key", key_cache), ("past_value", "present_value", value_cache)):
        value = ort.OrtValue.ortvalue_from_numpy(array)
        binding.bind_ortvalue_input(past, value)
        binding.bind_ortvalue_output(present, value)
    session.run_with_iobinding(binding)
    out = binding.get_outputs()[0].numpy().reshape(2, 12, HEADS, HEAD_DIM)
    for seq, n in enumerate(seqs.lengths):
        assert all(np.array_equal(out[seq, p], expected[seq, p]) for p in range(n))
    assert not out[1, 7:].any()  # padding
    assert value_cache[1, :, :7].any() and not value_cache[1, :, 7:].any()  # written in place, padding nowhere
    keys = blocks_to_positions(key_cache) if key_blocks else key_cache
    rotated = rotate(seqs.k[1], seqs.cos[:7, None], seqs.sin[:7, None])
    assert np.array_equal(keys[1, :, :7].transpose(1, 0, 2), rotated.astype(key_cache.dtype))

    empty_key, empty_value = seqs.caches(halves=halves)
    copied, present_key, present_value = session.run(None, {**feeds, "past_key": empty_key, "past_value": empty_value})
    assert np.array_equal(copied.reshape(out.shape), out)
    assert np.array_equal(present_key, key_cache) and np.array_equal(present_value, value_cache)
    assert not empty_key.any()  # an unbound past is not written
