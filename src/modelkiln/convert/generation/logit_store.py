"""Logits of the gate's token sequences, kept in a temporary file rather than in memory.

The gate compares every prompt position's logits and each greedy step's: about 1,300 rows of the
vocabulary per variant, 0.8 GB for a 152k-token vocabulary (Qwen2.5), as much again for the
reference. Written here as they are made and read back one sequence at a time, they cost the
conversion's memory one sequence's rows. A row is written whole, or a range of its columns at a
time (the layer-by-layer reference computes the head a range of vocabulary rows at a time)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Hashable
from pathlib import Path

import numpy as np


class LogitStore:
    """float32 rows [rows, vocab] per key, in one temporary file (deleted on ``close``)."""

    def __init__(self, vocab: int, folder: Path | None = None):
        self.vocab = vocab
        handle, name = tempfile.mkstemp(prefix="kiln-logits-", suffix=".f32", dir=folder)
        self._fd, self._path = handle, Path(name)
        self._rows: dict[Hashable, tuple[int, int]] = {}  # key → (first row, rows)
        self._next = 0

    def __contains__(self, key: Hashable) -> bool:
        return key in self._rows

    def keys(self) -> list[Hashable]:
        return list(self._rows)

    def reserve(self, key: Hashable, rows: int) -> int:
        """Room for ``rows`` rows under ``key``; returns the first row's index in the file."""
        if key not in self._rows:
            self._rows[key] = (self._next, rows)
            self._next += rows
        return self._rows[key][0]

    def put(self, key: Hashable, values: np.ndarray) -> None:
        """All of ``key``'s rows at once."""
        first = self.reserve(key, len(values))
        data = np.ascontiguousarray(values, dtype=np.float32)
        if data.shape != (self._rows[key][1], self.vocab):
            raise ValueError(f"logits {data.shape} for {key!r}, which has {self._rows[key][1]} rows of {self.vocab}")
        os.pwrite(self._fd, data.data, first * self.vocab * 4)

    def put_columns(self, first_row: int, first_column: int, values: np.ndarray) -> None:
        """Columns ``first_column`` onwards of consecutive rows from ``first_row`` (a file row index)."""
        data = np.ascontiguousarray(values, dtype=np.float32)
        for r, row in enumerate(data):
            os.pwrite(self._fd, row.data, ((first_row + r) * self.vocab + first_column) * 4)

    def get(self, key: Hashable) -> np.ndarray:
        first, rows = self._rows[key]
        size = rows * self.vocab * 4
        data = os.pread(self._fd, size, first * self.vocab * 4)
        if len(data) != size:
            raise OSError(f"the logits file {self._path} ended early")
        return np.frombuffer(data, dtype=np.float32).reshape(rows, self.vocab).copy()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            self._path.unlink(missing_ok=True)

    def __enter__(self) -> LogitStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
