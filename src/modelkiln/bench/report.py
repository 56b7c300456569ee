"""Bench results as a terminal table and as JSON."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .runner import BenchResult, machine_title
from .stability import timing_warnings


def print_table(console: Console, result: BenchResult) -> None:
    table = Table(title=escape(f"{result.model} ({result.task}) — {machine_title(result.machine)}"), title_justify="left")
    has_reference = any(c.speedup for c in result.cells)
    columns = ["batch", "seq", "backend", "matrix engine", "mean", "sd", "min", "max", "median", "p95", "p99", "seq/s", "tokens/s"]
    for col in columns + (["speed-up"] if has_reference else []):
        table.add_column(col, justify="left" if col in ("backend", "matrix engine") else "right")
    cells = sorted(result.cells, key=lambda c: (c.batch, c.seq))
    previous = None
    for c in cells:
        if previous is not None and (c.batch, c.seq) != previous:
            table.add_section()
        previous = (c.batch, c.seq)
        s = c.stats
        row = [str(c.batch), str(c.seq), escape(c.backend), escape(c.matrix_engine), *(f"{v:.2f}" for v in (s.mean, s.sd, s.min, s.max, s.median, s.p95, s.p99)),
               f"{c.sequences_per_s:,.0f}", f"{c.tokens_per_s:,.0f}"]
        table.add_row(*row, *([f"{c.speedup:.2f}×" if c.speedup else "—"] if has_reference else []))
    console.print(table)
    footer = "latencies in ms; throughput from the median"
    console.print(f"[dim]{footer}; speed-up against pytorch fp32 in this run[/]" if has_reference else f"[dim]{footer}[/]")
    for note in result.skipped:
        console.print(f"[yellow]skipped:[/] {escape(note)}", soft_wrap=True)  # one line, e.g. a log's path to copy
    warnings = timing_warnings(result.cells)
    for warning in warnings:
        console.print(f"[yellow]unstable:[/] {escape(warning)}")
    if warnings:
        console.print("[yellow]Timings were disturbed (another process using the CPU?): re-run on a quiet machine "
                      "before quoting these numbers.[/]")


def to_dict(result: BenchResult) -> dict:
    return {
        "model": result.model,
        "task": result.task,
        "machine": result.machine,
        "config": asdict(result.config),
        "skipped": result.skipped,
        "timing_warnings": timing_warnings(result.cells),
        "cells": [
            {"backend": c.backend, "matrix_engine": c.matrix_engine, "device": c.device, "batch": c.batch, "seq": c.seq, **asdict(c.stats),
             "sequences_per_s": c.sequences_per_s, "tokens_per_s": c.tokens_per_s, "speedup": c.speedup}
            for c in result.cells
        ],
    }


def write_json(path: Path, result: BenchResult) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_dict(result), indent=2) + "\n")
