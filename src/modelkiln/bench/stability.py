"""Warnings for bench timings that should not be quoted: a cell whose repeats spread widely, or a
backend whose latency goes down as the work goes up (its larger cells ran while the machine was busy).

Both come from the same cause, another process taking the CPU during the run; a busy 2-core machine once
turned PyTorch's cells into a "98.19×" ONNX Runtime speed-up. The run still prints its table: these
lines say which numbers to re-measure."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from ..timing import Stats

# p95 over median: on a quiet machine ONNX Runtime and PyTorch cells stay well under this.
MAX_SPREAD = 1.5
# A cell with at least as much work (batch and seq both >=) this much faster than a smaller one is out of order.
MAX_INVERSION = 1.5
# Fusions and int8 make all-MiniLM-L6-v2 at most 5.0x faster than PyTorch on CPU (batch 1 x 16 tokens, quiet
# 2-core machine); a CPU speed-up over 10x means PyTorch's cells were starved, as in a demo run on a busy machine
# where PyTorch took 2,811 ms at batch 1 x 16 tokens against 82 ms for int8 (34x).
MAX_CPU_SPEEDUP = 10.0


class TimedCell(Protocol):
    backend: str
    device: str
    batch: int
    seq: int
    stats: Stats
    speedup: float | None


def timing_warnings(cells: Sequence[TimedCell]) -> list[str]:
    warnings = []
    for c in cells:
        if c.stats.median > 0 and c.stats.p95 / c.stats.median > MAX_SPREAD:
            warnings.append(f"{c.backend} @ {c.batch}×{c.seq}: p95 is {c.stats.p95 / c.stats.median:.1f}× the median "
                            "(the repeats spread widely)")
    for small in cells:
        for big in cells:
            if (big.backend == small.backend and (big.batch, big.seq) != (small.batch, small.seq)
                    and big.batch >= small.batch and big.seq >= small.seq
                    and small.stats.median > MAX_INVERSION * big.stats.median):
                warnings.append(f"{small.backend} @ {small.batch}×{small.seq} took {small.stats.median:.2f} ms, "
                                f"longer than the larger {big.batch}×{big.seq} ({big.stats.median:.2f} ms)")
    for c in cells:
        if c.device == "cpu" and c.speedup and c.speedup > MAX_CPU_SPEEDUP:
            warnings.append(f"{c.backend} @ {c.batch}×{c.seq}: {c.speedup:.1f}× PyTorch is beyond what ONNX Runtime "
                            f"gives on CPU (at most about 5× measured): the PyTorch cells were likely slowed down")
    return warnings
