"""``kiln tune``: the command function; cli.py registers it. Heavy imports stay inside."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import typer

from ..derived_options import DERIVED, DerivedOptionsCommand, keyword, typer_params
from ..model_arg import PRECISION, TASK, artifact_path


# What a load step is unless told, per kind of model. Generation requests last seconds: each step waits for
# `concurrency` of them to end before measuring (docs/loadtest-generation.md), and --check first takes every
# prompt's answer alone, so a configuration takes minutes.
LOAD_DEFAULTS: dict[str, dict[str, Any]] = {
    "encoder": {"concurrency": "1:32:x2", "protocol": "oip-json", "inputs": "samples", "warmup": 0.5, "window": 1.0,
                "max_windows": 5},
    "generation": {"concurrency": "16", "protocol": "openai-chat", "inputs": "sts", "warmup": 3.0, "window": 8.0,
                   "max_windows": 3, "max_inputs": 16, "max_tokens": 128},
}
E, G = LOAD_DEFAULTS["encoder"], LOAD_DEFAULTS["generation"]  # for the help below


def tune(
    ctx: typer.Context,
    model: str = typer.Argument(..., metavar="MODEL", help="An artifact folder written by `kiln convert`, or a model (a .gguf file, a Hugging Face folder or hub id: converted once into the model cache)."),
    p99_ms: Optional[float] = typer.Option(None, "--p99-ms", help="Encoders: latency budget; rank by the best throughput whose p99 stays below this."),
    ttft_p99_ms: Optional[float] = typer.Option(None, "--ttft-p99-ms", help="Text generation: exclude configurations whose time to first token p99 is above this."),
    max_ppl_increase: Optional[str] = typer.Option(None, "--max-ppl-increase", help="Text generation: exclude variants whose perplexity, as the conversion gate measured it, is more than this above PyTorch's (1% or 0.01)."),
    out: Path = typer.Option(Path("kiln-serve.json"), "--out", "-o", help="Config file to write (for `kiln serve --config`)."),
    variants: Optional[str] = typer.Option(None, help="Variants to try (default: every kept CPU variant)."),
    # here TuneCommand adds one option per setting the declaration marks sweepable (but the variant)
    concurrency: Optional[str] = typer.Option(None, help=f"Closed-loop load per combination. Encoders: levels (default {E['concurrency']}; stops once p99 exceeds the budget); text generation: one level (default {G['concurrency']})."),
    protocol: Optional[str] = typer.Option(None, help=f"Encoders: oip-json | oip-binary | task (default {E['protocol']}). Text generation: openai-chat | openai-completions | generate (default {G['protocol']})."),
    inputs: Optional[str] = typer.Option(None, help=f"samples | sts | squad | a text file (default {E['inputs']}; text generation {G['inputs']}, each text the user message of a chat)."),
    length: str = typer.Option("all", help="all | short | long."),
    batch: int = typer.Option(1, help="Encoders: inputs per request."),
    max_tokens: Optional[int] = typer.Option(None, help=f"Text generation: tokens per answer, every answer this long (default {G['max_tokens']})."),
    max_inputs: Optional[int] = typer.Option(None, help=f"Distinct inputs (default all; text generation: {G['max_inputs']} prompts, each answered alone first by --check)."),
    warmup: Optional[float] = typer.Option(None, help=f"Warm-up seconds per load step (default {E['warmup']:g}; text generation {G['warmup']:g}, and until each client has had an answer)."),
    window: Optional[float] = typer.Option(None, help=f"Seconds per measurement window (default {E['window']:g}; text generation {G['window']:g}, longer when answers take longer)."),
    max_windows: Optional[int] = typer.Option(None, help=f"Windows per step at most (default {E['max_windows']}; text generation {G['max_windows']})."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write every trial's results."),
    plot_path: Optional[Path] = typer.Option(None, "--plot", help="Encoders: latency vs throughput, one curve per combination."),
    task: Optional[str] = TASK,
    precision: Optional[str] = PRECISION,
) -> None:
    """Start `kiln serve` with each combination of settings, load-test each, and write the best as
    a `kiln serve --config` file.

    Encoders: rank by throughput within a p99 budget (--p99-ms). Text generation: sweep the
    variant, --max-batch-size (sequences running together) and --prefill-chunk (prompt tokens per
    scheduler step), and --speculate / --draft-tokens when given; drive each configuration with
    --concurrency streams of --max-tokens answers under `kiln loadtest --check`, and pick the
    best output tokens/s among those with no failed request, no changed answer, TTFT p99 within
    --ttft-p99-ms and the variant's perplexity change (the conversion gate's) within
    --max-ppl-increase. A generation configuration takes minutes
    (SmolLM2-135M, 2 shared cores, the defaults: 2 to 4 minutes, --check's answers alone
    included), so the default grid is small: every kept variant × the --max-batch-size and
    --prefill-chunk values below. Details: docs/tune.md."""
    from ..errors import KilnError
    from ..manifest import Manifest, is_artifact
    from ..option_lists import split_list
    from ..serve.settings import applies, cli_flag, sweep_default, sweepable, used_with
    from ..tasks.text_generation import is_generation
    from .sweep import Grid

    artifact = artifact_path(model, task, precision)
    if not is_artifact(artifact):
        raise KilnError(f"{artifact} is not an artifact folder (run `kiln convert` first)")
    manifest = Manifest.load(artifact)
    kind = "generation" if is_generation(manifest) else "encoder"
    kept = [v.name for v in manifest.kept_variants() if v.device == "cpu"]
    chosen = (split_list(variants) or []) if variants else kept  # split_list's None: an empty string only
    for v in chosen:
        manifest.variant(v)  # fails early, listing the kept ones
    given = {name: raw for name, raw in ctx.meta.get(DERIVED, {}).items() if raw is not None}
    other = [cli_flag(name) for name in given if name not in sweepable(kind)]
    if other:
        raise KilnError(f"{', '.join(other)}: not swept for {kind} models "
                        f"(kiln tune sweeps {', '.join(cli_flag(n) for n in sweepable(kind))} for them)")
    values = {}
    for name in swept_options(kind):
        text = given.get(name) or sweep_default(name, kind)
        assert text is not None  # swept_options(kind): the settings with values to try for this kind
        values[name] = sweep_values(name, text)
    grid = Grid({"variant": tuple(chosen), **values}, kind)
    combos = grid.combinations()  # checks every one, before any server starts
    unused = [name for name in given if not any(applies(name, c) for c in combos)]
    if unused:  # given, yet every configuration would leave it out: say what it needs
        raise KilnError("; ".join(f"{cli_flag(name)} is used only with "
                                  + " and ".join(f"{cli_flag(o)} {' or '.join(v)}" for o, v in used_with(name).items())
                                  + ", which no configuration runs" for name in unused))
    defaults = LOAD_DEFAULTS[kind]
    options: dict[str, Any]  # the load options both sweeps take, as keywords
    options = dict(concurrency=concurrency or defaults["concurrency"], protocol=protocol or defaults["protocol"],
                   inputs=inputs or defaults["inputs"], length=length, warmup=defaults["warmup"] if warmup is None else warmup,
                   window=defaults["window"] if window is None else window,
                   max_windows=max_windows or defaults["max_windows"], json_path=json_path)
    if kind == "generation":
        wrong = [name for name, value in (("--p99-ms", p99_ms), ("--plot", plot_path), ("--batch", batch if batch != 1 else None))
                 if value is not None]
        if wrong:
            raise KilnError(f"{', '.join(wrong)}: for encoders; text generation takes --ttft-p99-ms and --max-ppl-increase")
        _tune_generation(artifact, manifest, grid, out, ttft_p99_ms, max_ppl_increase,
                         max_tokens=max_tokens or defaults["max_tokens"],
                         max_inputs=max_inputs or defaults["max_inputs"], **options)
    else:
        wrong = [name for name, value in (("--ttft-p99-ms", ttft_p99_ms), ("--max-ppl-increase", max_ppl_increase),
                                          ("--max-tokens", max_tokens)) if value is not None]
        if wrong:
            raise KilnError(f"{', '.join(wrong)}: for text generation; encoders take --p99-ms")
        _tune_encoder(artifact, manifest, grid, out, p99_ms, batch=batch, max_inputs=max_inputs, plot_path=plot_path,
                      **options)


def _consoles() -> tuple[Any, Any]:
    """(progress on stderr, results on stdout), wide enough for the tables in a file or a pipe."""
    from rich.console import Console

    return (Console(stderr=True, width=None if sys.stderr.isatty() else 200),
            Console(width=None if sys.stdout.isatty() else 200))


def _check_protocol(protocol: str, generation: bool) -> None:
    from ..errors import KilnError
    from ..loadtest.protocols import GENERATION_PROTOCOLS, PROTOCOLS

    allowed = GENERATION_PROTOCOLS if generation else tuple(p for p in PROTOCOLS if p != "grpc")
    if protocol not in allowed:
        raise KilnError(f"--protocol for {'a text-generation' if generation else 'an encoder'} artifact: "
                        f"{' | '.join(allowed)}; got '{protocol}'")


def _tune_encoder(artifact: Path, manifest: Any, grid: Any, out: Path, p99_ms: Optional[float], *, concurrency: str,
                  protocol: str, inputs: str, length: str, batch: int, max_inputs: Optional[int], warmup: float,
                  window: float, max_windows: int, json_path: Optional[Path], plot_path: Optional[Path]) -> None:
    from rich.markup import escape

    from ..errors import KilnError
    from ..loadtest.api import LoadtestOptions
    from ..loadtest.runner import Load, parse_levels
    from .report import print_ranking, write_best, write_json
    from .sweep import Trial, run_sweep

    _check_protocol(protocol, generation=False)
    loads = tuple(Load("concurrency", float(int(v))) for v in parse_levels(concurrency, "--concurrency"))
    load = LoadtestOptions(url="", model=manifest.name, loads=loads, protocol=protocol, inputs=inputs, length=length,
                           batch=batch, max_inputs=max_inputs, warmup_s=warmup, window_s=window, max_windows=max_windows)
    err, out_console = _consoles()
    total = len(grid.combinations())
    err.print(f"tuning {escape(manifest.name)}: {total} combinations × up to {len(loads)} load steps")

    def on_trial(i: int, n: int, trial: Trial) -> None:
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


def _tune_generation(artifact: Path, manifest: Any, grid: Any, out: Path, ttft_p99_ms: Optional[float],
                     max_ppl_increase: Optional[str], *, concurrency: str, protocol: str, inputs: str, length: str,
                     max_tokens: int, max_inputs: int, warmup: float, window: float, max_windows: int,
                     json_path: Optional[Path]) -> None:
    from rich.markup import escape

    from ..errors import KilnError
    from ..generation.speculation import MAX_ROWS
    from ..loadtest.api import LoadtestOptions
    from ..loadtest.runner import Load, parse_levels
    from .generation import GenerationTrial, Limits, parse_fraction, run_generation_sweep
    from .report import describe_limits, print_generation_table, serve_command, write_generation_config, write_generation_json

    _check_protocol(protocol, generation=True)
    levels = parse_levels(concurrency, "--concurrency")
    if len(levels) != 1:
        raise KilnError(f"--concurrency takes one level for text generation (every configuration is measured at it), "
                        f"got '{concurrency}'")
    limits = Limits(ttft_p99_ms, parse_fraction(max_ppl_increase, "--max-ppl-increase") if max_ppl_increase else None)
    load = LoadtestOptions(url="", model=manifest.name, loads=(Load("concurrency", float(int(levels[0]))),),
                           protocol=protocol, inputs=inputs, length=length, max_inputs=max_inputs,
                           max_tokens=max_tokens, ignore_eos=True, check=True, warmup_s=warmup, window_s=window,
                           stable_windows=2, max_windows=max(2, max_windows), timeout_s=300.0)
    err, out_console = _consoles()
    combos = grid.combinations()
    total = len(combos)
    err.print(f"tuning {escape(manifest.name)}: {total} configuration{'s' if total != 1 else ''} ({escape(describe_limits(limits))}); "
              f"each first answers its {max_inputs} prompts alone (--check), then runs {load.loads[0].label}")
    if int(levels[0]) > MAX_ROWS and any(c["speculate"] not in (None, "off") for c in combos):
        err.print(f"[yellow]note:[/] speculation drafts only while at most {MAX_ROWS} streams decode: at --concurrency "
                  f"{int(levels[0])} its configurations measure mostly plain decoding")

    def on_trial(i: int, n: int, trial: GenerationTrial) -> None:
        settings = escape(", ".join(f"{k}={v}" for k, v in trial.settings.items() if v is not None))
        if trial.error:
            err.print(f"[red]✗[/] {i}/{n} {settings}: {escape(trial.error)}")
            return
        ttft = f"{trial.ttft_p99_ms:.0f} ms" if trial.ttft_p99_ms is not None else "-"
        excluded = f" [yellow](excluded: {escape('; '.join(trial.excluded))})[/]" if trial.excluded else ""
        err.print(f"[green]✓[/] {i}/{n} {settings}: {trial.output_tokens_per_s or 0:.1f} output tokens/s, "
                  f"TTFT p99 {ttft}, {trial.changed}/{trial.checked} answers changed{excluded}")

    trials = run_generation_sweep(artifact, manifest, grid, load, limits, on_trial=on_trial)
    print_generation_table(out_console, manifest.name, trials, limits, load)
    if json_path:
        write_generation_json(json_path, str(artifact), manifest.name, trials, limits, load)
        out_console.print(f"Wrote {json_path}", markup=False)
    best = next((t for t in trials if t.chosen), None)
    if best is None:
        raise KilnError(f"no configuration met the limits ({describe_limits(limits)}; no failed request, no changed "
                        f"answer): nothing chosen, nothing written; the table says why each was excluded")
    write_generation_config(out, str(artifact), best, limits)
    out_console.print(f"Chosen: [bold]{escape(serve_command(str(artifact), best.settings))}[/]")
    out_console.print(f"Wrote {escape(str(out))} (the same settings for kiln serve --config)")


class TuneCommand(DerivedOptionsCommand):
    """``kiln tune``: its own options plus, for each setting that the ServeSettings declaration
    marks sweepable, ``--<its kiln serve flag> VALUES``; its help gives the values declared for
    each kind of model, tried when the option is not given."""

    insert_before = "concurrency"

    def derive(self) -> list[Any]:
        from ..serve.settings import MODEL_KINDS, ServeSettings, choices, cli_flag, shown_default, sweep_default

        params = []
        for name in swept_options():
            flag = cli_flag(name)
            field = ServeSettings.model_fields[name]
            auto = "; auto = the server's default" if field.default is None else ""
            allowed = choices(name)
            of = f", of {', '.join(allowed)}" if allowed else ""
            kinds = {KIND_NAMES[k]: swept or f"kiln serve's ({shown_default(name)})"
                     for k in MODEL_KINDS if (swept := sweep_default(name, k)) is not None}
            if len(kinds) == 1:
                default = "{1}; {0} only".format(*next(iter(kinds.items())))
            elif len(set(kinds.values())) == 1:
                default = next(iter(kinds.values()))
            else:
                default = ", ".join(f"{values} for {kind}" for kind, values in kinds.items())
            help = f"{field.description} Values to try (kiln serve {flag}), comma-separated{of}{auto}. Default: {default}."
            params.append(keyword(name, Optional[str], typer.Option(None, flag, help=help, show_default=False)))
        return typer_params(params)


KIND_NAMES = {"encoder": "encoders", "generation": "text generation"}


def swept_options(kind: Optional[str] = None) -> list[str]:
    """The settings kiln tune sweeps, each its own option, for ``kind`` (None: any): every one
    the declaration marks sweepable but the variant, which is ``--variants`` (by default the
    artifact's kept variants, which the declaration cannot list)."""
    from ..serve.settings import sweepable

    return [name for name in sweepable(kind) if name != "variant"]


def sweep_values(name: str, text: str) -> tuple[Any, ...]:
    """``"1,2"`` → (1, 2) for the setting ``name``, typed as declared (numbers; one of a
    ``Literal``'s choices; other words as given); ``auto`` → None (the server's default) where
    the default is None. For numbers whose default is None and that cannot be 0 (instances,
    threads, max_batch_tokens), 0 also means the server's default, as it always did here."""
    from pydantic import ValidationError

    from ..errors import KilnError
    from ..option_lists import number_list, split_list
    from ..serve.settings import ServeSettings, choices, cli_flag, value_type

    optional = ServeSettings.model_fields[name].default is None
    if value_type(name) not in (int, float):
        words = split_list(text) or []
        allowed = choices(name)
        if allowed and any(w not in allowed for w in words):
            raise KilnError(f"{cli_flag(name)} takes comma-separated values of {', '.join(allowed)}, got '{text}'")
        return tuple(None if optional and w == "auto" else w for w in words)
    values = number_list(text, cli_flag(name), value_type(name), auto=optional)
    if optional:
        try:
            ServeSettings.model_validate({name: 0})
        except ValidationError:
            values = [None if v == 0 else v for v in values]
    return tuple(values)
