"""A served text-generation model: the artifact (tokenizer, chat template, end-of-sequence ids),
its engine replicas (usually one), each an engine core with the ``LoopDriver`` thread that steps it.

It is a ``served.ServedModel``, as the encoder's ``EncoderModel`` is (load, stop, release, ready,
in_flight, stats, metadata, OIP infer), so the data plane and the model repository handle both
alike; requests come in through ``generate``, an async iterator of ``Delta`` that the protocol
edges (OpenAI, Triton generate, OIP infer, gRPC stream) turn into their own wire format."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from tokenizers import Tokenizer

from ...cpus import available_cpus
from ...errors import InvalidInputError
from ...generation.chat.tokens import encode
from ...generation.core import Request
from ...generation.model import CoreOptions, TextGenerationModel
from ...generation.sampling import SamplingParams
from ...generation.sequence import Delta
from ...tasks import text_generation as contract
from ..http.json_api import PredictRequest, PredictResponse
from ..metrics import Metrics
from ..model import Stats, platform_of
from ..settings import ModelSpec, ServeSettings
from ..types import MODEL_VERSION, InferRequest, InferResponse, ModelMetadata, TensorSpec, request_timeout
from . import oip, resume
from ...generation.structured_output.grammars import Grammars
from ...generation.request.params import requested_constraint, sampling_params
from ...generation.structured_output.vocabulary import Vocabulary
from ...native import variant_matrix_engine
from .loop_driver import CoreHooks, Job, LoopDriver

log = logging.getLogger("modelkiln.serve")

_job_ids = itertools.count(1)

# Texts longer than this are tokenized in a thread (tokenizers releases the GIL there): tokenizing
# 4,096 characters takes about 2 ms on the event loop; an 8 MiB prompt took 4.1 s, during which no
# stream got a token.
INLINE_CHARS = 4096


class GenerationTask:
    """What the data plane asks of a model's task (name, embeds), for a text-generation model."""

    name = contract.NAME
    embeds = False


