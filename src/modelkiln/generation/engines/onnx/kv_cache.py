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
the next running row once; a decode step copies nothing."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..memory import give_back, reserve

@dataclass(frozen=True)
class CacheShape:
    layers: int
    kv_heads: int
    head_dim: int
    max_length: int  # tokens a row can hold (the model's context, or less)

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * 4

    @property
    def row_floats(self) -> int:
        return self.kv_heads * self.max_length * self.head_dim


class RowRegion:
    """``rows`` slots of every layer's key and value buffer, in one anonymous memory map."""

    def __init__(self, shape: CacheShape, rows: int):
        self.shape = shape
        self.rows = rows
        buffer_floats = rows * shape.row_floats
        self._map = reserve(2 * shape.layers * buffer_floats * 4)
        # [layer key/value, row, kv_heads, position, head_dim]: index 2 * layer is the key, 2 * layer + 1 the value
        self.all = np.frombuffer(self._map, dtype=np.float32).reshape(
            2 * shape.layers, rows, shape.kv_heads, shape.max_length, shape.head_dim)
        self.buffers = list(self.all)  # what the graph binds, one per past/present input
        self._row_bytes = shape.row_floats * 4

    def copy_row(self, src: RowRegion, src_row: int, dst_row: int, length: int) -> None:
        """Copy the first ``length`` positions of a row (every layer, key and value)."""
        self.all[:, dst_row, :, :length] = src.all[:, src_row, :, :length]

    def read(self, row: int, start: int, stop: int) -> np.ndarray:
        """A copy of positions [start, stop) of a row: [layer key/value, kv_heads, positions, head_dim]."""
        return self.all[:, row, :, start:stop].copy()

    def write(self, row: int, start: int, kv: np.ndarray) -> None:
        self.all[:, row, :, start:start + kv.shape[2]] = kv

    def release(self, row: int) -> None:
        """Give the row's pages back to the operating system; it reads as zeros afterwards."""
        size = self.rows * self._row_bytes
        for b in range(len(self.buffers)):
            give_back(self._map, b * size + row * self._row_bytes, self._row_bytes)

    def views(self, start: int, stop: int) -> list[np.ndarray]:
        return [buf[start:stop] for buf in self.buffers]
