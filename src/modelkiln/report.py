"""Terminal tables shared by the commands (kept out of cli.py so the CLI stays a parser)."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .bench.accuracy import Score
from .manifest import Manifest


def print_variants(console: Console, manifest: Manifest) -> None:
    table = Table(title=f"{escape(manifest.name)}: {manifest.task}, inputs {_inputs(manifest.input_names)}", title_justify="left")
    for col in ("variant", "device", "matrix engine", "kept", "max |Δ|", "min cos", "mean cos", "agreement", "batch cos",
                "ms (b1)", "ms (mix)", "note"):
        table.add_column(col, justify="left" if col in ("variant", "note", "device", "matrix engine") else "right")
    for v in manifest.variants:
        val = v.validation
        table.add_row(
            escape(v.name), v.device, escape(v.details.get("matrix_engine", "—")), "[green]yes[/]" if v.kept else "[red]no[/]",
            f"{val.max_abs_diff:.1e}" if val else "—",
            f"{val.min_cosine:.5f}" if val else "—",
            f"{val.mean_cosine:.5f}" if val else "—",
            f"{val.agreement:.3f}" if val else "—",
            f"{val.batch_min_cosine:.5f}" if val and val.batch_min_cosine is not None else "—",
            f"{v.latency_ms:.2f}" if v.latency_ms is not None else "—",
            f"{v.served_ms:.2f}" if v.served_ms is not None else "—",
            escape(v.reason or (f"{v.details.get('fused_ops')}" if v.details.get("fused_ops") else "")
                   + (v.details.get("method", "").split(":")[0] if v.details.get("method") else "")),
        )
    console.print(table)


def print_accuracy(console: Console, scores: list[Score]) -> None:
    table = Table(title="STS Benchmark: Spearman ×100 of cosine similarity", title_justify="left")
    for col in ("backend", "spearman", "Δ vs pytorch"):
        table.add_column(col, justify="left" if col == "backend" else "right")
    for s in scores:
        table.add_row(escape(s.backend), f"{s.spearman:.3f}", "—" if s.delta is None else f"{s.delta:+.4f}")
    console.print(table)


def _inputs(names: list[str]) -> str:
    """The model's inputs, a decoder's KV-cache tensors counted rather than listed (60 names for 30 layers)."""
    cache = [n for n in names if n.startswith("past_key_values.")]
    shown = ", ".join(n for n in names if n not in cache)
    return f"{shown} and {len(cache)} KV-cache tensors" if cache else shown
