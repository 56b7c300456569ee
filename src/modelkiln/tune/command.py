"""``kiln tune``: the command function; cli.py registers it. Heavy imports stay inside."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import typer

from ..derived_options import DERIVED, DerivedOptionsCommand, keyword, typer_params


def tune(
    ctx: typer.Context,
    artifact: Path = typer.Argument(..., help="An artifact folder written by `kiln convert`."),
    p99_ms: Optional[float] = typer.Option(None, "--p99-ms", help="Latency budget: rank by the best throughput whose p99 stays below this."),
    out: Path = typer.Option(Path("kiln-serve.json"), "--out", "-o", help="Config file to write (for `kiln serve --config`)."),
    variants: Optional[str] = typer.Option(None, help="Variants to try (default: every kept CPU variant)."),
    # here TuneCommand adds one option per numeric setting the declaration marks sweepable
    concurrency: str = typer.Option("1:32:x2", help="Closed-loop load per combination (stops once p99 exceeds the budget)."),
    protocol: str = typer.Option("oip-json", help="oip-json | oip-binary | task."),
    inputs: str = typer.Option("samples", help="samples | sts | squad | a text file."),
    length: str = typer.Option("all", help="all | short | long."),
    batch: int = typer.Option(1, help="Inputs per request."),
    warmup: float = typer.Option(0.5, help="Warm-up seconds per load step."),
    window: float = typer.Option(1.0, help="Seconds per measurement window."),
    max_windows: int = typer.Option(5, help="Windows per step at most."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write every trial's results."),
    plot_path: Optional[Path] = typer.Option(None, "--plot", help="Latency vs throughput, one curve per combination."),
) -> None:
    """Start `kiln serve` with each combination of settings, load-test each, rank them against a
    p99 budget (throughput, p99, memory) and write the best as a `kiln serve --config` file."""
    from rich.console import Console
    from rich.markup import escape

    from ..errors import KilnError
    from ..loadtest.api import LoadtestOptions
    from ..loadtest.runner import Load, parse_levels
    from ..manifest import Manifest, is_artifact
    from ..option_lists import split_list
    from ..serve.settings import cli_flag, sweep_default, sweepable
    from .report import print_ranking, write_best, write_json
    from .sweep import Grid, run_sweep

    if not is_artifact(artifact):
        raise KilnError(f"{artifact} is not an artifact folder (run `kiln convert` first)")
    manifest = Manifest.load(artifact)
    kept = [v.name for v in manifest.kept_variants() if v.device == "cpu"]
    chosen = split_list(variants) if variants else kept
    for v in chosen:
        manifest.variant(v)  # fails early, listing the kept ones
    given = {name: raw for name, raw in ctx.meta.get(DERIVED, {}).items() if raw is not None}
    other = [cli_flag(name) for name in given if name not in sweepable("encoder")]
    if other:
        raise KilnError(f"{', '.join(other)}: not swept for encoder models")
    values = {name: sweep_values(name, given.get(name) or sweep_default(name, "encoder"))
              for name in swept_numbers("encoder")}
    grid = Grid({"variant": tuple(chosen), **values}, "encoder")
    loads = tuple(Load("concurrency", float(int(v))) for v in parse_levels(concurrency, "--concurrency"))
    load = LoadtestOptions(url="", model=manifest.name, loads=loads, protocol=protocol, inputs=inputs, length=length,
                           batch=batch, warmup_s=warmup, window_s=window, max_windows=max_windows)
    # Wide enough for the ranking table when the output goes to a file or a pipe.
    err = Console(stderr=True, width=None if sys.stderr.isatty() else 200)
    out_console = Console(width=None if sys.stdout.isatty() else 200)
    total = len(grid.combinations())
    err.print(f"tuning {escape(manifest.name)}: {total} combinations × up to {len(loads)} load steps")

    def on_trial(i, n, trial) -> None:  # type: ignore[no-untyped-def]
        settings = ", ".join(f"{k}={v}" for k, v in trial.settings.items() if v is not None)  # None: the default
        if trial.error:
            err.print(f"[red]✗[/] {i}/{n} {escape(str(settings))}: {escape(str(trial.error))}")
        else:
            p99 = f"{trial.p99_ms:.1f} ms" if trial.p99_ms is not None else "-"
            err.print(f"[green]✓[/] {i}/{n} {settings}: {trial.throughput:.1f} req/s at p99 {p99}"
                      f"{'' if trial.within_budget else ' [yellow](over budget)[/]'}")

    result = run_sweep(artifact, grid, load, p99_ms, on_trial=on_trial)
    print_ranking(out_console, result)
    best = result.best()
    if json_path:
        write_json(json_path, result)
        out_console.print(f"Wrote {json_path}", markup=False)
    if plot_path:
        from ..loadtest.plot import plot

        plot([t.run for t in result.ranked() if t.run is not None], plot_path, "p99",
             title=f"kiln tune {manifest.name}: p99 latency vs throughput")
        out_console.print(f"Wrote {plot_path}", markup=False)
    if best is None:
        raise KilnError("no combination served successfully; nothing written")
    write_best(out, result, best)
    note = "" if best.within_budget else " [yellow](no combination met the p99 budget: this is the lowest-p99 one)[/]"
    out_console.print(f"Wrote [bold]{escape(str(out))}[/]: kiln serve {escape(str(artifact))} --config {escape(str(out))}{note}")


class TuneCommand(DerivedOptionsCommand):
    """``kiln tune``: its own options plus, for each numeric setting that the ServeSettings
    declaration marks sweepable, ``--<its kiln serve flag> VALUES``; its help gives the values
    declared for each kind of model, tried when the option is not given."""

    insert_before = "concurrency"

    def derive(self) -> list[Any]:
        from ..serve.settings import MODEL_KINDS, ServeSettings, cli_flag, sweep_default

        params = []
        for name in swept_numbers():
            flag = cli_flag(name)
            field = ServeSettings.model_fields[name]
            auto = "; auto = the server's default" if field.default is None else ""
            kinds = {KIND_NAMES[k]: sweep_default(name, k) for k in MODEL_KINDS if sweep_default(name, k) is not None}
            if len(kinds) == 1:
                default = "{1}; {0} only".format(*next(iter(kinds.items())))
            elif len(set(kinds.values())) == 1:
                default = next(iter(kinds.values()))
            else:
                default = ", ".join(f"{values} for {kind}" for kind, values in kinds.items())
            help = f"{field.description} Values to try (kiln serve {flag}), comma-separated{auto}. Default: {default}."
            params.append(keyword(name, Optional[str], typer.Option(None, flag, help=help, show_default=False)))
        return typer_params(params)


KIND_NAMES = {"encoder": "encoders", "generation": "text generation"}


def swept_numbers(kind: Optional[str] = None) -> list[str]:
    """The numeric settings kiln tune sweeps (each its own option) for ``kind`` (None: any); the
    variant, a string, is ``--variants``."""
    from ..serve.settings import sweepable, value_type

    return [name for name in sweepable(kind) if value_type(name) in (int, float)]


def sweep_values(name: str, text: str) -> tuple[Any, ...]:
    """``"1,2"`` → (1, 2) for the setting ``name``, typed as declared; ``auto`` → None (the
    server's default). For settings whose default is None and that cannot be 0 (instances,
    threads, max_batch_tokens), 0 also means the server's default, as it always did here."""
    from pydantic import ValidationError

    from ..option_lists import number_list
    from ..serve.settings import ServeSettings, cli_flag, value_type

    optional = ServeSettings.model_fields[name].default is None
    values = number_list(text, cli_flag(name), value_type(name), auto=optional)
    if optional:
        try:
            ServeSettings.model_validate({name: 0})
        except ValidationError:
            values = [None if v == 0 else v for v in values]
    return tuple(values)