class GenerationModel:
    version = MODEL_VERSION
    task = GenerationTask()
    queue_unit = "generation requests"  # what its queue holds, for the message of a refusal
    kv_budget: int | None  # tokens of KV, every engine replica's (set by load; kiln ray's router: None)

    def __init__(self, spec: ModelSpec, settings: ServeSettings, metrics: Metrics):
        self.folder = Path(spec.path)
        self.artifact = TextGenerationModel(self.folder)
        self.manifest = self.artifact.manifest
        self.name = spec.name or self.manifest.name
        chosen = spec.variant or settings.variant
        self.variant = self.manifest.variant(chosen) if chosen else self.artifact.default_variant(settings.device)
        self.settings = settings
        self.metrics = metrics
        self.stats = Stats()
        self.ready = False
        self.in_flight = 0  # requests between submit and their last event (an unload waits for 0)
        self.max_context = self.artifact.max_context or self.manifest.max_length
        self.tokenizer = self.artifact.tokenizer
        self.defaults = self.artifact.default_params()
        # Engine replicas, each its own core batching its own streams, splitting the CPUs this server may
        # use (`--cpus` under Ray sizes them from the replica's reservation, not from the host's cores).
        cpus = settings.cpus or available_cpus().count
        self.instances = settings.generation_replicas or 1
        self.threads = settings.threads or max(1, cpus // self.instances)
        self.chat = self.artifact.chat_tokens(settings.special_tokens_in_messages)
        self.max_prompt_chars = max_prompt_chars(self.tokenizer, self.max_context)
        self._grammars: Grammars | None = None
        self._grammars_lock = threading.Lock()
        # The unit its products run on, found at load (None where the engine runs on another host: kiln ray
        # forwards a model's metadata to a replica, which says its own).
        self.matrix_engine: str | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    def load(self) -> None:
        started = time.perf_counter()
        s = self.settings
        totals = _Totals(self.metrics, self.name, self.instances)
        options = CoreOptions(threads=self.threads, device=s.device, max_running=s.max_batch_size,
                              max_waiting=s.max_queue_size, kv_budget=s.max_kv_tokens, prefill_chunk=s.prefill_chunk,
                              prefix_cache_tokens=s.prefix_cache_tokens, warm_up=s.warmup, kv_share=self.instances,
                              speculation=s.speculation)
        self.drivers = []
        for replica in range(self.instances):
            core = self.artifact.core(self.variant.name, options, _MetricHooks(self.metrics, self.name, totals, replica))
            assert core.kv_budget is not None  # TextGenerationModel.core always sizes one
            totals.budgets[replica] = core.kv_budget
            self.drivers.append(LoopDriver(core, name=f"{self.name}-{replica}" if self.instances > 1 else self.name))
        for driver in self.drivers:
            driver.start()
        self.kv_budget = sum(totals.budgets)
        v = self.variant
        self.matrix_engine = variant_matrix_engine(v.details, v.precision, v.device)
        self.metrics.model_info.labels(self.name, self.task.name, v.name, self.matrix_engine).inc()
        self.ready = True
        log.info("loaded text-generation model %s (variant %s on %s, %d engine replica(s) x %d thread(s), KV budget %d "
                 "tokens, context %d) in %.1fs", self.name, v.name, self.matrix_engine, self.instances, self.threads,
                 self.kv_budget, self.max_context, time.perf_counter() - started)

    def stop(self) -> None:
        """Refuse new requests; finish the accepted ones; end the driver threads."""
        self.ready = False
        for driver in getattr(self, "drivers", ()):
            driver.stop()

    def release(self) -> None:
        self.stop()
        if self.matrix_engine is not None:
            self.metrics.model_info.labels(self.name, self.task.name, self.variant.name, self.matrix_engine).dec()
        self.__dict__.pop("drivers", None)

    @property
    def full(self) -> bool:
        return self.queued >= self.settings.max_queue_size

    @property
    def queued(self) -> int:
        return sum(s.waiting for s in self.drivers)

    def record(self, ok: bool, seconds: float) -> None:
        s = self.stats
        if ok:
            s.success_count += 1
            s.success_ns += int(seconds * 1e9)
        else:
            s.fail_count += 1
            s.fail_ns += int(seconds * 1e9)

    # -- prompts ---------------------------------------------------------------------------------
    async def prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        """A completion prompt: text (with the tokenizer's own special tokens) or token ids."""
        if isinstance(prompt, str):
            self._check_chars(len(prompt))
            return self._fit(await _off_loop(len(prompt), encode, self.tokenizer, prompt, True))
        ids = list(prompt)
        vocab = self.tokenizer.get_vocab_size()
        if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in ids):
            raise InvalidInputError(f"a token-id prompt must hold integers in [0, {vocab})")
        return self._fit(ids)

    async def chat_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Messages (and OpenAI's ``tools``) rendered with the artifact's chat template, their text kept
        as text (``generation/chat/tokens.py``)."""
        chars = sum(len(m.get("content") or "") for m in messages) + (len(json.dumps(tools)) if tools else 0)
        self._check_chars(chars)
        if tools is None:
            return self._fit(await _off_loop(chars, self.chat.ids, messages))
        return self._fit(await _off_loop(chars, self.chat.ids, messages, tools))

    def _check_chars(self, chars: int) -> None:
        """A prompt too long for the context by its length alone is refused before it is tokenized."""
        if chars > self.max_prompt_chars and not self.settings.truncate_prompt:
            raise InvalidInputError(f"the prompt has {chars} characters, more than this model's context of "
                                    f"{self.max_context} tokens can hold (at most {self.max_prompt_chars})")

    def _fit(self, ids: list[int]) -> list[int]:
        if not ids:
            raise InvalidInputError("the prompt is empty")
        if len(ids) >= self.max_context:
            if not self.settings.truncate_prompt:
                raise InvalidInputError(f"the prompt has {len(ids)} tokens; this model's context is {self.max_context} "
                                        "tokens (the server rejects longer prompts: start it with --truncate-prompt "
                                        "to cut them from the left)")
            ids = ids[len(ids) - self.max_context + 1:]
        return ids

    @property
    def grammars(self) -> Grammars:
        """The model's grammar compiler and vocabulary, built on first use (llguidance reads
        tokenizer.json in about 0.2 s), from any thread."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = Grammars(Vocabulary(self.tokenizer, self.artifact.eos_ids))
            return self._grammars

    async def vocabulary(self) -> Vocabulary:
        return self._grammars.vocabulary if self._grammars is not None else (await asyncio.to_thread(
            lambda: self.grammars)).vocabulary

    async def params(self, fields: Mapping[str, Any], prompt_tokens: int,
                     constraint: tuple[str, Any] | None = None) -> SamplingParams:
        """The request's fields → SamplingParams; a grammar (or logit_bias's vocabulary check) is
        prepared in a thread: a large schema takes tens of milliseconds the other streams should not
        wait for. ``constraint``: one the caller derived (a tool call's syntax)."""
        if constraint is None and requested_constraint(fields) is None and fields.get("logit_bias") is None:
            return sampling_params(fields, self.defaults, prompt_tokens, self.max_context)
        return await asyncio.to_thread(lambda: sampling_params(fields, self.defaults, prompt_tokens, self.max_context,
                                                               self.grammars, constraint))

    def timeout(self, parameters: Mapping[str, Any] | None = None) -> float:
        """The server's generation timeout, or less when the request asks."""
        return request_timeout(self.settings.generation_timeout_s, parameters)

    def resume_ids(self, fields: Mapping[str, Any], prompt_ids: list[int], params: SamplingParams) -> list[int]:
        """The answer tokens a client already has (``resume_token_ids``), checked (``resume.py``)."""
        return resume.checked_resume_ids(fields, prompt_ids, params, self.tokenizer, self.artifact.eos_ids,
                                         self.max_context)

    # -- generating ------------------------------------------------------------------------------
    def generate(self, prompt_ids: list[int], params: SamplingParams, timeout_s: float | None = None,
                 resume_ids: Sequence[int] = (), seed: int | None = None) -> DeltaStream:
        """Submit now (``OverloadedError`` at once when the wait queue is full, before any answer is
        sent); the returned stream yields the answer's deltas, the last with ``finish_reason``.
        ``resume_ids``: the answer's first tokens, already sent (the stream goes on after them);
        ``seed``: the draws' seed when ``params`` has none (else the core picks one: ``Stream.seed``)."""
        return Stream(self, self.submit(prompt_ids, params, asyncio.Queue(), timeout_s, resume_ids, seed))

    def submit(self, prompt_ids: list[int], params: SamplingParams, queue: Any, timeout_s: float | None = None,
               resume_ids: Sequence[int] = (), seed: int | None = None) -> Job:
        """``generate``'s request on the engine replica with the fewest requests admitted or waiting
        (rows free soonest there); its events go to ``queue`` (``put_nowait``, on this event loop):
        a ``Delta`` per token, or the error that ends it. Refused at once as ``generate`` is."""
        timeout_s = timeout_s or self.settings.generation_timeout_s
        driver = min(self.drivers, key=lambda s: s.running + s.waiting)
        job = Job(next(_job_ids), prompt_ids, params, deadline=time.monotonic() + timeout_s,
                  resume_ids=list(resume_ids), seed=params.seed if params.seed is not None else seed,
                  loop=asyncio.get_running_loop(), queue=queue, driver=driver)
        driver.submit(job)
        return job

    # -- protocol description ----------------------------------------------------------------------
    def input_specs(self) -> tuple[TensorSpec, ...]:
        return contract.INPUTS

    def output_specs(self) -> tuple[TensorSpec, ...]:
        return contract.OUTPUTS

    # -- what the data plane calls (served.ServedModel) ---------------------------------------------
    def metadata(self) -> ModelMetadata:
        return ModelMetadata(
            name=self.name, versions=(self.version,), platform=platform_of(self.variant.engine),
            inputs=self.input_specs(),
            outputs=self.output_specs(), parameters={"task": self.task.name, "variant": self.variant.name,
                                                     "matrix_engine": self.matrix_engine,
                                                     "max_context": self.max_context,
                                                     "kv_tokens": self.kv_budget if self.ready else None,
                                                     "decoupled": True})

    async def _start_oip(self, request: InferRequest) -> DeltaStream:
        """An OIP request checked and submitted: its deltas (a 4xx or 503 error before any)."""
        ids = await self.prompt_ids(oip.prompt(request))
        params = await self.params(oip.sampling_fields(request.parameters), len(ids))
        return self.generate(ids, params, self.timeout(request.parameters))

    async def infer(self, request: InferRequest) -> InferResponse:
        """OIP infer (and gRPC's ModelInfer): the whole answer as one ``text_output``."""
        started = time.perf_counter()
        try:
            async with await self._start_oip(request) as stream:
                pieces = [delta.text async for delta in stream]
        except BaseException:
            self.record(False, time.perf_counter() - started)
            raise
        self.record(True, time.perf_counter() - started)
        return oip.response(self.name, self.version, request, "".join(pieces),
                            {"finish_reason": stream.finish_reason or "", "seed": stream.seed})

    async def stream_infer(self, request: InferRequest) -> AsyncIterator[InferResponse]:
        """Triton's decoupled responses (gRPC's ModelStreamInfer): one per token that adds text, the
        last flagged ``triton_final_response`` (with ``finish_reason``); closing early cancels."""
        started = time.perf_counter()
        ok = False
        try:
            async with await self._start_oip(request) as stream:
                async for delta in stream:
                    if delta.finish_reason is not None:
                        yield oip.response(self.name, self.version, request, delta.text,
                                           {"triton_final_response": True, "finish_reason": delta.finish_reason})
                    elif delta.text:
                        yield oip.response(self.name, self.version, request, delta.text,
                                           {"triton_final_response": False})
            ok = True
        finally:
            self.record(ok, time.perf_counter() - started)

    async def predict(self, request: PredictRequest) -> PredictResponse:
        raise InvalidInputError(f"model '{self.name}' generates text: use /v2/models/{self.name}/generate, "
                                "/v1/completions or /v1/chat/completions")


