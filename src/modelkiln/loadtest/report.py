"""Results out: a terminal table, CSV (one row per step), JSON (the whole run; ``plot`` reads it back)."""

from __future__ import annotations

import csv
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.markup import escape

from ..errors import KilnError
from .runner import Latency, RunResult, StepResult
from .server_metrics import ModelBreakdown, ServerBreakdown

CSV_COLUMNS = ("label", "mode", "value", "throughput", "inputs_per_s", "p50_ms", "p90_ms", "p95_ms", "p99_ms",
               "max_ms", "mean_ms", "requests", "errors", "stable", "windows", "late_fraction",
               "server_queue_ms", "server_compute_ms", "server_batch_size")


def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _errors(errors: dict[str, int]) -> str:
    return " ".join(f"{k}:{v}" for k, v in sorted(errors.items())) or "0"


def print_table(console: Any, result: RunResult) -> None:
    from rich.table import Table

    table = Table(title=escape(f"{result.label}: {result.model} at {result.url} ({result.protocol}, batch {result.batch}, "
                        f"{result.inputs})"), title_justify="left")
    for name in ("load", "req/s", "inputs/s", "p50 ms", "p90 ms", "p95 ms", "p99 ms", "max ms", "errors",
                 "queue ms", "compute ms", "batch", "stable"):
        table.add_column(name, justify="right")
    for s in result.steps:
        lat = s.latency
        srv = s.server
        stable = "yes" if s.stable else f"no ({s.windows} windows)"
        if s.late_fraction:
            stable += f", {s.late_fraction:.0%} late"
        table.add_row(s.load.label, _f(s.throughput), _f(s.inputs_per_s),
                      *(_f(getattr(lat, k), 2) if lat else "-" for k in ("p50", "p90", "p95", "p99", "max")),
                      _errors(s.errors), _f(srv.queue_ms if srv else None, 2), _f(srv.compute_ms if srv else None, 2),
                      _f(srv.batch_size if srv else None, 1), stable)
    console.print(table)


def rows(result: RunResult) -> list[dict[str, Any]]:
    out = []
    for s in result.steps:
        lat = s.latency
        out.append({
            "label": result.label, "mode": s.mode, "value": s.value, "throughput": round(s.throughput, 3),
            "inputs_per_s": round(s.inputs_per_s, 3),
            **{f"{k}_ms": (round(getattr(lat, k), 4) if lat else None) for k in ("p50", "p90", "p95", "p99", "max", "mean")},
            "requests": s.requests, "errors": _errors(s.errors), "stable": s.stable, "windows": s.windows,
            "late_fraction": s.late_fraction,
            "server_queue_ms": s.server.queue_ms if s.server else None,
            "server_compute_ms": s.server.compute_ms if s.server else None,
            "server_batch_size": s.server.batch_size if s.server else None,
        })
    return out


def write_csv(path: Path, result: RunResult) -> None:
    with Path(path).open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for row in rows(result):
            writer.writerow(row)


def write_json(path: Path, result: RunResult) -> None:
    Path(path).write_text(json.dumps({"kiln_loadtest": 1, **asdict(result)}, indent=2), encoding="utf-8")


def _breakdown(data: dict[str, Any] | None) -> ServerBreakdown | None:
    if not data:
        return None
    models = {k: ModelBreakdown(**v) for k, v in (data.get("models") or {}).items()}
    return ServerBreakdown(**{**data, "models": models})


def read_json(path: Path | str) -> RunResult:
    """A file written by ``--json`` (so ``--plot`` can draw earlier runs next to this one)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        if data.pop("kiln_loadtest", None) != 1:
            raise ValueError("not a kiln loadtest result")
        steps = []
        for s in data.pop("steps"):
            s["latency"] = Latency(**s["latency"]) if s.get("latency") else None
            s["server"] = _breakdown(s.get("server"))
            s["server_total"] = _breakdown(s.get("server_total"))
            steps.append(StepResult(**s))
        return RunResult(**data, steps=steps)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise KilnError(f"cannot read loadtest results from {path}: {exc}") from None
