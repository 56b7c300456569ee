"""The ``kiln`` command line: parses arguments and calls the library. Nothing else lives here."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from .bench.isolation import DEFAULT_TIMEOUT_S as DEFAULT_PEER_TIMEOUT_S
from .errors import KilnError
from .model_arg import PRECISION as MODEL_PRECISION, TASK as MODEL_TASK
from .option_lists import number_list, split_list

app = typer.Typer(
    help="Turn a Hugging Face transformer into validated fast ONNX variants, benchmark them, and serve them.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Help texts are plain text: rich markup would eat "modelkiln[convert]" as a tag.
    rich_markup_mode=None,
)
console = Console(stderr=True)
# Tables are wide; when piped (CI logs, README captures) do not squeeze them into 80 columns.
out = Console(width=None if sys.stdout.isatty() else 160)


@contextlib.contextmanager
def step(description: str) -> Iterator[None]:
    """A spinner while a step runs, then a ✓ line with its duration."""
    started = time.perf_counter()
    if console.is_terminal:
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                      transient=True) as progress:
            progress.add_task(escape(description))
            yield
    else:  # logs and pipes get the ✓ lines only
        yield
    console.print(f"[green]✓[/] {escape(description)} [dim]({time.perf_counter() - started:.1f}s)[/]")


def quiet_transformers() -> None:
    """No "Loading weights" progress bars from transformers / huggingface_hub in command output. The
    env var is read when huggingface_hub is first imported; the call covers an already imported one."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # transformers' GGUF reader draws a raw tqdm bar ("Converting and de-quantizing GGUF tensors");
    # tqdm reads TQDM_* defaults when it is first imported, which is after this call.
    os.environ.setdefault("TQDM_DISABLE", "1")
    transformers = sys.modules.get("transformers")
    if transformers is not None:
        transformers.utils.logging.disable_progress_bar()


def versions_line() -> str:
    """modelkiln's version and the runtime libraries it was installed with, read from package metadata
    (nothing is imported, so this stays fast and works without the optional extras)."""
    from importlib.metadata import PackageNotFoundError, version

    from . import __version__

    found = []
    for dist in ("onnxruntime", "onnxruntime-gpu", "tokenizers", "numpy", "torch", "transformers"):
        with contextlib.suppress(PackageNotFoundError):
            found.append(f"{dist} {version(dist)}")
    return f"modelkiln {__version__} ({', '.join(found)}; python {sys.version.split()[0]})"


def _print_version(value: bool) -> None:
    if value:
        print(versions_line())
        raise typer.Exit()


@app.callback()
def _options(
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                 help="Print the versions of modelkiln and its runtime libraries, then exit."),
) -> None:
    pass


# --- convert ----------------------------------------------------------------------------------


