"""Results out: a terminal table, CSV (one row per step), JSON (the whole run; ``plot`` reads it back)."""

from __future__ import annotations

import csv
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.markup import escape

from ..errors import KilnError
from .runner import GenerationStats, Latency, RunResult, StepResult
from .server_metrics import ModelBreakdown, ServerBreakdown

CSV_COLUMNS = ("label", "mode", "value", "throughput", "inputs_per_s", "p50_ms", "p90_ms", "p95_ms", "p99_ms",
               "max_ms", "mean_ms", "requests", "errors", "stable", "windows", "late_fraction",
               "server_queue_ms", "server_compute_ms", "server_batch_size", "checked", "mismatches")
GENERATION_CSV_COLUMNS = ("label", "mode", "value", "load", "requests_per_s", "output_tokens_per_s", "ttft_p50_ms",
                          "ttft_p90_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p90_ms", "itl_p99_ms", "latency_p50_ms",
                          "latency_p90_ms", "latency_p99_ms", "output_tokens_per_request", "tokens_from", "requests",
                          "errors", "errors_total", "stream_errors", "checked", "mismatches", "stable", "windows",
                          "late_fraction")


def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _errors(errors: dict[str, int]) -> str:
    return " ".join(f"{k}:{v}" for k, v in sorted(errors.items())) or "0"


def _ms(lat: Latency | None, k: str) -> float | None:
    return round(getattr(lat, k), 3) if lat is not None else None


def summary(s: StepResult) -> dict[str, Any]:
    """The flat per-step numbers (docs/loadtest-generation.md names them; ``--json`` writes them
    into every step next to the full record)."""
    g = s.generation
    return {
        "load": s.load.label, "requests_per_s": round(s.throughput, 4),
        "output_tokens_per_s": round(g.output_tokens_per_s, 3) if g else None,
        **{f"ttft_{k}_ms": _ms(g.ttft if g else None, k) for k in ("p50", "p90", "p99")},
        **{f"itl_{k}_ms": _ms(g.itl if g else None, k) for k in ("p50", "p90", "p99")},
        **{f"latency_{k}_ms": _ms(s.latency, k) for k in ("p50", "p90", "p99")},
        "output_tokens_per_request": round(g.output_tokens_per_request, 2) if g else None,
        "tokens_from": g.tokens_from if g else None,
        "errors_total": sum(s.errors.values()),
    }


SUMMARY_KEYS = tuple(summary(StepResult("concurrency", 1, 0, 0, 0, None, {}, 0, True, 1, 0, {})))


def _check(s: StepResult) -> str:
    if s.mismatches is None:
        return "-"
    kinds = " ".join(f"{k}:{v}" for k, v in sorted((s.mismatch_kinds or {}).items()))
    return f"{s.mismatches}/{s.checked}" + (f" ({kinds})" if kinds else "")


def print_generation_table(console: Any, result: RunResult) -> None:
    from rich.table import Table

    sources = {s.generation.tokens_from for s in result.steps if s.generation and s.generation.tokens_from}
    length = (f"max_tokens {result.max_tokens if result.max_tokens is not None else 'server default'}"
              f"{', ignore_eos' if result.ignore_eos else ', natural lengths'}"
              f"{', sampled (temperature 0.7, top_p 0.95, seeded)' if result.sampled else ''}")
    table = Table(title=escape(f"{result.label}: {result.model} at {result.url} ({result.protocol}, {result.inputs}, "
                               f"{length}; output tokens from {'/'.join(sorted(sources)) or '-'})"),
                  title_justify="left")
    for name in ("load", "req/s", "out tok/s", "TTFT p50", "p90", "p99", "ITL p50", "p90", "p99",
                 "latency p50", "p90", "p99", "tok/req", "errors", "mismatches", "stable"):
        table.add_column(name, justify="right")
    for s in result.steps:
        g = s.generation
        stable = "yes" if s.stable else f"no ({s.windows} w)"
        if s.late_fraction:
            stable += f", {s.late_fraction:.0%} late"
        table.add_row(s.load.label, _f(s.throughput, 2), _f(g.output_tokens_per_s if g else None),
                      *(_f(getattr(g.ttft, k), 1) if g and g.ttft else "-" for k in ("p50", "p90", "p99")),
                      *(_f(getattr(g.itl, k), 1) if g and g.itl else "-" for k in ("p50", "p90", "p99")),
                      *(_f(getattr(s.latency, k), 0) if s.latency else "-" for k in ("p50", "p90", "p99")),
                      _f(g.output_tokens_per_request if g else None), _errors(s.errors), _check(s), stable)
    console.print(table)
    console.print("times in ms; ITL: gaps between token chunks; mismatches: differing/compared answers of the "
                  "whole step (--check)" if result.check else "times in ms; ITL: gaps between token chunks",
                  markup=False)


