"""A GGUF file's quantized blocks as ``MatMulNBits`` weights, exactly.

Every common GGUF type stores a weight row as blocks of integer codes with a scale per block (and,
for some, a minimum), and gguf-py's ``dequantize`` turns them into float32 with a few fp32
operations, e.g. Q4_K: ``(d·sc)·q − (dmin·m)``. Here each type becomes ``Blocks``: unsigned codes
``c`` [rows, blocks, block], a scale ``s`` and an optional offset ``o`` per block, with

    w = s · (c − zero) + o

computed with the very fp32 operations gguf-py uses, so the values are bit for bit its own
(tests/convert/test_gguf_blocks.py checks every type against ``gguf.quants.dequantize``).

``MatMulNBits`` (onnxruntime 1.32: 4- or 8-bit codes, power-of-two blocks of at least 16, fast
only with its default zero point 2^(bits−1)) computes ``s · (c − 2^(bits−1))``. Where that is not
the whole weight, the rest is one value per block, ``C = o + (2^(bits−1) − zero)·s``, added the way
llama.cpp's own dot products add a block minimum:

    x·W = MatMulNBits(x; c, s) + blocksum(x) · C

with ``blocksum(x)`` the sums of ``x`` over each block of inputs (``linear_weights.py``). How each
type is stored (``STORAGE``):

    Q4_0  4-bit, block 32          d·(q − 8): MatMulNBits' own format
    Q4_1  4-bit, block 32, min     d·q + m
    Q5_0  8-bit, block 32          d·(q − 16), codes q + 112
    Q5_1  8-bit, block 32, min     d·q + m, codes q + 128
    Q8_0  8-bit, block 32          d·q, codes q + 128
    Q2_K  4-bit, block 16, min     (d·sc)·q − dmin·m, 2-bit codes q + 8
    Q3_K  4-bit, block 16          (d·(sc − 32))·q, 3-bit signed codes q + 8
    Q4_K  4-bit, block 32, min     (d·sc)·q − dmin·m (6-bit sc and m per 32 weights)
    Q5_K  8-bit, block 32, min     the same with 5-bit codes q + 128
    Q6_K  8-bit, block 16          (d·sc)·(q − 32), signed 8-bit sc per 16 weights; codes q + 96

Other types (IQ*, TQ*, MXFP4, ...) have no such form (their codes index a grid, or the scale is
not one multiplication); they are dequantized to fp32 and say so, never re-quantized."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

QK_K = 256  # weights per K-quant super-block
ROWS_PER_CHUNK_WEIGHTS = 1 << 24  # a matrix is decoded this many weights at a time


@dataclass(frozen=True)
class Storage:
    """How a GGUF type is held in the graph: MatMulNBits' code width and block, and whether a
    per-block correction (a minimum, or a zero point other than MatMulNBits') is added."""

    bits: int
    block: int
    correction: bool

    def __str__(self) -> str:
        return f"{self.bits}-bit, block {self.block}" + (", min correction" if self.correction else "")


STORAGE = {
    "Q4_0": Storage(4, 32, False), "Q4_1": Storage(4, 32, True),
    "Q5_0": Storage(8, 32, False), "Q5_1": Storage(8, 32, True),
    "Q8_0": Storage(8, 32, False),
    "Q2_K": Storage(4, 16, True), "Q3_K": Storage(4, 16, False),
    "Q4_K": Storage(4, 32, True), "Q5_K": Storage(8, 32, True), "Q6_K": Storage(8, 16, False),
}
# Byte offsets of each type's fp16 scale fields in its block (d, and dmin or m where there is one), as
# gguf-py's quants.py lays them out: where tests and benchmarks put finite scales into random blocks.
FP16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82), "Q3_K": (108,),
               "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,)}
FLOAT_TYPES = ("F32", "F16", "BF16")  # not quantized: fp32 in the graph, exactly


