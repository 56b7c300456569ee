"""``kiln triton``: the command function; cli.py registers it. Heavy imports stay inside."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def triton(
    artifact: Path = typer.Argument(..., help="An artifact folder written by `kiln convert`."),
    out: Path = typer.Argument(..., help="Model repository folder to write (atomically)."),
    model_backend: str = typer.Option("onnxruntime", help="onnxruntime (platform onnxruntime_onnx) | tensorrt (tensorrt_plan; needs TensorRT here) | python (onnxruntime inside the python backend, for CPU-only Triton builds)."),
    max_batch_size: int = typer.Option(32, help="Triton max_batch_size of every model (> 0)."),
    max_queue_delay_us: int = typer.Option(500, help="Dynamic batching: longest wait for a fuller batch, in microseconds."),
    instances: int = typer.Option(1, help="Instances of each model (instance_group count)."),
    kind: str = typer.Option("cpu", help="cpu or gpu: where the model instances run (KIND_CPU / KIND_GPU)."),
    variant: Optional[str] = typer.Option(None, help="Variant to serve (default: the fastest kept one for --kind)."),
    threads: int = typer.Option(0, help="onnxruntime intra-op threads per instance (0: onnxruntime's default)."),
    force: bool = typer.Option(False, help="Replace an existing OUT folder."),
) -> None:
    """Write a Triton model repository: tokenize → model → postprocess, joined by an ensemble (a text-generation
    artifact: one decoupled python model running modelkiln's generation engine, streaming)."""
    from rich.console import Console
    from rich.markup import escape

    from .config import Options
    from .repository import model_name, write_repository

    opts = Options(model_backend=model_backend, max_batch_size=max_batch_size, max_queue_delay_us=max_queue_delay_us,
                   instances=instances, kind=kind, threads=threads)
    path = write_repository(artifact, out, opts, variant=variant, force=force)
    from ..manifest import Manifest

    manifest = Manifest.load(artifact)
    name = model_name(manifest)
    console = Console()
    if manifest.task == "text-generation":
        console.print(f"Wrote [bold]{escape(str(path))}[/]: decoupled python model [bold]{escape(name)}[/] "
                      "(modelkiln's generation engine; /generate, /generate_stream).")
    else:
        console.print(f"Wrote [bold]{escape(str(path))}[/]: ensemble [bold]{escape(name)}[/] ({escape(model_backend)} model).")
    # A path must not break across lines (it would not paste back into a shell): soft_wrap leaves it whole.
    console.print(f"To launch it, see {escape(str(path / 'README.md'))}", soft_wrap=True, highlight=False)