class EnginelessGenerationModel(GenerationModel):
    """A served text-generation model whose engine runs in another process (kiln ray's replicas, the
    engine process of ``kiln serve --workers N``): prompts, chat templates, settings and their checks
    are this process's, on the artifact's tokenizer, so a bad request gets its 4xx here; ``generate``
    sends the rest away. Its queue is the engine's, which refuses (503) when full."""

    def __init__(self, spec: ModelSpec, settings: ServeSettings, metrics: Metrics):
        super().__init__(spec, settings, metrics)
        self.kv_budget = None  # the engine's (its metadata says)

    def load(self) -> None:
        self.ready = True

    def stop(self) -> None:
        self.ready = False

    def release(self) -> None:
        self.stop()

    @property
    def full(self) -> bool:
        return False

    @property
    def queued(self) -> int:
        return 0


class DeltaStream(Protocol):
    """What the protocol edges read from an answer's stream: ``Stream`` (this process's engine) or
    kiln ray's ``RemoteStream`` (a replica's), which ``generate`` returns."""

    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None

    @property
    def seed(self) -> int: ...
    async def started(self) -> None: ...
    def __aiter__(self) -> DeltaStream: ...
    async def __anext__(self) -> Delta: ...
    async def aclose(self) -> None: ...
    async def __aenter__(self) -> Any: ...
    async def __aexit__(self, *exc: object) -> None: ...