@app.command()
def convert(
    ctx: typer.Context,
    model: str = typer.Argument(..., help="Local model folder, Hugging Face hub id, or a .gguf file (text generation)."),
    out_dir: Optional[Path] = typer.Option(None, "--out", "-o", help="Artifact folder to write (atomically). Default: the model cache ($KILN_CACHE, else ~/.cache/modelkiln), where kiln serve, generate... MODEL find it; kiln cache ls shows it.", show_default=False),
    task: str = typer.Option("auto", help="text-classification | sentence-embeddings | token-classification | question-answering | text-generation | auto"),
    precision: str = typer.Option("", help="Comma-separated variants to build: fp32,optimized,int8,fp16,tensorrt,openvino-fp32,openvino-bf16,openvino-int8 or all (text generation: gguf,fp32,int8,int4, gguf = a GGUF file's own blocks; --engine torch: fp32,bf16,fp16). Default: all that fit the device; for a GGUF file, gguf."),
    device: str = typer.Option("cpu", help="cpu or cuda: the device variants are built, validated and timed on."),
    engine: str = typer.Option("onnx", help="onnx: ONNX Runtime graphs; torch: the weights for kiln's PyTorch engine (variants torch-fp32, torch-bf16, torch-fp16; needs modelkiln[convert] to serve)."),
    calibration_texts: Optional[Path] = typer.Option(None, help="Validation texts, one per line (a tab separates a pair / question-context)."),
    threads: Optional[int] = typer.Option(None, help="Intra-op threads for validation and timing (default: all cores)."),
    name: Optional[str] = typer.Option(None, help="Model name in the manifest (default: the output folder's name)."),
    force: bool = typer.Option(False, help="Replace an existing artifact folder."),
    fp32_atol: Optional[float] = typer.Option(None, help="Max abs difference allowed for fp32 variants (default 1e-3)."),
    int8_min_cosine: Optional[float] = typer.Option(None, help="Min mean cosine similarity for int8 (default 0.98)."),
    int8_min_agreement: Optional[float] = typer.Option(None, help="Min task agreement for int8 (default 0.9)."),
    fp16_min_cosine: Optional[float] = typer.Option(None, help="Min mean cosine similarity for fp16 (default 0.999)."),
    int4_block_size: int = typer.Option(32, help="Text generation: weights per int4 scale (MatMulNBits block size)."),
    int4_accuracy_level: int = typer.Option(4, help="Text generation: MatMulNBits accuracy level of gguf, int8 and int4 (4: int8 compute; 0: fp32)."),
    native_gguf: bool = typer.Option(True, help="Text generation from a GGUF: multiply by its Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and Q2_K..Q6_K blocks as the file stores them (kiln's native operators); --no-native-gguf stores them in MatMulNBits."),
    kv_cache: str = typer.Option("f16", help="Text generation from a GGUF with kiln's native operators: the KV cache's type, f16 (half the memory a token, as llama.cpp's default) or f32."),
    gate_prompts: str = typer.Option("8,4", help="Text generation: gate prompts as SHORT,SQUAD (STS-B sentences, SQuAD chat prompts; as many SQuAD paragraphs for perplexity)."),
    max_model_gb: Optional[float] = typer.Option(None, help="Text generation: refuse fp32, int8 and int4 of models whose fp32 weights exceed this (default: a third of the memory)."),
) -> None:
    """Export MODEL to ONNX, build faster variants, validate each against PyTorch, write an artifact."""
    from dataclasses import replace

    from .extras import require_extra

    require_extra("convert", "kiln convert")
    quiet_transformers()

    from .convert.pipeline import PRECISIONS, ConvertConfig
    from .convert.generation.torch_weights import TORCH_PRECISIONS
    from .convert.pipeline import convert as run_convert
    from .convert.validate import DEFAULT_TOLERANCES
    from .data import read_text_file
    from .report import print_variants

    tolerances = dict(DEFAULT_TOLERANCES)
    if fp32_atol is not None:
        tolerances["fp32"] = replace(tolerances["fp32"], max_abs_diff=fp32_atol)
    if int8_min_cosine is not None:
        tolerances["int8"] = replace(tolerances["int8"], min_mean_cosine=int8_min_cosine)
    if int8_min_agreement is not None:
        tolerances["int8"] = replace(tolerances["int8"], min_agreement=int8_min_agreement)
    if fp16_min_cosine is not None:
        tolerances["fp16"] = replace(tolerances["fp16"], min_mean_cosine=fp16_min_cosine)
    precisions: list[str] | None  # None: every variant that fits the device
    if precision.strip() == "all":
        precisions = list(TORCH_PRECISIONS if engine == "torch" else PRECISIONS)
    else:
        precisions = split_list(precision)
    gate_counts = number_list(gate_prompts, "--gate-prompts")
    if len(gate_counts) != 2:
        raise typer.BadParameter("--gate-prompts takes SHORT,SQUAD, e.g. 8,4")

    def write(model: str, out_dir: Path, name: Optional[str], force: bool) -> None:
        cfg = ConvertConfig(
            model=model, out=out_dir, task=task, precisions=precisions, device=device, engine=engine,
            calibration_texts=read_text_file(calibration_texts) if calibration_texts else None,
            tolerances=tolerances, threads=threads, force=force, name=name,
            int4_block_size=int4_block_size, int4_accuracy_level=int4_accuracy_level, native_gguf=native_gguf,
            kv_cache=kv_cache, gate_short=gate_counts[0], gate_squad=gate_counts[1], max_model_gb=max_model_gb,
        )
        manifest = run_convert(cfg, steps=step)
        print_variants(out, manifest)
        default = (manifest.generation or {}).get("default_variant")
        served = f"; served by default: {default}" if default else ""
        out.print(f"Wrote [bold]{escape(str(out_dir))}[/] ({manifest.task}, {len(manifest.kept_variants())} variants kept{served})")

    if out_dir is not None:
        return write(model, out_dir, name, force)
    from .model_cache import convert_into_cache

    entry = convert_into_cache(model, _keyed_options(ctx, calibration_texts),
                               lambda out_dir, source: write(source.location, out_dir, name or source.name, True),
                               force=force)
    out.print(f"In the model cache: [bold]{escape(str(entry))}[/] (kiln serve, generate, bench... {escape(model)} "
              "start from it; kiln cache ls lists the cache)", soft_wrap=True)


# Options of kiln convert that do not change the artifact it writes: left out of the cache key.
_NOT_KEYED = ("model", "out_dir", "force", "threads")


