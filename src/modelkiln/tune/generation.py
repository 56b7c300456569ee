"""``kiln tune`` for a text-generation artifact. Each configuration (variant × max running
sequences × step token budget: the settings ``serve/settings.py`` marks sweepable for generation)
runs in a fresh ``kiln serve``, driven by streams at one concurrency with fixed-length answers and
``--check`` on. The choice is the highest output tokens/s among the configurations that meet every
limit:

- no failed request and no changed answer (``--check``: an answer under load unlike the answer
  the same server gave the same prompt alone) in the whole step, warm-up included;
- TTFT p99 within ``--ttft-p99-ms``;
- the variant's perplexity change against PyTorch, as the conversion gate recorded it in the
  manifest (``details.perplexity_change``), within ``--max-ppl-increase``.

A configuration that breaks one stays in the table with its reasons, as Model Analyzer shows the
configurations that fail its constraints."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import KilnError
from ..loadtest.api import LoadtestOptions
from ..loadtest.runner import RunResult, StepResult
from ..manifest import Manifest
from .sweep import Grid, serve_and_load


@dataclass(frozen=True)
class Limits:
    ttft_p99_ms: float | None = None
    max_ppl_increase: float | None = None  # a fraction: 0.01 is 1%


@dataclass
class GenerationTrial:
    settings: dict[str, Any]
    perplexity_change: float | None  # the variant's, as the gate recorded it (None: not recorded)
    run: RunResult | None = None
    peak_rss_mb: float | None = None
    error: str | None = None  # the server did not start, or the load test failed
    excluded: list[str] = field(default_factory=list)  # the limits it breaks, in words
    chosen: bool = False

    @property
    def step(self) -> StepResult | None:
        return self.run.steps[0] if self.run is not None and self.run.steps else None

    def _generation(self, name: str, percentile: str) -> float | None:
        g = self.step.generation if self.step is not None else None
        latency = getattr(g, name) if g is not None else None
        return getattr(latency, percentile) if latency is not None else None

    @property
    def output_tokens_per_s(self) -> float | None:
        step = self.step
        return step.generation.output_tokens_per_s if step is not None and step.generation is not None else None

    @property
    def ttft_p50_ms(self) -> float | None:
        return self._generation("ttft", "p50")

    @property
    def ttft_p99_ms(self) -> float | None:
        return self._generation("ttft", "p99")

    @property
    def itl_p50_ms(self) -> float | None:
        return self._generation("itl", "p50")

    @property
    def failures(self) -> dict[str, int]:
        """Requests of the whole step (warm-up included) that did not end well, by status."""
        step = self.step
        if step is None:
            return {}
        return {status: n for status, n in step.answered.items() if not (status.isdigit() and 200 <= int(status) < 300)}

    @property
    def changed(self) -> int | None:
        return self.step.mismatches if self.step is not None else None

    @property
    def checked(self) -> int | None:
        return self.step.checked if self.step is not None else None


def limit_reasons(trial: GenerationTrial, limits: Limits) -> list[str]:
    """Why ``trial`` cannot be chosen (empty: it can)."""
    if trial.error is not None:
        return [trial.error]
    if trial.ttft_p99_ms is None or not trial.output_tokens_per_s:
        return ["no stream ended in the measured windows"]
    reasons = []
    if trial.failures:
        kinds = ", ".join(f"{status}: {n}" for status, n in sorted(trial.failures.items()))
        reasons.append(f"{sum(trial.failures.values())} failed requests ({kinds})")
    if trial.changed:
        reasons.append(f"{trial.changed}/{trial.checked} answers changed under load")
    if limits.ttft_p99_ms is not None and trial.ttft_p99_ms > limits.ttft_p99_ms:
        reasons.append(f"TTFT p99 {trial.ttft_p99_ms:.1f} ms > {limits.ttft_p99_ms:g} ms")
    if limits.max_ppl_increase is not None:
        if trial.perplexity_change is None:
            reasons.append("no perplexity recorded by the gate")
        elif trial.perplexity_change > limits.max_ppl_increase:
            reasons.append(f"perplexity {trial.perplexity_change * 100:+.2f}% > {limits.max_ppl_increase * 100:g}%")
    return reasons


def choose(trials: list[GenerationTrial]) -> GenerationTrial | None:
    """The highest output tokens/s among the trials within every limit (marked ``chosen``)."""
    within = [t for t in trials if not t.excluded]
    if not within:
        return None
    best = max(within, key=lambda t: t.output_tokens_per_s or 0.0)
    best.chosen = True
    return best


def ranked(trials: list[GenerationTrial]) -> list[GenerationTrial]:
    """The chosen one first, then the others within the limits, then the excluded; each by output tokens/s."""
    return sorted(trials, key=lambda t: (not t.chosen, bool(t.excluded), -(t.output_tokens_per_s or 0.0)))


def run_generation_sweep(artifact: Path, manifest: Manifest, grid: Grid, load: LoadtestOptions, limits: Limits,
                         on_trial: Callable[[int, int, GenerationTrial], None] | None = None,
                         start_timeout: float = 120.0) -> list[GenerationTrial]:
    """``load``: one generation load step with ``check`` on, run on each configuration's server."""
    if not load.generation or not load.check or len(load.loads) != 1:
        raise KilnError("a generation sweep runs one load step of a generation protocol with --check")
    combos = grid.combinations()
    trials = []
    for i, settings in enumerate(combos, 1):
        variant = manifest.variant(settings["variant"])
        trial = GenerationTrial(settings, variant.details.get("perplexity_change"))
        trial.run, trial.peak_rss_mb, trial.error = serve_and_load(artifact, settings, load, start_timeout)
        trial.excluded = limit_reasons(trial, limits)
        trials.append(trial)
        if on_trial is not None:
            on_trial(i, len(combos), trial)
    choose(trials)
    return trials


def parse_fraction(text: str, option: str) -> float:
    """``"1%"`` or ``"0.01"`` → 0.01. A bare number of 1 or more is refused: 1 could mean 1% or 100%."""
    value = text.strip()
    try:
        number = float(value[:-1]) / 100 if value.endswith("%") else float(value)
    except ValueError:
        raise KilnError(f"{option} takes a percentage (1%) or a fraction (0.01), got '{text}'") from None
    if number < 0 or (not value.endswith("%") and number >= 1):
        raise KilnError(f"{option} takes a percentage (1%) or a fraction below 1 (0.01), got '{text}'")
    return number