class OpenStream:
    """What every stream of deltas shares: it counts in its model's ``in_flight`` until closed, and
    closing it (``aclose``, leaving ``async with``) before its end cancels it (``_cancel``)."""

    model: Any
    finish_reason: str | None
    completion_tokens: int
    _open: bool

    async def aclose(self) -> None:
        self._close(cancel=self.finish_reason is None)

    async def __aenter__(self) -> Any:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _close(self, cancel: bool) -> None:
        if self._open:
            self._open = False
            self.model.in_flight -= 1
            if cancel:
                self._cancel()

    def _cancel(self) -> None:
        raise NotImplementedError

    def _next(self, event: Delta | BaseException, resumed: bool) -> Delta:
        """An event of the engine's, as the edges get it: an error ends the stream (raised); a delta
        counts, and the last one closes it. ``resumed``: the answer began with the client's tokens,
        so the prompt's log-probabilities went out before."""
        if isinstance(event, BaseException):
            self._close(cancel=False)
            raise event
        self.completion_tokens += 1
        if resumed:
            event.prompt_logprobs = None
        if event.finish_reason is not None:
            self.finish_reason = event.finish_reason
            self._close(cancel=False)
        return event


class Stream(OpenStream):
    """One request's deltas. ``aclose`` (or leaving ``async with``) before the end cancels it: the
    driver frees its sequence before its next step. The protocol edges always close it."""

    def __init__(self, model: GenerationModel, job: Job):
        self.model = model
        self.job = job
        self.prompt_tokens = len(job.prompt_ids)
        self.completion_tokens = len(job.resume_ids)  # a resumed answer's usage counts the whole answer
        self.finish_reason: str | None = None
        self._open = True
        model.in_flight += 1

    @property
    def seed(self) -> int:
        """The seed of the answer's draws (the request's, or the one the core chose): with it and
        the tokens sent, a client can resume the answer elsewhere (``resume_token_ids``)."""
        assert self.job.seed is not None  # set when the core accepted the request
        return self.job.seed

    async def started(self) -> None:
        """Accepted: ``generate`` submitted the request before returning."""

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> Delta:
        if self.finish_reason is not None or not self._open:
            raise StopAsyncIteration
        assert self.job.queue is not None
        return self._next(await self.job.queue.get(), bool(self.job.resume_ids))

    def _cancel(self) -> None:
        if self.job.driver is not None:
            self.job.driver.cancel(self.job)


