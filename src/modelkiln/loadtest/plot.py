"""Latency against throughput, one curve per run (this one and any earlier ``--json`` files)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..errors import KilnError
from .runner import RunResult

PERCENTILES = ("p50", "p90", "p95", "p99")


def plot(results: Sequence[RunResult], path: Path | str, percentile: str = "p95", title: str | None = None) -> None:
    if percentile not in PERCENTILES:
        raise KilnError(f"--plot-percentile must be one of {', '.join(PERCENTILES)}")
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display, no GUI toolkit
        import matplotlib.pyplot as plt
    except ImportError:
        raise KilnError("--plot needs matplotlib (pip install matplotlib)") from None
    # generation runs: time to first token against output tokens/s (genai-perf's main curve)
    generation = any(s.generation is not None for r in results for s in r.steps)
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for result in results:
        if generation:
            points = [(s.generation.output_tokens_per_s, getattr(s.generation.ttft, percentile), s.load.label)
                      for s in result.steps if s.generation and s.generation.ttft]
        else:
            points = [(s.throughput, getattr(s.latency, percentile), s.load.label) for s in result.steps if s.latency]
        if not points:
            continue
        xs, ys, labels = zip(*points)
        ax.plot(xs, ys, marker="o", label=f"{result.label} ({result.protocol}"
                                          f"{'' if generation else f', batch {result.batch}'})")
        for x, y, text in zip(xs, ys, labels):
            ax.annotate(text, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7, alpha=0.7)
    what = "time to first token" if generation else "latency"
    ax.set_xlabel("output tokens/s" if generation else "throughput (requests/s)")
    ax.set_ylabel(f"{percentile} {what} (ms)")
    ax.set_title(title or f"{percentile} {what} vs throughput", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.margins(0.1)  # room for the point labels
    ax.set_ylim(bottom=0)
    ax.set_xlim(left=0)
    if any(r.steps for r in results):
        ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(str(path), format="png")
    plt.close(fig)
