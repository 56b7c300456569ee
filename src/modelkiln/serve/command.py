"""``kiln serve``: parse flags, load the models, run uvicorn. Imports nothing heavy at module
level (``kiln --help`` must stay fast); fastapi/uvicorn/onnxruntime load inside ``serve``. The
flags are derived from the ``ServeSettings`` declaration (one per field), so a new setting
gets its flag, env var and config key by being declared there."""

from __future__ import annotations

import sys
import typing
from pathlib import Path
from typing import Any, Optional

import typer

from ..derived_options import DERIVED, DerivedOptionsCommand, keyword, typer_params
from ..errors import KilnError
from ..model_arg import PRECISION, TASK, artifact_path, model_argument

DEFAULT_MODEL_NAME = "all-MiniLM-L6-v2"


def default_artifact() -> Path:
    """The embedded default model, converted once into the model cache (int8 only: the variant a
    CPU server picks from all of them, 23 MB instead of 195 MB for all three; other variants:
    `kiln convert` an artifact and serve that)."""
    from ..embedded import embedded_model_path

    try:
        source = str(embedded_model_path(DEFAULT_MODEL_NAME))
    except KilnError as exc:
        raise KilnError(f"no artifact given and the default model cannot be used: {exc}") from None
    return artifact_path(source, precision="int8", name=DEFAULT_MODEL_NAME)


def serve(
    ctx: typer.Context,
    artifacts: Optional[list[str]] = typer.Argument(
        None, help="Artifact folders or models (a .gguf file, a Hugging Face folder or hub id: converted once into "
                   "the model cache), or NAME=PATH. None: the default model (or only the --model-repository's models).",
        show_default=False),
    config: Optional[Path] = typer.Option(
        None, help="JSON settings file (e.g. written by `kiln tune`); env vars and flags override it.",
        show_default=False),
    task: Optional[str] = TASK,
    precision: Optional[str] = PRECISION,
) -> None:
    """Serve artifacts over HTTP: KServe v2 / Open Inference Protocol (Triton-compatible),
    /v2/models/{m}/predict, and OpenAI /v1/embeddings, with dynamic batching; text-generation
    artifacts with continuous batching and streaming (OpenAI /v1/completions and
    /v1/chat/completions, Triton's /generate and /generate_stream)."""
    import logging

    from .config_file import read_serve_config
    from .settings import ServeSettings, parse_model_arg

    flags = ctx.meta.get(DERIVED, {})  # one per declared setting, None = not given (ServeCommand)
    settings = ServeSettings.from_env(config=read_serve_config(config) if config else None, **flags)
    specs = tuple(parse_model_arg(model_argument(a, task, precision), settings.variant) for a in artifacts or [])
    if not specs and not settings.model_repository:  # a repository alone: its folders are the models
        specs = (parse_model_arg(f"{DEFAULT_MODEL_NAME}={default_artifact()}", settings.variant),)
    settings = settings.with_models(specs)
    logging.basicConfig(level=settings.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_server(with_cpu_budget(settings))


def with_cpu_budget(settings: Any) -> Any:
    """The settings with ``cpus`` set to the CPUs this server sizes its threads from (its affinity
    mask, its cgroup quota, or less when ``--cpus`` says so; more is refused), said on stderr."""
    from ..cpus import cpu_budget
    from .settings import cli_flag

    budget = cpu_budget(settings.cpus, cli_flag("cpus"))
    print(f"CPU budget: {budget}", file=sys.stderr, flush=True)
    return settings.replace(cpus=budget.count)


class ServeCommand(DerivedOptionsCommand):
    """``kiln serve``: ``serve``'s own parameters plus one option per declared setting."""

    def derive(self) -> list[Any]:
        from .settings import declared

        return typer_params([keyword(name, *_setting_option(name)) for name in declared()])


def _setting_option(name: str) -> tuple[Any, Any]:
    """(type, typer.Option) for one declared setting: ``--name`` (or its declared flag), the
    help with its env var and default, ``--x/--no-x`` for booleans; None = not given."""
    from .settings import cli_flag, help_line, value_type

    flag, kind = cli_flag(name), value_type(name)
    if kind is bool:
        return Optional[bool], typer.Option(None, f"{flag}/--no-{flag[2:]}", help=help_line(name), show_default=False)
    if typing.get_origin(kind) is typing.Literal:
        # a plain string shown as A|B|C: the declaration rejects others with the same one-line
        # error whether the value came from a flag, an env var or the config file
        choices = "|".join(str(c) for c in typing.get_args(kind))
        return Optional[str], typer.Option(None, flag, help=help_line(name), show_default=False, metavar=choices)
    return Optional[kind], typer.Option(None, flag, help=help_line(name), show_default=False)


def run_server(settings: object) -> None:
    """Serve ``settings``' models: in this process, or in ``--workers`` processes."""
    from .http.app import build_app
    from .http.server import serve_http
    from .settings import ServeSettings
    from .workers import generates_text, run_workers, startup_specs

    assert isinstance(settings, ServeSettings)
    startup = startup_specs(settings)
    workers = settings.worker_count(generation=generates_text(startup.specs))
    if workers > 1:
        share = max(1, (settings.cpus or 1) // workers)
        print(f"{workers} workers, {share} CPU{'s' if share > 1 else ''} each", file=sys.stderr, flush=True)
        sys.exit(run_workers(settings, workers, startup))
    serve_http(build_app(settings), settings)  # every model checked and loaded before binding: a bad one fails fast
