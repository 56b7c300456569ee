"""The serving graph's KV cache: per layer one key and one value buffer
[rows, kv_heads, max_length, head_dim], reserved once and written in place by GroupQueryAttention.

Rows are slots. A decode step binds the first ``n`` rows of every buffer (a contiguous view, so no
copy) and the graph appends each row's new key and value at that row's own length. A row's memory
is committed by the operating system only where it is written: the buffers are anonymous memory
maps, so reserving ``max_length`` for every row costs address space, not RAM, and a finished row's
pages are given back (``engines/memory.py``). What a sequence holds in RAM is its own length,
whatever the longest sequence in the batch is.

Two regions share that layout: ``running`` rows (the decode batch, always rows 0..n-1: a finished
row is filled with the last one, so the batch stays contiguous) and ``staging`` rows, where a
prompt is prefilled (in chunks, batch 1) before it joins. Joining copies the prompt's cache into
the next running row once; a decode step copies nothing.

A KilnAttention graph may keep its keys in another order within the same buffer shape
(``key_blocks``: each block of 16 positions dimension-major, the form its scores read; values stay
position-major), and KilnAttentionF16's caches hold halves (``halves``: float16, half the bytes a
token). Only the graph reads the cache in place; ``read`` and ``write`` (the prefix cache's) take
and give position-major arrays of the cache's own type in either layout."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..memory import give_back, reserve
from .graph_io import KEY_BLOCK as BLOCK


def whole_blocks(positions: int) -> int:
    """``positions`` rounded up to whole key blocks."""
    return -(-positions // BLOCK) * BLOCK

@dataclass(frozen=True)
class CacheShape:
    layers: int
    kv_heads: int
    head_dim: int
    max_length: int  # tokens a row can hold (the model's context, or less; a multiple of 16 with key_blocks)
    key_blocks: bool = False  # keys in blocks of 16 positions, dimension-major (KilnAttention's key_blocks)
    halves: bool = False  # float16 keys and values (KilnAttentionF16), else float32

    def __post_init__(self) -> None:
        if self.key_blocks and self.max_length % BLOCK:
            raise ValueError(f"a key cache in blocks of {BLOCK} holds a multiple of {BLOCK} positions, "
                             f"not {self.max_length}")

    @property
    def dtype(self) -> type[np.floating]:
        return np.float16 if self.halves else np.float32

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * np.dtype(self.dtype).itemsize

    @property
    def row_elements(self) -> int:
        return self.kv_heads * self.max_length * self.head_dim


class RowRegion:
    """``rows`` slots of every layer's key and value buffer, in one anonymous memory map."""

    def __init__(self, shape: CacheShape, rows: int):
        self.shape = shape
        self.rows = rows
        item = np.dtype(shape.dtype).itemsize
        self._map = reserve(2 * shape.layers * rows * shape.row_elements * item)
        # [layer key/value, row, kv_heads, position, head_dim]: index 2 * layer is the key, 2 * layer + 1 the value
        self.all = np.frombuffer(self._map, dtype=shape.dtype).reshape(
            2 * shape.layers, rows, shape.kv_heads, shape.max_length, shape.head_dim)
        self.buffers = list(self.all)  # what the graph binds, one per past/present input
        self._row_bytes = shape.row_elements * item

    def copy_row(self, src: RowRegion, src_row: int, dst_row: int, length: int) -> None:
        """Copy the first ``length`` positions of a row (every layer, key and value): in blocks, up to
        the end of the block holding the last one (the positions after it are written before read)."""
        assert src.shape == self.shape, "rows are copied between regions of one layout"
        if self.shape.key_blocks:
            length = min(whole_blocks(length), self.shape.max_length)
        self.all[:, dst_row, :, :length] = src.all[:, src_row, :, :length]

    def read(self, row: int, start: int, stop: int) -> np.ndarray:
        """A copy of positions [start, stop) of a row: [layer key/value, kv_heads, positions, head_dim]."""
        if not self.shape.key_blocks:
            return self.all[:, row, :, start:stop].copy()
        kv = np.empty_like(self.all[:, row, :, start:stop])
        kv[1::2] = self.all[1::2, row, :, start:stop]
        first, last = start // BLOCK, -(-stop // BLOCK)
        keys = self._key_blocks(row)[:, :, first:last]  # [layers, kv_heads, blocks, 16, head_dim]
        layers, heads, blocks, _, dim = keys.shape
        kv[0::2] = keys.reshape(layers, heads, blocks * BLOCK, dim)[:, :, start - first * BLOCK:stop - first * BLOCK]
        return kv

    def write(self, row: int, start: int, kv: np.ndarray) -> None:
        """Positions [start, start + n) of a row from ``kv`` as ``read`` gives it."""
        stop = start + kv.shape[2]
        if not self.shape.key_blocks:
            self.all[:, row, :, start:stop] = kv
            return
        self.all[1::2, row, :, start:stop] = kv[1::2]
        keys = self._key_blocks(row)
        for block in range(start // BLOCK, -(-stop // BLOCK)):
            lo, hi = max(start, block * BLOCK), min(stop, (block + 1) * BLOCK)
            keys[:, :, block, lo - block * BLOCK:hi - block * BLOCK] = kv[0::2, :, lo - start:hi - start]

    def _key_blocks(self, row: int) -> np.ndarray:
        """A view of a row's keys in blocks (key_blocks layout): [layers, kv_heads, blocks, position in
        the block, head_dim]; the buffer holds each block as [head_dim, 16]."""
        layers, rows, heads, length, dim = self.all.shape  # reshaped whole: contiguous, so always a view
        blocks = self.all.reshape(layers, rows, heads, length // BLOCK, dim, BLOCK)
        return blocks[0::2, row].swapaxes(3, 4)

    def release(self, row: int) -> None:
        """Give the row's pages back to the operating system; it reads as zeros afterwards."""
        size = self.rows * self._row_bytes
        for b in range(len(self.buffers)):
            give_back(self._map, b * size + row * self._row_bytes, self._row_bytes)

    def views(self, start: int, stop: int) -> list[np.ndarray]:
        return [buf[start:stop] for buf in self.buffers]
