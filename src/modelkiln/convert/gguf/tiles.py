"""GGUF rows regrouped for kiln's native ``GgufMatMul`` (``native/gguf_ops.c``, ``native/gguf_q32.c``).

The values are the file's, bit for bit: the same 2- to 8-bit codes, 4- to 8-bit sub-block scales
and fp16 super-block scales, only moved. Sixteen consecutive rows (output columns) make a tile; a
tile's super-blocks follow each other, and inside one the codes of the sixteen columns are
interleaved four at a time, so that every 32-bit lane of a 64-byte vector belongs to one column:

    Q4_K, 2304 bytes = 16 × 144:
        qs    [32 v][16 col][4]  low nibble: code 4v+i, high nibble: code 128+4v+i
        sc    [3][16 col][4]     the file's 12 bytes of 6-bit scales and minimums, as three words
        d     [16 col] fp16,  dmin [16 col] fp16
    Q5_K, 2816 bytes = 16 × 176 (codes q in 0..31):
        qs    [32 v][16 col][4]  as Q4_K's: the codes' low four bits
        sc    [3][16 col][4]     as Q4_K's
        qh    [8 h][16 col][4]   bit b: the fifth bit of code 4(h + 8b)+i
        d     [16 col] fp16,  dmin [16 col] fp16
    Q6_K, 3360 bytes = 16 × 210 (codes q in 0..63, the weight is d·sc·(q − 32)):
        ql    [32 v][16 col][4]  low nibble: q & 15 of code 4v+i, high nibble: of code 128+4v+i
        qh    [16 h][16 col][4]  bits 2f..2f+1: q >> 4 of code 4(h + 16f)+i
        sc    [16][16 col]       signed 8-bit scales of each 16 codes
        d     [16 col] fp16
    Q2_K, 1344 bytes = 16 × 84, and Q3_K, 1760 bytes = 16 × 110 (a scale per 16 codes):
        qs    [16 v][16 col][4]  bits 2s..2s+1: the two low bits of code 64s+4v+i
        Q2_K: sc [16][16 col]    the file's bytes: scale | minimum << 4 of each 16 codes;  d, dmin [16 col] fp16
        Q3_K: hm [8 h][16 col][4]  bit b: the third bit of code 4(h + 8b)+i (the weight is d·(sc − 32)·(q − 4));
              sc [3][16 col][4]  the file's 12 bytes of 6-bit scales, as three words;  d [16 col] fp16
    The types with one scale per 32 weights, a block of 32 inputs of all sixteen columns at a time:
        codes [4 v][16 col][4]   the file's byte 4v+i: low nibble code 4v+i, high nibble code 16+4v+i
              Q8_0: [8 v][16 col][4], signed code 4v+i
        high  Q5_0, Q5_1: [16 col][4]: byte i, bit 2v: the fifth bit of code 4v+i, bit 2v+1: of 16+4v+i
        d     [16 col] fp16,  m [16 col] fp16 (Q4_1, Q5_1)

Why: one vector instruction then multiplies four codes of sixteen columns by four broadcast
activations and sums them per column (``vpdpbusd``), with no sums across lanes; a per-row layout
needs a horizontal reduction for every column and super-block, which cost more than the products
when several rows are multiplied at once. The tiles take as many bytes as the file's rows; a last
tile short of sixteen rows is filled with zero blocks (scale 0), whose results are dropped."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

from .blocks import q2_k_codes, q3_k_codes, q4_k_codes, q5_k_codes, q6_k_codes

TILE = 16  # columns a tile
# one (super-)block of one row, as the file stores it
BLOCK_BYTES = {"Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34}


def tiles(kind: str, raw: np.ndarray) -> np.ndarray:
    """The file's rows [N, bytes per row] of ``kind`` as tiles [ceil(N / 16), bytes per row · 16]."""
    size = BLOCK_BYTES[kind]
    n, row_bytes = raw.shape
    nb = row_bytes // size
    padded = -n % TILE
    if padded:
        raw = np.concatenate([raw, np.zeros((padded, row_bytes), np.uint8)])
    count = raw.shape[0] // TILE
    blocks = np.ascontiguousarray(raw.reshape(count, TILE, nb, size).transpose(0, 2, 1, 3))  # [tile, block, col, bytes]
    k_quants = {"Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}
    parts = k_quants[kind](blocks) if kind in k_quants else _per_32(kind, blocks)
    lead = (count, nb)
    return np.concatenate([np.ascontiguousarray(p).reshape(*lead, -1) for p in parts], axis=-1).reshape(count, -1)


def _lanes(codes: np.ndarray) -> np.ndarray:
    """[..., col, 32 v, 4] → [..., 32 v, col, 4]: four codes of each column side by side."""
    return np.swapaxes(codes, -3, -2)


def _bit_planes(bits: np.ndarray, lead: tuple) -> np.ndarray:
    """One bit of each code [.., 256] (0 or 1) → [.., 8 h, col, 4]: byte i, bit b = the bit of code 4(h + 8b) + i
    (Q3_K's third bits, Q5_K's fifth)."""
    planes = bits.reshape(*lead, 8, 8, 4)  # [.., b, h, i]
    packed = np.zeros((*lead, 8, 4), np.uint8)
    for bit in range(8):
        packed |= planes[..., bit, :, :] << np.uint8(bit)
    return _lanes(packed)


def _two_bit_codes(q: np.ndarray, lead: tuple) -> np.ndarray:
    """Codes [.., 256] (their two low bits) → [.., 16 v, col, 4]: byte i, bits 2s..2s+1 = code 64s + 4v + i."""
    low = (q & np.uint8(3)).reshape(*lead, 4, 16, 4)  # [.., s, v, i]
    return _lanes(low[..., 0, :, :] | (low[..., 1, :, :] << np.uint8(2)) | (low[..., 2, :, :] << np.uint8(4))
                  | (low[..., 3, :, :] << np.uint8(6)))


def _q2_k(b: np.ndarray) -> list[np.ndarray]:
    lead = b.shape[:-1]
    q = q2_k_codes(b.reshape(-1, b.shape[-1])).reshape(*lead, 256)
    return [_two_bit_codes(q, lead), np.swapaxes(b[..., 0:16], -1, -2), b[..., 80:82], b[..., 82:84]]


def _q3_k(b: np.ndarray) -> list[np.ndarray]:
    lead = b.shape[:-1]
    q = q3_k_codes(b.reshape(-1, b.shape[-1])).reshape(*lead, 256)  # 0..7, in weight order
    return [_two_bit_codes(q, lead), _bit_planes(q >> np.uint8(2), lead), _lanes(b[..., 96:108].reshape(*lead, 3, 4)),
            b[..., 108:110]]


def _q4_k(b: np.ndarray) -> list[np.ndarray]:
    lead = b.shape[:-1]  # tile, block, col
    codes = q4_k_codes(b.reshape(-1, b.shape[-1])).reshape(*lead, 2, 32, 4)  # [.., first or second 128, v, i]
    return [_lanes(codes[..., 0, :, :] | (codes[..., 1, :, :] << np.uint8(4))),
            _lanes(b[..., 4:16].reshape(*lead, 3, 4)), b[..., 0:2], b[..., 2:4]]


def _q5_k(b: np.ndarray) -> list[np.ndarray]:
    lead = b.shape[:-1]
    q = q5_k_codes(b.reshape(-1, b.shape[-1])).reshape(*lead, 256)  # 0..31, in weight order
    low = (q & np.uint8(0x0F)).reshape(*lead, 2, 32, 4)
    return [_lanes(low[..., 0, :, :] | (low[..., 1, :, :] << np.uint8(4))), _lanes(b[..., 4:16].reshape(*lead, 3, 4)),
            _bit_planes(q >> np.uint8(4), lead), b[..., 0:2], b[..., 2:4]]


def _q6_k(b: np.ndarray) -> list[np.ndarray]:
    lead = b.shape[:-1]
    q = q6_k_codes(b.reshape(-1, b.shape[-1])).reshape(*lead, 256)  # 0..63, in weight order
    low = (q & np.uint8(0x0F)).reshape(*lead, 2, 32, 4)
    ql = low[..., 0, :, :] | (low[..., 1, :, :] << np.uint8(4))
    top = (q >> np.uint8(4)).reshape(*lead, 4, 16, 4)  # [.., f, h, i]: code 4(h + 16f) + i
    qh = top[..., 0, :, :] | (top[..., 1, :, :] << np.uint8(2)) | (top[..., 2, :, :] << np.uint8(4)) | (top[..., 3, :, :] << np.uint8(6))
    return [_lanes(ql), _lanes(qh), np.swapaxes(b[..., 192:208], -1, -2), b[..., 208:210]]


def _per_32(kind: str, b: np.ndarray) -> list[np.ndarray]:
    """Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0: [d][m][qh][qs] as the file orders a block."""
    lead = b.shape[:-1]
    d = b[..., 0:2]
    m = b[..., 2:4] if kind in ("Q4_1", "Q5_1") else None
    at = 2 if m is None else 4
    if kind == "Q8_0":
        return [_lanes(b[..., 2:34].reshape(*lead, 8, 4)), d]
    if kind in ("Q5_0", "Q5_1"):
        fifth = np.unpackbits(b[..., at:at + 4], axis=-1, bitorder="little").reshape(*lead, 2, 4, 4)  # [.., second, v, i]
        weights = (np.uint8(1) << (2 * np.arange(4, dtype=np.uint8)[:, None] + np.arange(2, dtype=np.uint8)[:, None, None]))
        high = (fifth * weights).sum(axis=(-3, -2), dtype=np.uint8)  # [.., i]: bit 2v + second
        parts = [_lanes(b[..., at + 4:at + 20].reshape(*lead, 4, 4)), high, d]
    else:
        parts = [_lanes(b[..., at:at + 16].reshape(*lead, 4, 4)), d]
    return parts if m is None else parts + [m]


def tiled_rows(kind: str, chunks: Iterable[np.ndarray]) -> Iterator[np.ndarray]:
    """Tiles of a stream of row ranges (any sizes), each range's rows held only until its tiles
    are made: a converter streams a matrix without holding it."""
    held: np.ndarray | None = None
    for chunk in chunks:
        rows = chunk if held is None else np.concatenate([held, chunk])
        whole = rows.shape[0] - rows.shape[0] % TILE
        if whole:
            yield tiles(kind, rows[:whole])
        held = rows[whole:] if whole < rows.shape[0] else None
    if held is not None:
        yield tiles(kind, held)


def tile_count(rows: int) -> int:
    return -(-rows // TILE)
