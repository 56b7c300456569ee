"""Generation bench and eval results as terminal tables and JSON."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .generation import GenerationBenchResult, best_ratio
from .generation_eval import GenerationScore
from .runner import machine_title


def print_generation_bench(console: Console, result: GenerationBenchResult) -> None:
    table = Table(title=escape(f"{result.model} ({result.task}) — {machine_title(result.machine)}"), title_justify="left")
    for col in ("phase", "batch", "tokens", "backend", "matrix engine", "median ms", "p95 ms", "tokens/s", "speed-up"):
        table.add_column(col, justify="left" if col in ("phase", "backend", "matrix engine") else "right")
    previous = None
    for c in sorted(result.cells, key=lambda c: (c.phase != "prefill", c.batch, c.tokens)):
        key = (c.phase, c.batch, c.tokens)
        if previous is not None and key != previous:
            table.add_section()
        previous = key
        table.add_row(c.phase, str(c.batch), str(c.tokens), c.backend, escape(c.matrix_engine), f"{c.stats.median:.2f}", f"{c.stats.p95:.2f}",
                      f"{c.tokens_per_s:,.1f}", f"{c.speedup:.2f}×" if c.speedup else "—")
    console.print(table)
    console.print("[dim]prefill: one prompt of `tokens` tokens; decode: one step of `batch` sequences, each with a past of "
                  f"`tokens` tokens, {_drawing(result)} (ms per step = ms per token of each sequence); speed-up against "
                  "pytorch in this run[/]")
    past = result.config.past
    for phase, batch, tokens, label in (("decode", 1, past, "decode batch 1"), ("prefill", 1, max(result.config.prompt_lengths), "prefill")):
        parts = [f"{against}: {r:.2f}×" for against in ("pytorch", "llama.cpp", "onnxruntime-genai")
                 if (r := best_ratio(result, phase, batch, tokens, against)) is not None]
        if parts:
            console.print(f"fastest variant, {label} ({tokens} tokens) tokens/s against " + ", ".join(parts))
    for note in result.notes:
        # escaped: a note may carry an install hint, and rich would take "[llamacpp]" for a markup tag
        console.print(f"[yellow]note:[/] {escape(note)}", soft_wrap=True)  # one line, e.g. a command to copy


def _drawing(result: GenerationBenchResult) -> str:
    """How the decode cells chose their tokens."""
    if not result.config.sampled:
        return "greedy"
    from ..loadtest.streaming import SAMPLED

    return (f"sampled (temperature {SAMPLED['temperature']}, top_p {SAMPLED['top_p']}, a seed per sequence; "
            "llama.cpp: its model alone)")


def generation_bench_dict(result: GenerationBenchResult) -> dict:
    return {"model": result.model, "task": result.task, "machine": result.machine, "config": asdict(result.config),
            "notes": result.notes,
            "cells": [{"backend": c.backend, "matrix_engine": c.matrix_engine, "phase": c.phase, "batch": c.batch,
                       "tokens": c.tokens, **asdict(c.stats),
                       "tokens_per_s": c.tokens_per_s, "speedup": c.speedup} for c in result.cells]}


def write_generation_json(path: Path, result: GenerationBenchResult) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(generation_bench_dict(result), indent=2) + "\n")


def print_generation_scores(console: Console, scores: list[GenerationScore]) -> None:
    if not scores:
        return
    s0 = scores[0]
    table = Table(title=f"Perplexity on {s0.paragraphs} SQuAD paragraphs; SQuAD answered by generation "
                        f"({s0.questions} questions, greedy, chat template)", title_justify="left")
    for col in ("backend", "perplexity", "Δ vs pytorch", "exact match", "F1"):
        table.add_column(col, justify="left" if col == "backend" else "right")
    for s in scores:
        delta = "—" if s.perplexity_delta is None or s.backend.startswith("pytorch") else f"{100 * s.perplexity_delta:+.2f}%"
        table.add_row(s.backend, f"{s.perplexity:.3f}", delta, f"{s.exact_match:.1f}", f"{s.f1:.1f}")
    console.print(table)
