"""The random draw of each sampled token: a pure function of (seed, index of the token in the answer).

Philox, a counter-based generator, keyed by the seed and started at the token's index: numpy's
``Generator(Philox(counter=i, key=seed)).random()``. So the same request draws the same uniforms
whatever else runs beside it, on any engine, and a request resumed after i tokens draws what its
first run would have. ``uniforms`` computes a step's draws for all its rows in one native call
(building a numpy Generator costs ~14 us a row); the numpy form is the definition and the fallback."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np

from ...native import sampling_library

_U64 = ctypes.POINTER(ctypes.c_uint64)
_F64 = ctypes.POINTER(ctypes.c_double)


def uniform(seed: int, position: int) -> float:
    """The uniform in [0, 1) that token ``position`` of an answer with ``seed`` draws with."""
    return float(uniforms([seed], [position])[0])


def uniforms(seeds: Sequence[int], positions: Sequence[int]) -> np.ndarray:
    """``uniform(seed, position)`` for each pair, as float64 [n]. A seed or position outside
    [0, 2**64) is numpy's error (a ValueError), never a wrapped number."""
    library = sampling_library()
    # numpy's own form: without the library, and where a seed or position is out of its range (numpy's error)
    if library is None or not seeds or min(seeds) < 0 or min(positions) < 0 or max(seeds) >= 2**64 \
            or max(positions) >= 2**64:  # min and max: a step's rows checked without a Python loop
        return np.asarray([numpy_uniform(s, p) for s, p in zip(seeds, positions)], dtype=np.float64)
    keys = np.asarray(seeds, dtype=np.uint64)
    counters = np.asarray(positions, dtype=np.uint64)
    out = np.empty(len(keys), dtype=np.float64)
    library.kiln_uniforms(keys.ctypes.data_as(_U64), counters.ctypes.data_as(_U64), len(keys),
                          out.ctypes.data_as(_F64))
    return out


def numpy_uniform(seed: int, position: int) -> float:
    """The definition: numpy's Philox generator, keyed by the seed and started at the position."""
    return float(np.random.Generator(np.random.Philox(counter=position, key=seed)).random())
