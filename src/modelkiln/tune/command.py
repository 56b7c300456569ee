"""``kiln tune``: the command function; cli.py registers it. Heavy imports stay inside."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer


def tune(
    artifact: Path = typer.Argument(..., help="An artifact folder written by `kiln convert`."),
    p99_ms: Optional[float] = typer.Option(None, "--p99-ms", help="Latency budget: rank by the best throughput whose p99 stays below this."),
    out: Path = typer.Option(Path("kiln-serve.json"), "--out", "-o", help="Config file to write (for `kiln serve --config`)."),
    variants: Optional[str] = typer.Option(None, help="Variants to try (default: every kept CPU variant)."),
    instances: str = typer.Option("1,2", help="Engine instances per model to try (kiln serve --instances); 0 = the server's default."),
    threads: str = typer.Option("0", help="Intra-op threads per instance to try; 0 = the server's default (cores / instances)."),
    max_batch_size: str = typer.Option("32", help="Max batch sizes to try."),
    max_batch_tokens: str = typer.Option("0", help="Token budgets per batch to try; 0 = the server's default."),
    max_queue_delay_ms: str = typer.Option("0,2", help="Queue delays (ms) to try."),
    max_padding: str = typer.Option("auto", help="Padding limits to try (kiln serve --max-padding); auto = the server's default."),
    alone_threads: str = typer.Option("auto", help="Threads for a lone request to try (kiln serve --alone-threads; 0 = off); auto = the server's default."),
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
    from ..option_lists import number_list, split_list
    from .report import print_ranking, write_best, write_json
    from .sweep import Grid, run_sweep

    if not is_artifact(artifact):
        raise KilnError(f"{artifact} is not an artifact folder (run `kiln convert` first)")
    manifest = Manifest.load(artifact)
    kept = [v.name for v in manifest.kept_variants() if v.device == "cpu"]
    chosen = split_list(variants) if variants else kept
    for v in chosen:
        manifest.variant(v)  # fails early, listing the kept ones
    grid = Grid(variants=tuple(chosen), instances=tuple(i or None for i in number_list(instances, "--instances")),
                threads=tuple(t or None for t in number_list(threads, "--threads")),
                max_batch_size=tuple(number_list(max_batch_size, "--max-batch-size")),
                max_batch_tokens=tuple(b or None for b in number_list(max_batch_tokens, "--max-batch-tokens")),
                max_queue_delay_ms=tuple(number_list(max_queue_delay_ms, "--max-queue-delay-ms", float)),
                max_padding=tuple(number_list(max_padding, "--max-padding", float, auto=True)),
                alone_threads=tuple(number_list(alone_threads, "--alone-threads", int, auto=True)))
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
