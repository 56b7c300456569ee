"""Server settings: one frozen dataclass. Defaults come from ``KILN_*`` environment variables,
CLI flags override them (see ``command.py``), and nothing else reads the environment."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from typing import Any

from ..errors import KilnError

ENV_PREFIX = "KILN_"


@dataclass(frozen=True)
class ModelSpec:
    """One model to serve: its public name, its artifact folder and the variant to run."""

    name: str
    path: str
    variant: str | None = None  # None: the fastest kept variant for ``device``


@dataclass(frozen=True)
class ServeSettings:
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 8000
    api_key: str | None = None  # bearer token required on every route but health
    device: str = "cpu"
    variant: str | None = None  # default variant for models given without one
    threads: int | None = None  # onnxruntime intra-op threads per instance (None: cores / instances)
    instances: int | None = None  # engine sessions per model run in parallel (None: 2 on CPU, 1 on GPU)
    # threads of the session that runs a lone request on an idle server (see Batcher: ``alone``):
    # None = every core, 0 = no such session
    alone_threads: int | None = None
    # batching
    max_batch_size: int = 32  # inputs per model batch
    # Padded tokens per model batch, rows × longest row (None: 1024 on CPU, 8192 on GPU). It bounds
    # a batch's activation memory. On CPU long inputs gain nothing from batching (int8
    # all-MiniLM-L6-v2: 60 sequences/s at 1 × 128 tokens, 62 at 8 × 128), and a backlog of long
    # SQuAD paragraphs took the server to a 1.0 GB peak with 8192, 552 MB with 2048, 424 MB with 1024.
    max_batch_tokens: int | None = None
    # Padding a batch may add, as a fraction of its real tokens (None: 0.15 on CPU, 1.0 on GPU).
    # Measured on all-MiniLM-L6-v2 int8, 2 cores, STS-B sentences, 16 clients in process: no
    # limit 330-350 req/s, 0.5 ~390, 0.15 ~440-470, 0 (equal lengths only) ~410. On CPU a batch of
    # short texts runs little faster per text than one text alone, so padding is pure loss.
    max_padding: float | None = None
    max_queue_delay_ms: float = 0.0  # extra wait for a fuller batch; 0 = run whatever is queued
    max_queue_size: int = 1024  # inputs waiting; beyond that requests get 503 at once
    # limits
    request_timeout_s: float = 30.0
    max_body_bytes: int = 8 * 1024 * 1024
    body_read_timeout_s: float = 10.0  # a body not fully received by then is answered 408 (stalled clients)
    max_inputs_per_request: int = 256
    max_input_chars: int = 100_000  # checked before tokenizing (bounds tokenizer work)
    truncate: bool = True  # inputs longer than the model's max_length: truncate, or reject (400)
    # operations
    warmup: bool = True
    log_level: str = "info"
    access_log: bool = False  # one line per request, with its request id
    model_repository: str | None = None  # a folder of artifact folders (Triton's model repository)
    model_control_mode: str = "none"  # none | explicit | poll (see serve/repository.py)
    repository_poll_s: float = 15.0  # poll mode: seconds between scans of the repository
    models: tuple[ModelSpec, ...] = field(default_factory=tuple)

    def token_budget(self) -> int:
        if self.max_batch_tokens is not None:
            return self.max_batch_tokens
        return 1024 if self.device == "cpu" else 8192

    def padding_limit(self) -> float:
        if self.max_padding is not None:
            return self.max_padding
        return 0.15 if self.device == "cpu" else 1.0

    def engine_layout(self) -> tuple[int, int, int]:
        """(instances, threads each, threads for a batch run alone; 0 = none).

        Under load, two single-threaded sessions beat one two-threaded session on a 2-core box
        (measured: 541 vs 430 sentences/s at batch 8; onnxruntime's pool threads also spin between
        ops and starve the event loop). A lone request on an idle server, though, leaves a core
        unused that way; a third session using every core runs it (3.1 → 2.2 ms at batch 1)."""
        cpus = os.cpu_count() or 1
        instances = self.instances or (1 if self.device != "cpu" else min(2, cpus))
        threads = self.threads or max(1, cpus // instances)
        alone = cpus if self.alone_threads is None else self.alone_threads
        if self.device != "cpu" or instances < 2 or alone <= threads:
            alone = 0  # nothing to gain: the instances already use the cores a lone batch could
        return instances, threads, alone

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, config: dict[str, Any] | None = None,
                 **overrides: Any) -> ServeSettings:
        """Defaults ← a config file's values (``kiln serve --config``, written by ``kiln tune``) ←
        ``KILN_<FIELD>`` env vars ← explicit overrides (None means "not given")."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = dict(config or {})
        for f in fields(cls):
            if f.name == "models":
                continue
            raw = env.get(ENV_PREFIX + f.name.upper())
            if raw is not None and raw != "":
                values[f.name] = _parse(f.name, str(f.type), raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        settings = cls(**values)
        settings.check()
        return settings

    def with_models(self, models: tuple[ModelSpec, ...]) -> ServeSettings:
        return replace(self, models=models)

    def check(self) -> None:
        positive = ("max_batch_size", "max_batch_tokens", "max_queue_size", "max_body_bytes",
                    "max_inputs_per_request", "max_input_chars")
        for name in positive:
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise KilnError(f"{name} must be positive, got {getattr(self, name)}")
        if self.instances is not None and self.instances < 1:
            raise KilnError("instances must be at least 1")
        if self.max_padding is not None and self.max_padding < 0:
            raise KilnError("max_padding must not be negative")
        if self.alone_threads is not None and self.alone_threads < 0:
            raise KilnError("alone_threads must be 0 (off) or positive")
        if self.request_timeout_s <= 0 or self.max_queue_delay_ms < 0:
            raise KilnError("request_timeout_s must be positive and max_queue_delay_ms not negative")


def _parse(name: str, kind: str, raw: str) -> Any:
    try:
        if "bool" in kind:
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if kind.startswith("int"):
            return int(raw)
        if kind.startswith("float"):
            return float(raw)
        if "int" in kind and "None" in kind:  # int | None
            return int(raw)
        return raw
    except ValueError:
        raise KilnError(f"{ENV_PREFIX}{name.upper()}={raw!r} is not a valid {kind}") from None


def parse_model_arg(arg: str, default_variant: str | None) -> ModelSpec:
    """``PATH`` (name = the artifact's name) or ``NAME=PATH``; the name is filled in at load."""
    name, sep, path = arg.partition("=")
    if not sep:
        return ModelSpec(name="", path=arg, variant=default_variant)
    if not name or not path:
        raise KilnError(f"model argument '{arg}' must be PATH or NAME=PATH")
    return ModelSpec(name=name, path=path, variant=default_variant)
