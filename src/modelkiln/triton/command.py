"""``kiln triton``: the command function; cli.py registers it. Heavy imports stay inside. The
repository's options (``--model-backend``, ``--max-batch-size``...) are the fields of
``config.Options``, declared there once with their defaults and help."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional

import typer

from ..derived_options import DERIVED, DerivedOptionsCommand, keyword, typer_params
from ..model_arg import PRECISION, TASK, artifact_path


class TritonCommand(DerivedOptionsCommand):
    """``kiln triton``: its own parameters plus one option per field of ``config.Options``."""

    insert_before = "variant"

    def derive(self) -> list[Any]:
        from .config import Options

        return typer_params([keyword(f.name, type(f.default), typer.Option(f.default, help=f.metadata["help"]))
                             for f in dataclasses.fields(Options)])


def triton(
    ctx: typer.Context,
    model: str = typer.Argument(..., metavar="MODEL", help="An artifact folder written by `kiln convert`, or a model (a .gguf file, a Hugging Face folder or hub id: converted once into the model cache)."),
    out: Path = typer.Argument(..., help="Model repository folder to write (atomically)."),
    # here TritonCommand adds one option per field of config.Options
    variant: Optional[str] = typer.Option(None, help="Variant to serve (default: the fastest kept one for --kind)."),
    force: bool = typer.Option(False, help="Replace an existing OUT folder."),
    task: Optional[str] = TASK,
    precision: Optional[str] = PRECISION,
) -> None:
    """Write a Triton model repository: tokenize → model → postprocess, joined by an ensemble (a text-generation
    artifact: one decoupled python model running modelkiln's generation engine, streaming)."""
    from rich.console import Console
    from rich.markup import escape

    from ..manifest import Manifest
    from ..tasks.text_generation import is_generation
    from .config import Options
    from .repository import model_name, write_repository

    opts = Options(**ctx.meta[DERIVED])
    artifact = artifact_path(model, task, precision)
    path = write_repository(artifact, out, opts, variant=variant, force=force)
    manifest = Manifest.load(artifact)
    name = model_name(manifest)
    console = Console()
    if is_generation(manifest):
        console.print(f"Wrote [bold]{escape(str(path))}[/]: decoupled python model [bold]{escape(name)}[/] "
                      "(modelkiln's generation engine; /generate, /generate_stream).")
    else:
        console.print(f"Wrote [bold]{escape(str(path))}[/]: ensemble [bold]{escape(name)}[/] ({escape(opts.model_backend)} model).")
    # A path must not break across lines (it would not paste back into a shell): soft_wrap leaves it whole.
    console.print(f"To launch it, see {escape(str(path / 'README.md'))}", soft_wrap=True, highlight=False)
