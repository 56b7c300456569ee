"""``kiln loadtest``: the command function; cli.py registers it. Heavy imports stay inside."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def loadtest(
    url: str = typer.Argument(..., help="Server base URL, e.g. http://127.0.0.1:8000 (kiln serve, Triton, MLServer...)."),
    model: str = typer.Option(..., "--model", "-m", help="Model name on the server."),
    protocol: str = typer.Option("oip-json", help="oip-json | oip-binary (binary tensor extension) | task (kiln serve /predict) | grpc (KServe v2 ModelInfer); "
                                 "text generation, streamed: openai-chat (/v1/chat/completions) | openai-completions (/v1/completions) | generate (Triton's /v2/models/M/generate_stream)."),
    grpc_url: Optional[str] = typer.Option(None, help="host:port of the gRPC endpoint for --protocol grpc (default: URL's host, port 8001)."),
    concurrency: Optional[str] = typer.Option(None, help="Closed loop: N, N,M,... or START:STOP:xF (default 1:16:x2 unless --rate)."),
    rate: Optional[str] = typer.Option(None, help="Open loop: requests/s with Poisson arrivals; same forms as --concurrency."),
    inputs: str = typer.Option("samples", help="samples (built-in) | sts (STS-B sentences) | squad (SQuAD paragraphs) | a text file."),
    length: str = typer.Option("all", help="all | short (shorter half of the texts) | long (longer half)."),
    batch: int = typer.Option(1, help="Inputs per request."),
    max_inputs: Optional[int] = typer.Option(None, help="Use only the first N texts."),
    warmup: Optional[float] = typer.Option(None, help="Seconds of load before measuring, per step (discarded). Default 1; generation 3."),
    window: Optional[float] = typer.Option(None, help="Seconds per measurement window. Default 2; generation 8 (requests last seconds)."),
    stability: float = typer.Option(0.10, help="Windows agree when max/min of throughput and p95 is within 1+this."),
    stable_windows: Optional[int] = typer.Option(None, help="How many consecutive windows must agree. Default 3; generation 2."),
    max_windows: Optional[int] = typer.Option(None, help="Give up on stability after this many windows (marked unstable). Default 10; generation 4."),
    max_tokens: Optional[int] = typer.Option(None, help="Generation: tokens per answer (default: the server's)."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Generation: always generate --max-tokens tokens (fixed lengths) instead of stopping at the end of the answer."),
    sampled: bool = typer.Option(False, "--sampled", help="Generation: sample (temperature 0.7, top_p 0.95) with each prompt's index as its seed, instead of greedy; --check then compares the seeded answers."),
    extra_inputs: Optional[list[str]] = typer.Option(None, "--extra-inputs", help="Generation: one more field in every request, 'name:value' with a JSON value (genai-perf's option), "
                                                       "e.g. 'response_format:{\"type\":\"json_object\"}'; repeatable."),
    check: bool = typer.Option(False, "--check", help="Take each request's answer alone first (greedy, or seeded with --sampled), then compare every answer under load with it "
                               "(generation: text, SSE framing, usage; encoders: cosine >= 0.99999, labels); adds a mismatches column."),
    timeout: Optional[float] = typer.Option(None, help="Seconds per request before it counts as a timeout. Default 30; generation 300."),
    max_connections: int = typer.Option(256, help="Open loop: most requests outstanding at once."),
    seed: int = typer.Option(0, help="Seed of the Poisson arrivals."),
    metrics_url: str = typer.Option("auto", help="Prometheus endpoint for the server breakdown: auto (URL/metrics), none, or a URL (Triton: http://host:8002/metrics)."),
    header: Optional[list[str]] = typer.Option(None, help="Extra header 'Name: value' (e.g. Authorization), repeatable."),
    label: Optional[str] = typer.Option(None, help="Name of this run in tables and plots."),
    stop_p99_ms: Optional[float] = typer.Option(None, help="Stop the sweep after a step whose p99 exceeds this."),
    csv_path: Optional[Path] = typer.Option(None, "--csv", help="Write one row per step."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the whole run (readable by --compare)."),
    plot_path: Optional[Path] = typer.Option(None, "--plot", help="Write latency vs throughput as PNG."),
    compare: Optional[list[Path]] = typer.Option(None, help="Earlier --json results to draw on the same plot, repeatable."),
    plot_percentile: str = typer.Option("p95", help="Latency percentile on the plot: p50, p90, p95, p99."),
) -> None:
    """Load-test an inference server: closed-loop concurrency or open-loop Poisson rate sweeps,
    stable measurement windows, latency percentiles, errors by status, server-side breakdown."""
    from rich.console import Console

    from ..errors import KilnError
    from .api import LoadtestOptions, parse_extra_input, parse_header, run_loadtest
    from .report import print_table, read_json, write_csv, write_json
    from .runner import Load, StepResult, parse_levels
    from .streaming import is_generation

    # requests of a generation protocol last seconds: longer windows hold enough of them (docs/loadtest-generation.md)
    generation = is_generation(protocol)
    warmup = warmup if warmup is not None else 3.0 if generation else 1.0
    window = window if window is not None else 8.0 if generation else 2.0
    stable_windows = stable_windows if stable_windows is not None else 2 if generation else 3
    max_windows = max_windows if max_windows is not None else 4 if generation else 10
    timeout = timeout if timeout is not None else 300.0 if generation else 30.0
    if concurrency and rate:
        raise KilnError("give --concurrency (closed loop) or --rate (open loop), not both")
    loads = tuple(Load("rate", v) for v in parse_levels(rate, "--rate")) if rate else tuple(
        Load("concurrency", float(int(v))) for v in parse_levels(concurrency or "1:16:x2", "--concurrency"))
    earlier = [read_json(p) for p in compare or []]  # fail before the run, not after it
    opts = LoadtestOptions(
        url=url, model=model, loads=loads, protocol=protocol, grpc_url=grpc_url, inputs=inputs, length=length, batch=batch,
        max_inputs=max_inputs, warmup_s=warmup, window_s=window, stability=stability, stable_windows=stable_windows,
        max_windows=max_windows, timeout_s=timeout, max_connections=max_connections, seed=seed,
        metrics_url=metrics_url, headers=tuple(parse_header(h) for h in header or []), label=label,
        stop_p99_ms=stop_p99_ms, max_tokens=max_tokens, ignore_eos=ignore_eos, check=check, sampled=sampled,
        extra_inputs=tuple(parse_extra_input(e) for e in extra_inputs or []))
    err = Console(stderr=True)
    out = Console(width=None if __import__("sys").stdout.isatty() else 200)

    def on_step(step: StepResult) -> None:
        p95 = f"{step.latency.p95:.2f} ms" if step.latency else "-"
        tokens = f", {step.generation.output_tokens_per_s:.1f} output tokens/s" if step.generation else ""
        checked = f", mismatches {step.mismatches}/{step.checked}" if step.mismatches is not None else ""
        err.print(f"[green]✓[/] {step.load.label}: {step.throughput:.1f} req/s{tokens}, p95 {p95}, "
                  f"errors {sum(step.errors.values())}{checked}{'' if step.stable else ' [yellow](unstable)[/]'}")

    if check:
        err.print("--check: taking the reference answer of each request alone...")

    result = run_loadtest(opts, on_step=on_step)
    print_table(out, result)
    for example in result.mismatch_examples:
        out.print(f"mismatch: {example}", markup=False)
    if csv_path:
        write_csv(csv_path, result)
        out.print(f"Wrote {csv_path}", markup=False)
    if json_path:
        write_json(json_path, result)
        out.print(f"Wrote {json_path}", markup=False)
    if plot_path:
        from .plot import plot

        plot([result, *earlier], plot_path, plot_percentile)
        out.print(f"Wrote {plot_path}", markup=False)
