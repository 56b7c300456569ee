"""The ranking table (like Model Analyzer's summary), the JSON of every trial, and the best config;
for text generation, the table of every configuration with the limits each breaks."""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..loadtest.api import LoadtestOptions
from ..loadtest.report import record
from ..serve.config_file import write_serve_config
from .generation import GenerationTrial, Limits, ranked
from .sweep import Trial, TuneResult, sweepable_flags


def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _cell(name: str, settings: dict[str, Any]) -> str:
    """A setting's value in a table: None is the server's default (``auto`` where that is worked
    out at start, else the declared default); ``-`` where it has no effect beside the others."""
    from ..serve.settings import ServeSettings, applies

    if not applies(name, settings):
        return "-"
    value = settings.get(name)
    if value is None:
        value = ServeSettings.model_fields[name].default
        if value is None:
            return "auto"
    return value if isinstance(value, str) else f"{value:g}"


def print_ranking(console: Any, result: TuneResult) -> None:
    from rich.table import Table

    budget = f"p99 ≤ {result.p99_budget_ms:g} ms" if result.p99_budget_ms is not None else "no p99 budget"
    trials = result.ranked()
    # A column per setting whose value differs between trials, as the declaration lists them; the others, the
    # same in every trial, on one line under the table (eighteen columns would squeeze the variants' names).
    settings = list(sweepable_flags("encoder"))
    swept = [n for n in settings if len({_cell(n, t.settings) for t in trials}) > 1]
    same = [f"{n.replace('_', ' ')} {_cell(n, trials[0].settings)}" for n in settings if n not in swept] if trials else []
    table = Table(title=f"kiln tune {result.model} ({budget}), best first", title_justify="left",
                  caption=f"the same in every trial: {', '.join(same)}" if same else None, caption_justify="left")
    for name in ("#", *(n.replace("_", " ") for n in swept),
                 "best load", "req/s", "inputs/s", "p50 ms", "p99 ms", "server batch", "peak RSS MB", "budget"):
        table.add_column(name, justify="right", no_wrap=name == "variant")
    for rank, t in enumerate(trials, 1):
        s = t.settings
        b = t.best
        status = t.error[:40] if t.error else ("ok" if t.within_budget else "over")
        table.add_row(str(rank), *(_cell(name, s) for name in swept), b.load.label if b else "-",
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


# --- text generation --------------------------------------------------------------------------


def serve_command(artifact: str, settings: dict[str, Any]) -> str:
    """The ``kiln serve`` command line that runs these settings (None: the server's default, left out)."""
    flags = sweepable_flags()
    return " ".join(["kiln serve", shlex.quote(artifact),
                     *(f"{flags[k]} {shlex.quote(str(v))}" for k, v in settings.items() if v is not None)])


def describe_limits(limits: Limits) -> str:
    ttft = f"TTFT p99 ≤ {limits.ttft_p99_ms:g} ms" if limits.ttft_p99_ms is not None else "no TTFT limit"
    ppl = (f"perplexity ≤ +{limits.max_ppl_increase * 100:g}% vs PyTorch" if limits.max_ppl_increase is not None
           else "no accuracy limit")
    return f"{ttft}, {ppl}"


def describe_load(load: LoadtestOptions) -> str:
    return (f"{load.protocol}, {load.loads[0].label}, {load.max_tokens} tokens per answer, "
            f"{load.max_inputs} prompts from {load.inputs}, --check")


def print_generation_table(console: Any, model: str, trials: list[GenerationTrial], limits: Limits,
                           load: LoadtestOptions) -> None:
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=escape(f"kiln tune {model} ({describe_limits(limits)}; {describe_load(load)}), best first"),
                  title_justify="left")
    # a column per setting some configuration sets: the speculation settings, swept only when
    # asked, would otherwise be three columns of defaults in every run
    swept = [name for name in sweepable_flags("generation") if any(t.settings.get(name) is not None for t in trials)]
    for name in ("#", *(n.replace("_", " ") for n in swept), "out tok/s", "TTFT p50 ms", "TTFT p99 ms",
                 "ITL p50 ms", "failed", "changed", "ppl Δ", "peak RSS MB"):
        table.add_column(name, justify="right")
    table.add_column("verdict")
    for rank, t in enumerate(ranked(trials), 1):
        changed = f"{t.changed}/{t.checked}" if t.changed is not None else "-"
        ppl = f"{t.perplexity_change * 100:+.2f}%" if t.perplexity_change is not None else "-"
        verdict = "[bold green]◀ chosen[/]" if t.chosen else (
            f"[yellow]excluded:[/] {escape('; '.join(t.excluded))}" if t.excluded else "ok")
        table.add_row(str(rank), *(_cell(name, t.settings) for name in swept), _f(t.output_tokens_per_s),
                      _f(t.ttft_p50_ms), _f(t.ttft_p99_ms), _f(t.itl_p50_ms),
                      str(sum(t.failures.values())) if t.step else "-", changed, ppl, _f(t.peak_rss_mb, 0), verdict)
    console.print(table)


def _generation_record(t: GenerationTrial) -> dict[str, Any]:
    return {"settings": t.settings, "chosen": t.chosen, "excluded": t.excluded, "error": t.error,
            "perplexity_change": t.perplexity_change, "output_tokens_per_s": t.output_tokens_per_s,
            "ttft_p50_ms": t.ttft_p50_ms, "ttft_p99_ms": t.ttft_p99_ms, "itl_p50_ms": t.itl_p50_ms,
            "failed_requests": t.failures, "changed_answers": t.changed, "checked_answers": t.checked,
            "peak_rss_mb": t.peak_rss_mb, "run": record(t.run) if t.run is not None else None}


def write_generation_json(path: Path, artifact: str, model: str, trials: list[GenerationTrial], limits: Limits,
                          load: LoadtestOptions) -> None:
    chosen = next((t for t in trials if t.chosen), None)
    data = {"kind": "generation", "artifact": artifact, "model": model, "limits": asdict(limits),
            "load": {"protocol": load.protocol, "concurrency": int(load.loads[0].value), "max_tokens": load.max_tokens,
                     "ignore_eos": load.ignore_eos, "inputs": load.inputs, "prompts": load.max_inputs,
                     "check": load.check},
            "chosen": chosen.settings if chosen else None,
            "serve_command": serve_command(artifact, chosen.settings) if chosen else None,
            "configurations": [{"rank": i, **_generation_record(t)} for i, t in enumerate(ranked(trials), 1)]}
    Path(path).write_text(json.dumps(data, indent=2), encoding="utf-8")


def write_generation_config(path: Path, artifact: str, trial: GenerationTrial, limits: Limits) -> None:
    notes = {"tuned_by": "kiln tune", "artifact": artifact, "limits": asdict(limits),
             "measured": {"output_tokens_per_s": round(trial.output_tokens_per_s or 0.0, 2),
                          "ttft_p99_ms": round(trial.ttft_p99_ms or 0.0, 1),
                          "perplexity_change": trial.perplexity_change}}
    write_serve_config(path, {k: v for k, v in trial.settings.items() if v is not None}, notes)
