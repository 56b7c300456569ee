"""The ranking table (like Model Analyzer's summary), the JSON of every trial, and the best config."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..serve.config_file import write_serve_config
from .sweep import Trial, TuneResult, sweepable_flags


def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _auto(value: Any) -> str:
    """A setting's value in the table: None is the server's default."""
    if value is None:
        return "auto"
    return value if isinstance(value, str) else f"{value:g}"


def print_ranking(console: Any, result: TuneResult) -> None:
    from rich.table import Table

    budget = f"p99 ≤ {result.p99_budget_ms:g} ms" if result.p99_budget_ms is not None else "no p99 budget"
    table = Table(title=f"kiln tune {result.model} ({budget}), best first", title_justify="left")
    swept = list(sweepable_flags("encoder"))  # a column per sweepable setting, as the declaration lists them
    for name in ("#", *(n.replace("_", " ") for n in swept),
                 "best load", "req/s", "inputs/s", "p50 ms", "p99 ms", "server batch", "peak RSS MB", "budget"):
        table.add_column(name, justify="right")
    for rank, t in enumerate(result.ranked(), 1):
        s = t.settings
        b = t.best
        status = t.error[:40] if t.error else ("ok" if t.within_budget else "over")
        table.add_row(str(rank), *(_auto(s.get(name)) for name in swept), b.load.label if b else "-",
                      _f(b.throughput if b else None), _f(b.inputs_per_s if b else None),
                      _f(b.latency.p50 if b and b.latency else None, 2), _f(t.p99_ms, 2),
                      _f(b.server.batch_size if b and b.server else None), _f(t.peak_rss_mb, 0), status)
    console.print(table)


def trial_notes(result: TuneResult, trial: Trial) -> dict[str, Any]:
    b = trial.best
    return {
        "tuned_by": "kiln tune",
        "artifact": result.artifact,
        "p99_budget_ms": result.p99_budget_ms,
        "within_budget": trial.within_budget,
        "measured": {
            "load": b.load.label if b else None, "throughput_rps": round(trial.throughput, 2),
            "p99_ms": round(trial.p99_ms, 3) if trial.p99_ms is not None else None,
            "peak_rss_mb": round(trial.peak_rss_mb, 1) if trial.peak_rss_mb is not None else None,
        },
    }


def write_best(path: Path, result: TuneResult, trial: Trial) -> None:
    # None means "the server's default": leave it out so the server (and KILN_* env vars) decide
    write_serve_config(path, {k: v for k, v in trial.settings.items() if v is not None}, trial_notes(result, trial))


def write_json(path: Path, result: TuneResult) -> None:
    data = {"artifact": result.artifact, "model": result.model, "p99_budget_ms": result.p99_budget_ms,
            "trials": [{**asdict(t), "rank": i} for i, t in enumerate(result.ranked(), 1)]}
    Path(path).write_text(json.dumps(data, indent=2), encoding="utf-8")