async def _off_loop(chars: int, work: Callable[..., list[int]], *args: Any) -> list[int]:
    """``work(*args)``: at once for a short text, in a thread for a long one (``INLINE_CHARS``)."""
    if chars <= INLINE_CHARS:
        return work(*args)
    return await asyncio.to_thread(work, *args)


def max_prompt_chars(tokenizer: Tokenizer, max_context: int) -> int:
    """The most characters a prompt of ``max_context`` tokens can have: no token of a byte-level or
    SentencePiece vocabulary covers more characters than its own spelling has (bytes, or "▁" for a
    space). A normalizer may shorten the text first: NFC composes at most 4 characters into one."""
    longest = max((len(token) for token in tokenizer.get_vocab()), default=1)
    return max_context * longest * (1 if tokenizer.normalizer is None else 4)


class _Totals:
    """The gauges a model reports once for all its engine replicas: each replica's last iteration, summed."""

    def __init__(self, metrics: Metrics, name: str, replicas: int):
        self.running = metrics.requests_running.labels(name)
        self.waiting = metrics.requests_waiting.labels(name)
        self.kv_usage = metrics.kv_cache_usage.labels(name)
        self.budgets = [1] * replicas
        self._last = [(0, 0, 0)] * replicas

    def iteration(self, replica: int, running: int, waiting: int, cache_tokens: int) -> None:
        self._last[replica] = (running, waiting, cache_tokens)  # one list item: safe across replica threads
        last = list(self._last)
        self.running.set(sum(r for r, _, _ in last))
        self.waiting.set(sum(w for _, w, _ in last))
        self.kv_usage.set(min(1.0, sum(c for _, _, c in last) / sum(self.budgets)))


class _MetricHooks(CoreHooks):
    """An engine replica's events → vLLM-named Prometheus metrics (called on its driver thread)."""

    def __init__(self, metrics: Metrics, name: str, totals: _Totals, replica: int):
        self.totals, self.replica = totals, replica
        self.ttft = metrics.time_to_first_token.labels(name)
        self.itl = metrics.inter_token_latency.labels(name)
        self.e2e = metrics.e2e_latency.labels(name)
        self.prompt_tokens = metrics.prompt_tokens.labels(name)
        self.prefix_queries = metrics.prefix_cache_queries.labels(name)
        self.prefix_hits = metrics.prefix_cache_hits.labels(name)
        self.generation_tokens = metrics.generation_tokens.labels(name)
        self.spec_drafts = metrics.spec_decode_drafts.labels(name)
        self.spec_draft_tokens = metrics.spec_decode_draft_tokens.labels(name)
        self.spec_accepted_tokens = metrics.spec_decode_accepted_tokens.labels(name)

    def token(self, job: Request, now: float) -> None:
        if job.first_token_at == 0.0:
            self.ttft.observe(now - job.arrived)
            self.prompt_tokens.inc(len(job.prompt_ids))
        else:
            self.itl.observe(now - job.last_token_at)
        self.generation_tokens.inc()

    def prefix(self, job: Request, cached_tokens: int) -> None:
        self.prefix_queries.inc(len(job.prompt_ids))
        self.prefix_hits.inc(cached_tokens)

    def finished(self, job: Request, now: float) -> None:
        self.e2e.observe(now - job.arrived)

    def iteration(self, running: int, waiting: int, cache_tokens: int) -> None:
        self.totals.iteration(self.replica, running, waiting, cache_tokens)

    def speculated(self, job: Request, drafted: int, accepted: int) -> None:
        self.spec_drafts.inc()
        self.spec_draft_tokens.inc(drafted)
        self.spec_accepted_tokens.inc(accepted)