def print_table(console: Any, result: RunResult) -> None:
    from rich.table import Table

    if any(s.generation is not None for s in result.steps):
        print_generation_table(console, result)
        return

    table = Table(title=escape(f"{result.label}: {result.model} at {result.url} ({result.protocol}, batch {result.batch}, "
                        f"{result.inputs})"), title_justify="left")
    checking = any(s.mismatches is not None for s in result.steps)
    for name in ("load", "req/s", "inputs/s", "p50 ms", "p90 ms", "p95 ms", "p99 ms", "max ms", "errors",
                 *(("mismatches",) if checking else ()), "queue ms", "compute ms", "batch", "stable"):
        table.add_column(name, justify="right")
    for s in result.steps:
        lat = s.latency
        srv = s.server
        stable = "yes" if s.stable else f"no ({s.windows} windows)"
        if s.late_fraction:
            stable += f", {s.late_fraction:.0%} late"
        table.add_row(s.load.label, _f(s.throughput), _f(s.inputs_per_s),
                      *(_f(getattr(lat, k), 2) if lat else "-" for k in ("p50", "p90", "p95", "p99", "max")),
                      _errors(s.errors), *((_check(s),) if checking else ()), _f(srv.queue_ms if srv else None, 2), _f(srv.compute_ms if srv else None, 2),
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
            "checked": s.checked, "mismatches": s.mismatches, "stream_errors": s.stream_errors,
            **summary(s),
        })
    return out


def write_csv(path: Path, result: RunResult) -> None:
    generation = any(s.generation is not None for s in result.steps)
    with Path(path).open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=GENERATION_CSV_COLUMNS if generation else CSV_COLUMNS,
                                extrasaction="ignore")
        writer.writeheader()
        for row in rows(result):
            writer.writerow(row)


def record(result: RunResult) -> dict[str, Any]:
    """The whole run as ``--json`` writes it (``read_json`` reads it back); ``kiln tune`` embeds it."""
    data = asdict(result)
    data["steps"] = [{**summary(s), **d} for s, d in zip(result.steps, data["steps"])]
    return {"kiln_loadtest": 1, **data}


def write_json(path: Path, result: RunResult) -> None:
    Path(path).write_text(json.dumps(record(result), indent=2), encoding="utf-8")


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
            for key in SUMMARY_KEYS:  # derived numbers, written for readers of the file
                s.pop(key, None)
            s["latency"] = Latency(**s["latency"]) if s.get("latency") else None
            if s.get("generation"):
                g = s["generation"]
                s["generation"] = GenerationStats(**{**g, "ttft": Latency(**g["ttft"]) if g.get("ttft") else None,
                                                     "itl": Latency(**g["itl"]) if g.get("itl") else None})
            s["server"] = _breakdown(s.get("server"))
            s["server_total"] = _breakdown(s.get("server_total"))
            steps.append(StepResult(**s))
        return RunResult(**data, steps=steps)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise KilnError(f"cannot read loadtest results from {path}: {exc}") from None
