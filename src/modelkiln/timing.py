"""Timing a callable: warm-up, then repeat until both an iteration count and a time budget are met."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import TypeVar

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


K = TypeVar("K", bound=Hashable)  # what names each callable (a label, an id)


def measure_interleaved(
    fns: Mapping[K, Callable[[], object]], rounds: int = 5, seconds_per_round: float = 0.1, warmup: int = 3
) -> dict[K, Stats]:
    """Time several callables in alternating rounds, so a burst of load from elsewhere on the
    machine hits all of them alike and the comparison between them stays fair."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict[K, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            started = time.perf_counter()
            while True:
                t0 = time.perf_counter()
                fn()
                now = time.perf_counter()
                samples[name].append(now - t0)
                if now - started >= seconds_per_round and len(samples[name]) >= 2:
                    break
    return {name: Stats.of(s) for name, s in samples.items()}