def _keyed_options(ctx: typer.Context, calibration_texts: Optional[Path]) -> dict[str, object]:
    """The options given to this kiln convert that decide its artifact, as the model cache keys
    them: each one not at its default, by name (a calibration file by its content)."""
    from .model_cache import fingerprint

    options: dict[str, object] = {}
    for param in ctx.command.params:
        value = ctx.params.get(param.name)
        if param.name in _NOT_KEYED or value == param.default:
            continue
        options[param.name] = fingerprint(calibration_texts) if param.name == "calibration_texts" and calibration_texts else value
    return options


# --- bench ------------------------------------------------------------------------------------


@app.command()
def bench(
    target: str = typer.Argument(..., metavar="MODEL", help="An artifact folder, or a model (a .gguf file, a Hugging Face folder or hub id: converted once into the model cache)."),
    batch: str = typer.Option("1,8,32", help="Batch sizes."),
    seq: str = typer.Option("", help="Sequence lengths (tokens); default 16,128,384 (prompt lengths 16,128,512 for text generation)."),
    past: int = typer.Option(128, help="Text generation: the past (tokens) of every sequence in the decode cells."),
    threads: Optional[int] = typer.Option(None, help="Intra-op threads for every backend (default: the CPUs this "
                                                     "process may use: its affinity mask or cgroup quota)."),
    variants: Optional[str] = typer.Option(None, help="Comma-separated variants to run (default: every kept one)."),
    reference: bool = typer.Option(True, help="Run the PyTorch fp32 reference (needs modelkiln[convert])."),
    warmup: int = typer.Option(3, help="Warm-up runs per cell."),
    min_iters: int = typer.Option(10, help="At least this many timed runs per cell."),
    min_seconds: float = typer.Option(1.0, help="And at least this long per cell."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Also write the results as JSON."),
    peer_timeout: float = typer.Option(DEFAULT_PEER_TIMEOUT_S, help="Seconds a peer row (PyTorch, llama.cpp: each runs in a child process) may take; one that runs longer is stopped and noted, as a crash is."),
    peers: str = typer.Option("llama.cpp,onnxruntime-genai", help="Text generation: the other engines to run, each in a child process (llama.cpp, onnxruntime-genai; 'none': none); a missing one is a note with its install command."),
    sampled: bool = typer.Option(False, "--sampled", help="Text generation: the decode cells sample as `kiln loadtest --sampled` asks (temperature 0.7, top_p 0.95, a seed per sequence) instead of taking the most likely token; PyTorch and onnxruntime-genai draw the same way (top-k off), llama.cpp's cells time its model alone either way."),
    task: Optional[str] = MODEL_TASK,
    precision: Optional[str] = MODEL_PRECISION,
) -> None:
    """Latency and throughput of PyTorch and every ONNX variant over batch × sequence length
    (text generation: prefill by prompt length, decode by batch size, llama.cpp too when installed)."""
    from .extras import has_extra, install_hint
    from .model_arg import artifact_path

    target = str(artifact_path(target, task, precision))
    if reference and not has_extra("convert"):
        console.print(f"note: no PyTorch reference (modelkiln[convert] is not installed: {install_hint('convert')}); "
                      "running as --no-reference", markup=False, highlight=False, soft_wrap=True)
        reference = False
    quiet_transformers()
    from .bench.generation_command import bench_generation, generation_artifact
    from .cpus import available_cpus

    threads = threads or available_cpus().count  # a pinned or quota-limited process: its share, not the host's cores
    from .bench.report import print_table, write_json
    from .bench.runner import BenchConfig, run_bench

    if generation_artifact(target):
        return bench_generation(target, batch, seq, past, threads, variants, reference, json_path, out, step,
                                peer_timeout=peer_timeout, peers=peers, sampled=sampled)
    from .manifest import is_artifact

    if sampled and is_artifact(target):  # not an artifact at all: run_bench names what is wrong with the path
        raise KilnError(f"--sampled is for text generation; {target} is an encoder artifact (it chooses no tokens)")
    cfg = BenchConfig(batches=number_list(batch, "--batch"), seqs=number_list(seq or "16,128,384", "--seq"), threads=threads,
                      variants=split_list(variants), reference=reference, warmup=warmup, min_iters=min_iters,
                      min_seconds=min_seconds, peer_timeout=peer_timeout)
    result = run_bench(target, cfg, steps=step)
    print_table(out, result)
    if json_path:
        write_json(json_path, result)
        out.print(f"Wrote {json_path}", markup=False)


# --- eval -------------------------------------------------------------------------------------


@app.command("eval")
def evaluate(
    model: str = typer.Argument(..., metavar="MODEL", help="An artifact folder of a sentence-embeddings or text-generation model, or such a model (converted once into the model cache)."),
    sts: Optional[Path] = typer.Option(None, help="STS Benchmark file (default: the STS-B dev split that ships with modelkiln)."),
    threads: Optional[int] = typer.Option(None, help="Intra-op threads."),
    reference: bool = typer.Option(True, help="Also score the PyTorch model the artifact came from."),
    task: Optional[str] = MODEL_TASK,
    precision: Optional[str] = MODEL_PRECISION,
) -> None:
    """Accuracy on STS Benchmark: Spearman ×100 of cosine similarities, per variant and for PyTorch
    (text generation: perplexity on SQuAD paragraphs and SQuAD answered by generation)."""
    from .extras import require_extra

    if reference:
        require_extra("convert", "kiln eval's PyTorch reference", "or pass --no-reference")
    from .model_arg import artifact_path

    artifact = artifact_path(model, task, precision)
    quiet_transformers()
    from .bench.accuracy import evaluate_sts
    from .bench.generation_command import eval_generation, generation_artifact
    from .report import print_accuracy

    if generation_artifact(artifact):
        return eval_generation(artifact, threads, reference, out, step)
    print_accuracy(out, evaluate_sts(artifact, sts, threads, reference, steps=step))


# --- cache ------------------------------------------------------------------------------------

cache_app = typer.Typer(no_args_is_help=True, add_completion=False, rich_markup_mode=None,
                        help="The model cache: the artifacts kiln serve, generate... MODEL (and kiln convert MODEL "
                             "without --out) converted once and reuse.")
app.add_typer(cache_app, name="cache")


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


@cache_app.command("ls")
def cache_ls() -> None:
    """List the cached conversions: key, size, status (ready, stale: source changed...), when converted,
    and each one's source, options and model name. Keys and paths are printed whole, to be copied."""
    from .model_cache import cache_root, list_entries

    entries = list_entries()
    count = f"{len(entries)} {'entry' if len(entries) == 1 else 'entries'}"
    out.print(f"{cache_root() / 'models'}: {count}, {_size(sum(e.bytes for e in entries))}", markup=False,
              highlight=False, soft_wrap=True)
    width, status_width = (max((len(text) for text in texts), default=0)
                           for texts in ([e.key for e in entries], [e.status for e in entries]))
    for e in entries:
        out.print(f"{e.key:<{width}}  {_size(e.bytes):>9}  {e.status:<{status_width}}  {e.converted}", markup=False,
                  highlight=False, soft_wrap=True)
        out.print(f"  {e.source} ({e.options or 'default options'}), model {e.name}", markup=False,
                  highlight=False, soft_wrap=True)


@cache_app.command("rm")
def cache_rm(
    keys: Optional[list[str]] = typer.Argument(None, help="Keys to remove (kiln cache ls lists them).", show_default=False),
    all_entries: bool = typer.Option(False, "--all", help="Remove every entry."),
    stale: bool = typer.Option(False, "--stale", help="Remove the entries whose source changed or is gone, or that an "
                                                       "older modelkiln wrote, and interrupted conversions."),
) -> None:
    """Remove cached conversions (an entry that another process is converting is left alone)."""
    from .model_cache import list_entries, remove_entry

    if bool(keys) + all_entries + stale != 1:
        raise typer.BadParameter("give KEY..., --all or --stale")
    if all_entries or stale:
        chosen = [e for e in list_entries() if all_entries or e.status.startswith("stale") or e.status == "interrupted"]
        for e in chosen:
            if e.status == "converting":
                out.print(f"Left {e.key}: another process is converting it", markup=False, highlight=False)
        keys = [e.key for e in chosen if e.status != "converting"]
    freed = 0
    for key in keys or []:
        size = remove_entry(key)
        freed += size
        out.print(f"Removed {key} ({_size(size)})", markup=False, highlight=False)
    out.print(f"Freed {_size(freed)}", highlight=False)


from .serve.command import ServeCommand, serve as _serve; app.command("serve", cls=ServeCommand)(_serve)  # noqa: E402,E702


from .triton.command import TritonCommand, triton as _triton; app.command("triton", cls=TritonCommand)(_triton)  # noqa: E402,E702


from .ray.command import ray_app as _ray; app.add_typer(_ray, name="ray")  # noqa: E402,E702


from .loadtest.command import loadtest as _loadtest; app.command("loadtest")(_loadtest)  # noqa: E402,E702


from .tune.command import TuneCommand, tune as _tune; app.command("tune", cls=TuneCommand)(_tune)  # noqa: E402,E702


from .generate_command import GenerateCommand, generate as _generate; app.command("generate", cls=GenerateCommand)(_generate)  # noqa: E402,E702


# --- entry point ------------------------------------------------------------------------------


def main() -> None:
    try:
        app()
    except KilnError as exc:
        if os.environ.get("KILN_DEBUG"):
            raise
        console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:
        console.print("[bold red]interrupted[/]")
        sys.exit(130)


if __name__ == "__main__":
    main()