@dataclass(frozen=True)
class Blocks:
    """Weights as ``scale · (codes − zero) + offset`` per block: ``codes`` [N, blocks, block] unsigned
    below 2^bits, ``scale`` and ``offset`` [N, blocks] float32."""

    kind: str
    codes: np.ndarray
    scale: np.ndarray
    zero: int
    offset: np.ndarray | None = None

    @property
    def storage(self) -> Storage:
        return STORAGE[self.kind]

    def dequantized(self) -> np.ndarray:
        """[N, K] float32, with gguf-py's own operations: bit for bit its ``dequantize``."""
        w = self.scale[..., None] * (self.codes.astype(np.float32) - np.float32(self.zero))
        if self.offset is not None:
            w = w + self.offset[..., None]
        return w.reshape(w.shape[0], -1)

    def correction(self) -> np.ndarray | None:
        """[N, blocks]: what MatMulNBits (zero point 2^(bits−1)) leaves out of each block's weights."""
        shift = (1 << (self.storage.bits - 1)) - self.zero
        if self.offset is None and shift == 0:
            return None
        total = np.zeros_like(self.scale) if self.offset is None else self.offset
        return total + np.float32(shift) * self.scale if shift else total

    def packed_codes(self) -> np.ndarray:
        """MatMulNBits' B: [N, blocks, block·bits/8] bytes; 4-bit codes two to a byte, the first low."""
        if self.storage.bits == 8:
            return self.codes
        return (self.codes[..., 0::2] | (self.codes[..., 1::2] << 4)).astype(np.uint8)


# --- decoding each type -----------------------------------------------------------------------------
# Each decoder takes the raw blocks [M, type size] and returns codes [M, sub-blocks, sub-block size],
# scale and offset [M, sub-blocks], the expressions following gguf-py's quants.py line by line.


def _half(blocks: np.ndarray, at: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[:, at:at + 2]).view(np.float16).astype(np.float32)  # [M, 1]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes → 32 codes: the low nibbles are elements 0..15, the high 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: 4 bytes, little-endian: bit j is element j's fifth bit."""
    bits = np.ascontiguousarray(qh).view(np.uint32) >> np.arange(32, dtype=np.uint32)
    return (bits & 1).astype(np.uint8)


def _q4_0(b: np.ndarray) -> tuple:
    return _nibbles(b[:, 2:])[:, None], _half(b, 0), 8, None


def _q4_1(b: np.ndarray) -> tuple:
    return _nibbles(b[:, 4:])[:, None], _half(b, 0), 0, _half(b, 2)


def _q5_0(b: np.ndarray) -> tuple:
    q = _nibbles(b[:, 6:]) | (_high_bits(b[:, 2:6]) << 4)
    return (q + 112)[:, None], _half(b, 0), 128, None


def _q5_1(b: np.ndarray) -> tuple:
    q = _nibbles(b[:, 8:]) | (_high_bits(b[:, 4:8]) << 4)
    return (q + 128)[:, None], _half(b, 0), 128, _half(b, 2)


def _q8_0(b: np.ndarray) -> tuple:
    q = np.ascontiguousarray(b[:, 2:]).view(np.int8).astype(np.int16) + 128
    return q.astype(np.uint8)[:, None], _half(b, 0), 128, None


