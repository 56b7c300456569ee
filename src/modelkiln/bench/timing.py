"""Timing a callable: warm-up, then repeat until both an iteration count and a time budget are met."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Stats:
    """Latency statistics in milliseconds."""

    iterations: int
    mean: float
    sd: float
    min: float
    max: float
    median: float
    p95: float
    p99: float

    @classmethod
    def of(cls, seconds: list[float]) -> Stats:
        ms = np.asarray(seconds, dtype=np.float64) * 1000.0
        return cls(
            iterations=len(ms),
            mean=float(ms.mean()),
            sd=float(ms.std(ddof=1)) if len(ms) > 1 else 0.0,
            min=float(ms.min()),
            max=float(ms.max()),
            median=float(np.median(ms)),
            p95=float(np.percentile(ms, 95)),
            p99=float(np.percentile(ms, 99)),
        )


def measure(
    fn: Callable[[], object], warmup: int = 3, min_iters: int = 10, min_seconds: float = 1.0, max_iters: int = 100_000
) -> Stats:
    for _ in range(warmup):
        fn()
    samples: list[float] = []
    started = time.perf_counter()
    while len(samples) < max_iters and (len(samples) < min_iters or time.perf_counter() - started < min_seconds):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return Stats.of(samples)
