"""Server settings, declared once. Each field carries its default, help, validation (ranges,
enums) and whether ``kiln tune`` may sweep it; everything else is derived from this class:

- ``KILN_<FIELD>`` environment variables (``ServeSettings.from_env``),
- the ``kiln serve`` flags and their help (``serve/command.py``: ``cli_flag``, ``help_line``),
- the ``--config`` file's validation (``serve/config_file.py``),
- ``kiln tune``'s options and the flags it sweeps for each kind of model (``sweepable``,
  ``sweep_default``, ``applies``: ``tune/``).

A frozen pydantic model rather than pydantic-settings' ``BaseSettings``: ``BaseSettings`` reads
``os.environ`` on every construction, so ``ServeSettings()`` in a test or a library caller would
pick up whatever ``KILN_*`` variables the shell has, and it cannot read an environment given as a
dict. Here only ``from_env`` reads the environment, and it is twenty lines. Pydantic does the
parsing (lax for env strings, strict for the JSON config file) and the range checks."""

from __future__ import annotations

import os
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Optional, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.fields import FieldInfo

from ..cpus import available_cpus
from ..errors import KilnError
from ..generation.speculation import (DEFAULT_DRAFT_TOKENS, DRAFT_MODEL, DRAFT_MODEL_HELP, DRAFT_TOKENS_HELP, METHOD_HELP,
                                      METHODS, SpeculationOptions)

if TYPE_CHECKING:
    from pydantic.config import JsonDict

ENV_PREFIX = "KILN_"


@dataclass(frozen=True)
class ModelSpec:
    """One model to serve: its public name, its artifact folder and the variant to run."""

    name: str
    path: str
    variant: str | None = None  # None: the fastest kept variant for ``device``


MODEL_KINDS = ("encoder", "generation")  # what kiln tune sweeps differs between them (``sweep=``)


def setting(default: Any, help: str, *, sweep: str | Mapping[str, str] | None = None,
            used_with: Mapping[str, Sequence[str]] | None = None, flag: str | None = None,
            shown_default: str | None = None, **checks: Any) -> Any:
    """A declared setting. ``help`` is the flag's help (env var and default are appended);
    ``sweep``: ``kiln tune`` may try several values of it, by default these (comma-separated;
    ``auto``: the server's default; ``kept``: every kept CPU variant; empty: none, the server's
    default runs unless values are given), for every model kind, or ``{kind: values}`` for the
    kinds of ``MODEL_KINDS`` it applies to; ``used_with``: ``{other setting: its values}`` where
    this one has an effect only while the other takes one of those values (``applies``);
    ``flag``: the CLI flag when it is not ``--field-name``; ``shown_default``: how help shows a
    default of None ("cores / instances"); ``checks``: pydantic constraints (ge, gt, le)."""
    extra = {"sweep": sweep, "used_with": used_with, "flag": flag, "shown_default": shown_default}
    # the declaration's own metadata (read back by _meta): strings and a {kind: values} mapping, JSON all the same
    return Field(default, description=help, json_schema_extra=cast("JsonDict", extra), **checks)


class ServeSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    # --- network
    host: str = setting("127.0.0.1", "Bind address.")  # loopback unless told otherwise
    port: int = setting(8000, "HTTP port.", ge=0, le=65535)
    grpc_port: int = setting(8001, "KServe v2 gRPC port (0 = off).", ge=0, le=65535)
    api_key: Optional[str] = setting(None, "Require 'Authorization: Bearer KEY' on every route but health and "
                                             "the web page's files.",
                                     shown_default="none")
    # --- engines
    device: Literal["cpu", "cuda"] = setting("cpu", "cpu or cuda.")
    variant: Optional[str] = setting(None, "Variant for every model given without one: int8, fp32, ...",
                                     sweep="kept", shown_default="fastest kept for the device")
    # A server sharing its host (a Ray replica given N CPUs, a process pinned with taskset, a
    # container with a CPU quota) sizes its engine threads from its share (``modelkiln.cpus``).
    cpus: Optional[int] = setting(None, "CPUs this server may use (at most what it may run on); engine threads are "
                                        "sized from it.", ge=1, shown_default="its affinity mask or cgroup quota")
    # kiln tune tries 1- and 2-thread sessions, each with as many instances as the CPUs allow
    # (engine_layout): the default and its neighbour, on 2 cores as on 16.
    threads: Optional[int] = setting(None, "onnxruntime intra-op threads per instance.",
                                     sweep={"encoder": "1,2", "generation": "auto"}, ge=1,
                                     shown_default="2, 1 under 4 cpus; cpus / instances when instances are given")
    instances: Optional[int] = setting(None, "Engine sessions per model running batches in parallel.",
                                       sweep={"encoder": "auto"}, ge=1,
                                       shown_default="cpus / threads on CPU, 1 on GPU")
    # The event loop and the engine threads' Python work share one interpreter lock per process;
    # worker processes each have their own (docs/serve.md: "Worker processes").
    workers: Optional[int] = setting(None, "Server processes sharing the ports, each with its own event loop, models "
                                           "and share of the cpus.", sweep={"encoder": "auto"}, ge=1,
                                     shown_default="1 per 4 cpus; 1 for text-generation models")
    # The session that runs a lone request on an idle server (see Batcher: ``alone``).
    alone_threads: Optional[int] = setting(
        None, "Threads for a lone request on an idle server, in a session of its own (0 = off).",
        sweep={"encoder": "auto"}, ge=0, shown_default="all cpus")
    # --- batching
    # Generation: with more streams than this, the others wait for a running one to end before their first token.
    max_batch_size: int = setting(32, "Inputs per model batch (generation: sequences running together).",
                                  sweep={"encoder": "32", "generation": "8,16"}, gt=0)
    # It bounds a batch's activation memory. On CPU long inputs gain nothing from batching (int8
    # all-MiniLM-L6-v2: 60 sequences/s at 1 × 128 tokens, 62 at 8 × 128), and a backlog of long
    # SQuAD paragraphs took the server to a 1.0 GB peak with 8192, 552 MB with 2048, 424 MB with 1024.
    max_batch_tokens: Optional[int] = setting(None, "Padded tokens per model batch (rows × longest row).",
                                              sweep={"encoder": "auto"}, gt=0, shown_default="1024 on CPU, 8192 on GPU")
    # Measured on all-MiniLM-L6-v2 int8, 2 cores, STS-B sentences, 16 clients in process: no
    # limit 330-350 req/s, 0.5 ~390, 0.15 ~440-470, 0 (equal lengths only) ~410. On CPU a batch of
    # short texts runs little faster per text than one text alone, so padding is pure loss.
    max_padding: Optional[float] = setting(None, "Padding a batch may add, as a fraction of its real tokens.",
                                           sweep={"encoder": "auto"}, ge=0, shown_default="0.15 on CPU, 1.0 on GPU")
    max_queue_delay_ms: float = setting(0.0, "Extra wait for a fuller batch, ms (0 = run whatever is queued).",
                                        sweep={"encoder": "0,2"}, ge=0)
    max_queue_size: int = setting(1024, "Inputs (generation: requests) waiting before requests get 503 at once.", gt=0)
    # --- limits
    request_timeout_s: float = setting(30.0, "Seconds per request.", flag="--request-timeout", gt=0)
    body_read_timeout_s: float = setting(10.0, "Seconds to receive a request's head, and then its body.", flag="--body-read-timeout", gt=0)
    max_body_bytes: int = setting(8 * 1024 * 1024, "Largest request body, bytes.", gt=0, shown_default="8 MiB")
    max_inputs_per_request: int = setting(256, "Inputs per request.", gt=0)
    max_input_chars: int = setting(100_000, "Characters per input, checked before tokenizing.", gt=0)
    truncate: bool = setting(True, "Cut inputs longer than the model's max length, or reject them (400).")
    # --- text generation (serve/generation/loop_driver.py)
    max_kv_tokens: Optional[int] = setting(
        None, "Generation: KV-cache tokens for the running sequences (each its prompt + max tokens) and cached "
              "prefixes (full: requests wait, cached prefixes are dropped first).",
        gt=0, shown_default="1/4 of memory, at most max-batch-size x context")
    prefix_cache_tokens: Optional[int] = setting(
        None, "Generation: tokens of prompt-prefix KV kept for the prompts that follow (chat templates, system "
              "prompts; answers are the same with or without); 0: off.", ge=0,
        shown_default="1/8 of max-kv-tokens, at most 2048")
    generation_replicas: Optional[int] = setting(
        None, "Generation: engine replicas, each batching its own streams on its share of the CPUs (each loads the "
              "weights once more).", sweep={"generation": "1,2"}, gt=0, shown_default="1")
    prefill_chunk: Optional[int] = setting(
        None, "Generation: prompt tokens prefilled per scheduler step (running streams get a token between "
              "chunks).", sweep={"generation": "128"}, gt=0, shown_default="128; 2048 for a torch variant on CUDA")
    # Answers are the same with or without (generation/speculation/); the choices are METHODS there.
    # kiln tune sweeps these only when asked (sweep ""): its default load runs 16 streams, where
    # speculation drafts nothing (it drafts while at most 2 streams decode: speculation/policy.py,
    # MAX_ROWS), and variants without KilnAttention ignore it, so trying "off,ngram" by default would
    # double a default grid whose configurations take 2-4 minutes each, to measure the same server twice.
    speculate: Literal["off", "ngram", "draft-model"] = setting("off", "Generation: " + METHOD_HELP,
                                                               sweep={"generation": ""})
    draft_tokens: int = setting(DEFAULT_DRAFT_TOKENS, "Generation: " + DRAFT_TOKENS_HELP, gt=0, sweep={"generation": ""},
                                used_with={"speculate": [m for m in METHODS if m != "off"]})
    draft_model: Optional[str] = setting(None, "Generation: " + DRAFT_MODEL_HELP, shown_default="none",
                                         sweep={"generation": ""}, used_with={"speculate": [DRAFT_MODEL]})
    generation_timeout_s: float = setting(600.0, "Generation: seconds per request, waiting and generating.",
                                          flag="--generation-timeout", gt=0)
    truncate_prompt: bool = setting(False, "Generation: cut prompts longer than the context from the left "
                                           "instead of answering 400.")
    # A user who writes "<|im_end|>" in a message would otherwise end their turn and write the
    # assistant's (generation/chat/tokens.py).
    special_tokens_in_messages: bool = setting(False, "Generation: read special tokens written in chat messages "
                                                      "(<|im_end|>...) as control tokens, not as text.")
    # Each kept response holds its conversation (at most a context's worth of text), for
    # previous_response_id; count-bounded as OpenAI's store has no size (serve/generation/responses_routes.py).
    stored_responses: int = setting(1000, "Generation: responses kept for the Responses API's previous_response_id "
                                          "and GET /v1/responses/ID, the least recently used dropped first (0: none).",
                                    ge=0)
    # --- model repository (Triton's repository extension)
    model_repository: Optional[str] = setting(None, "A folder of artifact folders to serve.", shown_default="none")
    model_control_mode: Literal["none", "explicit", "poll"] = setting(
        "none", "none: serve the repository as found; explicit: load/unload on request; poll: follow the folder.")
    repository_poll_s: float = setting(15.0, "Seconds between repository scans (poll mode).", gt=0)
    # --- operations
    warmup: bool = setting(True, "Run warm-up batches at load.")
    log_level: Literal["debug", "info", "warning", "error", "critical"] = setting("info", "Log level.")
    access_log: bool = setting(False, "Log every request with its id.")
    # The page asks the API for everything it shows, with the key the user types (serve/ui/);
    # the page itself needs no key, as llama-server's.
    ui: bool = setting(True, "Serve the web page at /: the models, a chat playground, an encoder form and live "
                             "figures from /metrics.")
    # given as arguments (kiln serve ARTIFACT...), not as flags, env vars or config keys
    models: tuple[ModelSpec, ...] = Field(default=(), json_schema_extra={"argument": True})

    def token_budget(self) -> int:
        if self.max_batch_tokens is not None:
            return self.max_batch_tokens
        return 1024 if self.device == "cpu" else 8192

    def padding_limit(self) -> float:
        if self.max_padding is not None:
            return self.max_padding
        return 0.15 if self.device == "cpu" else 1.0

    def engine_layout(self) -> tuple[int, int, int]:
        """(instances, threads each, threads for a batch run alone; 0 = none), for this process's
        ``cpus`` (a worker's share with ``--workers``).

        Sessions of two threads, as many as the cpus allow; of one thread under 4 cpus. One
        onnxruntime session barely speeds up past 2 threads: on a 16-core Intel Xeon
        (all-MiniLM-L6-v2 int8, hey at 256 connections) 8 sessions x 2 threads served 1,884-2,116
        req/s, 16 x 1 1,547 and 2 x 8 1,000. On 2 cores two single-threaded sessions beat one
        two-threaded session (541 vs 430 sentences/s at batch 8; onnxruntime's pool threads also
        spin between ops and starve the event loop). A lone request on an idle server, though,
        leaves cores unused that way; a session using every cpu runs it (3.1 → 2.2 ms at batch 1
        on 2 cores)."""
        cpus = self.cpus or available_cpus().count
        if self.device != "cpu":
            instances, threads = self.instances or 1, self.threads or max(1, cpus)
        elif self.instances and not self.threads:
            instances, threads = self.instances, max(1, cpus // self.instances)
        else:
            threads = self.threads or (1 if cpus < 4 else 2)
            instances = self.instances or max(1, cpus // threads)
        alone = cpus if self.alone_threads is None else self.alone_threads
        if self.device != "cpu" or instances < 2 or alone <= threads:
            alone = 0  # nothing to gain: the instances already use the cores a lone batch could
        return instances, threads, alone

    def worker_count(self, generation: bool) -> int:
        """How many server processes (``--workers``, else one per 4 of ``cpus``; one when a model
        generates text). One process's event loop and engine threads share an interpreter lock:
        on a 16-core Intel Xeon one process served at most ~2,000 req/s (8 x 2 sessions, the
        event loop at 300-335 µs of CPU per request and answers waiting 38-69 ms for it), where
        its sessions alone ran 4,384 sentences/s. A 2-core server does ~610 req/s, ~300 per
        core, so a process of 4 cpus needs ~1,200 req/s, within what one process reaches; 8 would
        need ~2,400. Text generation runs one engine over every cpu (its continuous batching is
        one scheduler), so its engines stay in one process: ``--workers`` above 1 puts them in an engine
        process with the workers as its fronts (``generation/engine_process.py``), for a GPU's token rate."""
        if self.workers is not None:
            return self.workers
        cpus = self.cpus or available_cpus().count
        return 1 if generation or self.device != "cpu" else max(1, cpus // 4)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, config: Mapping[str, Any] | None = None,
                 **overrides: Any) -> ServeSettings:
        """Defaults ← a config file's values (``kiln serve --config``, written by ``kiln tune``) ←
        ``KILN_<FIELD>`` env vars ← explicit overrides (None means "not given"). Env values are
        strings that pydantic parses (``"9"`` → 9, ``"false"`` → False); an empty one is unset."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = dict(config or {})
        sources = {name: "config file" for name in values}
        for name in declared():
            raw = env.get(env_var(name))
            if raw:
                values[name], sources[name] = raw, f"{env_var(name)}={raw!r}"
        for name, value in overrides.items():
            if value is not None:
                values[name], sources[name] = value, f"{cli_flag(name)} {value!r}"
        try:
            settings = cls.model_validate(values)
        except ValidationError as exc:
            raise KilnError(describe_error(exc, sources)) from None
        settings.check()
        return settings

    def replace(self, **changes: Any) -> ServeSettings:
        """A copy with some settings changed, validated like any other (a bad value: KilnError)."""
        try:
            return self.model_validate({**{name: getattr(self, name) for name in type(self).model_fields}, **changes})
        except ValidationError as exc:
            raise KilnError(describe_error(exc)) from None

    def with_models(self, models: tuple[ModelSpec, ...]) -> ServeSettings:
        return self.model_copy(update={"models": tuple(models)})

    def check(self) -> None:
        """Rules across fields (each field's own range is checked at construction)."""
        if self.model_control_mode != "none" and not self.model_repository:
            raise KilnError(f"model_control_mode {self.model_control_mode} needs a model repository "
                            f"({cli_flag('model_repository')} DIR)")
        try:
            self.speculation  # noqa: B018 - its own rules (draft-model needs --draft-model)
        except ValueError as exc:
            raise KilnError(str(exc)) from None

    @property
    def speculation(self) -> SpeculationOptions:
        """The generation engines' speculation options, from --speculate, --draft-tokens, --draft-model."""
        return SpeculationOptions(self.speculate, self.draft_tokens, self.draft_model)


# --- what the rest of the code derives from the declaration -----------------------------------


def declared() -> dict[str, FieldInfo]:
    """The settings a user can set (flags, env vars, config keys), in declaration order."""
    return {name: f for name, f in ServeSettings.model_fields.items() if not _meta(f).get("argument")}


def _meta(f: FieldInfo) -> dict[str, Any]:
    return f.json_schema_extra if isinstance(f.json_schema_extra, dict) else {}


def env_var(name: str) -> str:
    return ENV_PREFIX + name.upper()


def cli_flag(name: str) -> str:
    f = ServeSettings.model_fields.get(name)
    return (_meta(f).get("flag") if f else None) or "--" + name.replace("_", "-")


def sweep_default(name: str, kind: str) -> str | None:
    """The values ``kiln tune`` tries by default for a model of ``kind`` (None: not swept for it)."""
    if kind not in MODEL_KINDS:
        raise ValueError(f"model kind {kind!r} is not one of {MODEL_KINDS}")
    sweep = _meta(ServeSettings.model_fields[name]).get("sweep")
    return sweep.get(kind) if isinstance(sweep, Mapping) else sweep


def value_type(name: str) -> Any:
    """The field's type without None (``int | None`` → int)."""
    kind = ServeSettings.model_fields[name].annotation
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        kind = next(k for k in typing.get_args(kind) if k is not type(None))
    return kind


def shown_default(name: str) -> str:
    f = ServeSettings.model_fields[name]
    shown = _meta(f).get("shown_default")
    if shown is not None:
        return shown
    if isinstance(f.default, bool):
        return "on" if f.default else "off"
    return f"{f.default:g}" if isinstance(f.default, float) else str(f.default)


def help_line(name: str) -> str:
    """The flag's help: what it does, its env var and its default."""
    return f"{ServeSettings.model_fields[name].description} (env {env_var(name)}, default {shown_default(name)})"


def choices(name: str) -> tuple[Any, ...] | None:
    """The values a setting declared as a ``Literal`` may take (None: not a choice)."""
    kind = value_type(name)
    return typing.get_args(kind) if typing.get_origin(kind) is Literal else None


def used_with(name: str) -> Mapping[str, Sequence[Any]]:
    """The other settings ``name`` has an effect with, each with the values it needs (empty: always)."""
    return _meta(ServeSettings.model_fields[name]).get("used_with") or {}


def applies(name: str, values: Mapping[str, Any]) -> bool:
    """Whether the setting ``name`` has an effect beside these ``values`` of the others (absent or
    None: the other's default): ``draft_tokens`` only while ``speculate`` is not off."""
    for other, needed in used_with(name).items():
        value = values.get(other)
        if (ServeSettings.model_fields[other].default if value is None else value) not in needed:
            return False
    return True


def sweepable(kind: str | None = None) -> tuple[str, ...]:
    """The settings ``kiln tune`` may sweep (declared with ``sweep=...``) for a model of ``kind``
    (None: for any kind), in declaration order."""
    kinds = MODEL_KINDS if kind is None else (kind,)
    return tuple(name for name in declared() if any(sweep_default(name, k) is not None for k in kinds))


def describe_error(exc: ValidationError, sources: Mapping[str, str] | None = None) -> str:
    """The first problem as one line that names the setting and where its value came from."""
    error = exc.errors()[0]
    name = str(error["loc"][0]) if error["loc"] else "settings"
    message = error["msg"].replace("Input should be", "must be")
    if error["type"] == "extra_forbidden":
        return f"unknown setting '{name}'"
    where = (sources or {}).get(name)
    return f"{name} {message}" + (f" (from {where})" if where else f", got {error.get('input')!r}")


def parse_model_arg(arg: str, default_variant: str | None) -> ModelSpec:
    """``PATH`` (name = the artifact's name) or ``NAME=PATH``; the name is filled in at load."""
    name, sep, path = arg.partition("=")
    if not sep:
        return ModelSpec(name="", path=arg, variant=default_variant)
    if not name or not path:
        raise KilnError(f"model argument '{arg}' must be PATH or NAME=PATH")
    return ModelSpec(name=name, path=path, variant=default_variant)
