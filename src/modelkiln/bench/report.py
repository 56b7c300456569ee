"""Bench results as a terminal table and as JSON."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.table import Table

from .runner import BenchResult


def print_table(console: Console, result: BenchResult) -> None:
    m = result.machine
    table = Table(title=f"{result.model} ({result.task}) — {m['cpu']}, {m['threads']} threads, onnxruntime {m['onnxruntime']}",
                  title_justify="left")
    for col in ("batch", "seq", "backend", "mean", "sd", "min", "max", "median", "p95", "p99", "seq/s", "tokens/s", "speed-up"):
        table.add_column(col, justify="left" if col == "backend" else "right")
    cells = sorted(result.cells, key=lambda c: (c.batch, c.seq))
    previous = None
    for c in cells:
        if previous is not None and (c.batch, c.seq) != previous:
            table.add_section()
        previous = (c.batch, c.seq)
        s = c.stats
        table.add_row(str(c.batch), str(c.seq), c.backend, *(f"{v:.2f}" for v in (s.mean, s.sd, s.min, s.max, s.median, s.p95, s.p99)),
                      f"{c.sequences_per_s:,.0f}", f"{c.tokens_per_s:,.0f}", f"{c.speedup:.2f}×" if c.speedup else "—")
    console.print(table)
    console.print("[dim]latencies in ms; throughput and speed-up from the median; speed-up against pytorch fp32 in this run[/]")
    for note in result.skipped:
        console.print(f"[yellow]skipped:[/] {note}")


def to_dict(result: BenchResult) -> dict:
    return {
        "model": result.model,
        "task": result.task,
        "machine": result.machine,
        "config": asdict(result.config),
        "skipped": result.skipped,
        "cells": [
            {"backend": c.backend, "device": c.device, "batch": c.batch, "seq": c.seq, **asdict(c.stats),
             "sequences_per_s": c.sequences_per_s, "tokens_per_s": c.tokens_per_s, "speedup": c.speedup}
            for c in result.cells
        ],
    }


def write_json(path: Path, result: BenchResult) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_dict(result), indent=2) + "\n")