def q2_k_codes(b: np.ndarray) -> np.ndarray:
    """Q2_K blocks [M, 84] → their 2-bit codes [M, 256] in weight order."""
    m = len(b)
    q = (b[:, 16:80].reshape(m, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & np.uint8(3)
    return q.reshape(m, 256)


def _q2_k(b: np.ndarray) -> tuple:
    m = len(b)
    scales = b[:, :16]
    d, dmin = _half(b, 80), _half(b, 82)
    dl = d * (scales & 0xF).astype(np.float32)  # [M, 16]
    ml = dmin * (scales >> 4).astype(np.float32)
    return (q2_k_codes(b) + np.uint8(8)).reshape(m, 16, 16), dl, 8, -ml


def q3_k_codes(b: np.ndarray) -> np.ndarray:
    """Q3_K blocks [M, 110] → their 3-bit codes [M, 256] in weight order: the two low bits and the
    mask bit above them; the weight is code − 4 (a clear mask bit subtracts 4)."""
    m = len(b)
    hmask, qs = b[:, :32], b[:, 32:96]
    ql = (qs.reshape(m, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & np.uint8(3)
    qh = (hmask.reshape(m, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & np.uint8(1)
    return ql.reshape(m, 256) | (qh.reshape(m, 256) << np.uint8(2))


def _q3_k(b: np.ndarray) -> tuple:
    m = len(b)
    packed = b[:, 96:108]
    d = _half(b, 108)
    low = (packed[:, :8].reshape(m, 1, 8) >> np.array([0, 4], np.uint8).reshape(1, 2, 1)).reshape(m, 16)
    high = (packed[:, 8:].reshape(m, 1, 4) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 4, 1)).reshape(m, 16)
    sc = (low & np.uint8(0x0F)) | ((high & np.uint8(0x03)) << np.uint8(4))
    dl = d * (sc.astype(np.int8) - np.int8(32)).astype(np.float32)  # [M, 16]
    return (q3_k_codes(b) + np.uint8(4)).reshape(m, 16, 16), dl, 8, None  # code − 4 + 8


def _k_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: 12 bytes → eight 6-bit scales and eight 6-bit minimums."""
    m = len(packed)
    d, mins, both = np.split(packed.reshape(m, 3, 4), 3, axis=-2)
    sc = np.concatenate([d & 0x3F, (both & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([mins & 0x3F, (both >> 4) | ((mins >> 2) & 0x30)], axis=-1)
    return sc.reshape(m, 8), mn.reshape(m, 8)


def q4_k_codes(b: np.ndarray) -> np.ndarray:
    """Q4_K blocks [M, 144] → their 4-bit codes [M, 256] in weight order."""
    m = len(b)
    q = (b[:, 16:].reshape(m, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & np.uint8(0x0F)
    return q.reshape(m, 256)


def _q4_k(b: np.ndarray) -> tuple:
    m = len(b)
    d, dmin = _half(b, 0), _half(b, 2)
    sc, mn = _k_scale_min(b[:, 4:16])
    return q4_k_codes(b).reshape(m, 8, 32), d * sc.astype(np.float32), 0, -(dmin * mn.astype(np.float32))


def q5_k_codes(b: np.ndarray) -> np.ndarray:
    """Q5_K blocks [M, 176] → their 5-bit codes [M, 256] in weight order."""
    m = len(b)
    ql = (b[:, 48:].reshape(m, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & np.uint8(0x0F)
    qh = (b[:, 16:48].reshape(m, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & np.uint8(1)
    return ql.reshape(m, 256) | (qh.reshape(m, 256) << np.uint8(4))


def _q5_k(b: np.ndarray) -> tuple:
    m = len(b)
    d, dmin = _half(b, 0), _half(b, 2)
    sc, mn = _k_scale_min(b[:, 4:16])
    return q5_k_codes(b).reshape(m, 8, 32) + np.uint8(128), d * sc.astype(np.float32), 128, -(dmin * mn.astype(np.float32))


def q6_k_codes(b: np.ndarray) -> np.ndarray:
    """Q6_K blocks [M, 210] → their 6-bit codes q [M, 256] in weight order (the weight is q − 32)."""
    m = len(b)
    ql, qh = b[:, :128], b[:, 128:192]
    low = (ql.reshape(m, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & np.uint8(0x0F)
    high = (qh.reshape(m, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & np.uint8(0x03)
    return low.reshape(m, 256) | (high.reshape(m, 256) << np.uint8(4))


def _q6_k(b: np.ndarray) -> tuple:
    m = len(b)
    sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
    d = _half(b, 208) * sc  # [M, 16]
    return (q6_k_codes(b) + np.uint8(96)).reshape(m, 16, 16), d, 128, None


_DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
             "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def decode_blocks(kind: str, raw: np.ndarray) -> Blocks:
    """Raw GGUF rows [N, bytes per row] of type ``kind`` (a key of STORAGE) as Blocks [N, ...]."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    rows = raw.shape[0]
    size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]][1]
    codes, scale, zero, offset = _DECODERS[kind](np.asarray(raw, dtype=np.uint8).reshape(-1, size))
    block = STORAGE[kind].block
    return Blocks(kind, np.ascontiguousarray(codes, dtype=np.uint8).reshape(rows, -1, block),
                  np.ascontiguousarray(scale, dtype=np.float32).reshape(rows, -1), zero,
                  None if offset is None else np.ascontiguousarray(offset, dtype=np.float32).reshape(rows, -1))


# --- one GGUF tensor as a matrix ---------------------------------------------------------------------


@dataclass(frozen=True)
class GgufMatrix:
    """A 2-D GGUF tensor as the matrix [N, K] a projection multiplies by (torch's [out, in] layout),
    read from the file's memory map a range of rows at a time. ``order`` moves whole rows (a
    Llama's q/k rotary permutation): output row r is stored row ``order[r]``. ``release``, if
    given, is called after each read: it unmaps the pages read (``GgufDecoder.release_pages``)."""

    name: str
    kind: str  # the GGUF type's name: Q4_K, F16, IQ4_XS, ...
    data: Any  # the reader's memory-mapped rows [N, bytes per row] (float types: [N, K])
    shape: tuple[int, int]
    order: np.ndarray | None = None
    release: Callable[[], None] | None = None

    @property
    def packable(self) -> bool:
        """Whether the blocks go into MatMulNBits as they are (``STORAGE``)."""
        return self.kind in STORAGE

    @cached_property
    def chunk_rows(self) -> int:
        return max(1, ROWS_PER_CHUNK_WEIGHTS // max(self.shape[1], 1))

    def row_ranges(self) -> list[tuple[int, int]]:
        return [(a, min(a + self.chunk_rows, self.shape[0])) for a in range(0, self.shape[0], self.chunk_rows)]

    @property
    def row_bytes(self) -> int:
        """Bytes of one row as the file stores it."""
        return int(self.data.shape[1])

    def raw(self, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) as the file stores them (uint8 blocks), in the model's row order."""
        rows = slice(start, stop) if self.order is None else self.order[start:stop]
        return self._read(rows)

    def _read(self, rows: Any) -> np.ndarray:
        """The raw rows, copied out of the file's map (whose pages are then released)."""
        raw = np.array(self.data[rows])
        if self.release is not None:
            self.release()
        return raw

    def blocks(self, start: int = 0, stop: int | None = None) -> Blocks:
        blocks = decode_blocks(self.kind, self.raw(start, self.shape[0] if stop is None else stop))
        if not (np.isfinite(blocks.scale).all() and (blocks.offset is None or np.isfinite(blocks.offset).all())):
            raise self._corrupt()
        return blocks

    def _corrupt(self) -> Exception:
        from ...errors import ModelLoadError

        return ModelLoadError(f"GGUF tensor {self.name} ({self.kind}) holds non-finite values: the file is corrupt")

    def dequantized(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows [start, stop) in float32, as gguf-py dequantizes them (what transformers loads)."""
        return self._dequantize(self.raw(start, self.shape[0] if stop is None else stop))

    def rows(self, indices: list[int] | np.ndarray) -> np.ndarray:
        """The given rows in float32 (an embedding's rows for the tokens used)."""
        index = np.asarray(indices, dtype=np.int64)
        return self._dequantize(self._read(index if self.order is None else self.order[index]))

    def _dequantize(self, raw: np.ndarray) -> np.ndarray:
        from gguf import GGMLQuantizationType, dequantize

        values = np.ascontiguousarray(dequantize(raw, GGMLQuantizationType[self.kind]), dtype=np.float32)
        if not np.isfinite(values).all():
            raise self._corrupt()
        return values.reshape(raw.shape[0], self.shape[1])

    def full(self) -> np.ndarray:
        """The whole matrix in float32 (the fp32 graph, a type without an exact MatMulNBits form)."""
        out = np.empty(self.shape, np.float32)
        for a, b in self.row_ranges():
            out[a:b] = self.dequantized(a, b)
        return out
