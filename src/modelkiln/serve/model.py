"""A served encoder model: manifest + task + tokenizer + engine (the variant's: runtime/registry.py)
+ its own batcher.

The stages are the runtime's and the task's (``task.prepare`` / ``TextEncoder`` /
``task.postprocess``); this module runs them on the batcher's engine threads, and shapes an OIP
or /predict request into inputs and the answers back into tensors, on the event loop.
``EncoderModel`` is one of the two kinds of ``served.ServedModel``."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InvalidInputError, KilnError, RequestTimeoutError
from ..manifest import Manifest
from ..runtime.pipeline import load_encoder, load_variant
from ..machine import cpu_flags, matrix_engine
from ..runtime.registry import capabilities, engine_kind
from ..tasks import make_task
from ..tasks import tensors as tensors_protocol
from .batcher import Batcher, BatchHooks, Item, Job, wait_for
from .http.json_api import PredictRequest, PredictResponse
from .metrics import Metrics
from .settings import ModelSpec, ServeSettings
from .tokenized import TokenLimits, TokenRow, is_tokenized, raw_tensors, token_rows
from .types import (MODEL_VERSION, InferRequest, InferResponse, ModelMetadata, OutputTensor, TensorSpec,
                    request_timeout)

log = logging.getLogger("modelkiln.serve")

@dataclass
class Stats:
    """Triton-style statistics (``GET /v2/models/{m}/stats``). Each counter has one writer thread."""

    success_count: int = 0
    success_ns: int = 0
    fail_count: int = 0
    fail_ns: int = 0
    queue_count: int = 0
    queue_ns: int = 0
    compute_count: int = 0
    compute_ns: int = 0
    inference_count: int = 0  # inputs run
    execution_count: int = 0  # batches run
    last_inference_ms: int = 0


class EncoderModel(BatchHooks):
    version = MODEL_VERSION
    queue_unit = "inputs"  # what its queue holds, for the message of a refusal

    def __init__(self, spec: ModelSpec, settings: ServeSettings, metrics: Metrics):
        folder = Path(spec.path)
        self.folder = folder
        self.manifest = Manifest.load(folder)
        self.name = spec.name or self.manifest.name
        chosen = spec.variant or settings.variant
        self.variant = (self.manifest.variant(chosen) if chosen
                        else self.manifest.fastest_variant(settings.device))
        self.task = make_task(self.manifest)
        self.settings = settings
        self.metrics = metrics
        self.stats = Stats()
        self.ready = False
        # requests between the batcher's submit and their answer: an unload waits for zero before
        # stopping the batcher (the data plane's admit → run has no await in between, so a request
        # admitted before the model left the map is counted before the unload looks)
        self.in_flight = 0
        self.capabilities = capabilities(self.variant)
        self.instances, self.threads, self.alone_threads = settings.engine_layout()
        if not self.capabilities.own_threads:  # one thread pool per process (torch): one instance uses it all
            self.instances, self.threads, self.alone_threads = 1, max(self.instances * self.threads, self.alone_threads), 0
        max_batch = min(settings.max_batch_size, self.capabilities.max_batch or settings.max_batch_size)
        max_padding = settings.max_padding if settings.max_padding is not None else self.capabilities.max_padding
        self.batcher = Batcher(self, max_batch, settings.token_budget(), settings.max_queue_size,
                               settings.max_queue_delay_ms / 1000.0, name=self.name, instances=self.instances,
                               max_padding=max_padding)
        self._observe_lock = threading.Lock()
        self._queue_hist = metrics.queue_seconds.labels(self.name)
        self._compute_hist = metrics.compute_seconds.labels(self.name)
        self._size_hist = metrics.batch_size.labels(self.name)
        self._tokens_hist = metrics.batch_tokens.labels(self.name)
        self._queued_gauge = metrics.queued.labels(self.name)
        self.matrix_engine: str | None = None  # the unit its products run on, found at load

    # -- lifecycle -------------------------------------------------------------------------
    def load(self) -> None:
        """Tokenizer + engine (ONNX Runtime sessions or the torch engine), a warm-up, then start the
        batcher. Blocking."""
        started = time.perf_counter()
        self.encoder = load_encoder(self.folder, self.manifest)
        self.token_limits = TokenLimits(self.manifest.input_names, self.encoder.vocab_size,
                                        self.encoder.max_type_id(), self.manifest.max_length,
                                        self.settings.max_inputs_per_request, self.settings.truncate)
        # No memory arena: it keeps the peak of the widest batch ever run (a burst of long inputs
        # left a server at 1.0 GB). Measured on all-MiniLM-L6-v2 int8, one thread, interleaved:
        # the same latency from batch 1 × 16 to 32 × 16 and 8 × 128 tokens, 536 → 144 MB after
        # 32 × 256-token batches.
        self.engines = [load_variant(self.folder, self.manifest, self.variant, self.threads, memory_arena=False)
                        for _ in range(self.instances)]
        self.engine = self.engines[0]
        # The session for a batch that has the machine to itself (see Batcher: ``alone``).
        self.alone_engine = (load_variant(self.folder, self.manifest, self.variant, self.alone_threads,
                                          memory_arena=False) if self.alone_threads else None)
        if self.settings.warmup:
            for k in range(self.instances):
                self._warm_up(k)
            if self.alone_engine is not None:
                self._warm_up(0, alone=True)
        self.batcher.start()
        v = self.variant
        self.matrix_engine = matrix_engine(v.precision, v.device, cpu_flags(), engine_kind(v))
        self.metrics.model_info.labels(self.name, self.task.name, v.name, self.matrix_engine).inc()
        self.ready = True
        log.info("loaded model %s (%s, variant %s on %s, %d instance(s) x %d thread(s), alone: %d thread(s)) in %.1fs",
                 self.name, self.task.name, v.name, self.matrix_engine, self.instances, self.threads,
                 self.alone_threads, time.perf_counter() - started)

    def _warm_up(self, instance: int, alone: bool = False) -> None:
        """Run a short and a full-size batch so first requests don't pay for arena growth."""
        samples: list[Any] = list(self.task.sample_inputs)
        for n in (1, min(len(samples), self.settings.max_batch_size)):
            job = Job(n=n, future=None)  # type: ignore[arg-type]  # a warm-up's answers are not awaited: no future
            items = [Item(job, i, text) for i, text in enumerate(self.task.prepare(samples[:n]))]
            self.tokenize(items)
            self.execute(items, instance, alone)

    def stop(self) -> None:
        self.ready = False
        self.batcher.stop()

    def release(self) -> None:
        """Stop (if started) and drop the sessions and the tokenizer, so their memory can go
        (an unloaded model). Blocking: the batcher finishes what is queued first."""
        if self.ready:
            self.stop()
        if self.matrix_engine is not None:
            self.metrics.model_info.labels(self.name, self.task.name, self.variant.name, self.matrix_engine).dec()
        for attribute in ("engines", "engine", "alone_engine", "encoder"):
            self.__dict__.pop(attribute, None)

    # -- what the batcher calls, on an engine instance's thread ----------------------------------
    def tokenize(self, items: Sequence[Item]) -> list[KilnError | None]:
        errors: list[KilnError | None] = [None] * len(items)
        texts = [(k, it.text) for k, it in enumerate(items) if it.text is not None]
        if texts:
            encodings = self.encoder.tokenize([t for _, t in texts])
            for (k, _), enc in zip(texts, encodings):
                items[k].encoding = enc
                items[k].length = len(enc.ids)
                if not self.settings.truncate and enc.overflowing:
                    errors[k] = InvalidInputError(
                        f"input {items[k].index} is longer than the model's {self.manifest.max_length} tokens "
                        "(the server rejects long inputs: start it with truncation on to cut them instead)")
        for it in items:
            if it.text is None:
                it.length = len(it.encoding.ids)
        return errors

    def execute(self, batch: Sequence[Item], instance: int = 0, alone: bool = False) -> list[Any]:
        encodings = [it.encoding for it in batch]
        engine = self.alone_engine if alone and self.alone_engine is not None else self.engines[instance]
        outputs = engine.run(self.encoder.collate(encodings))
        raw_rows = [k for k, it in enumerate(batch) if it.text is None and self.task.answers_need_text]
        if not raw_rows:
            return self.task.postprocess(outputs, encodings, [it.text for it in batch])
        results: list[Any] = [None] * len(batch)
        for k in raw_rows:
            n = batch[k].length
            results[k] = {name: value[k, :n] for name, value in outputs.items()}
        rest = [k for k in range(len(batch)) if k not in set(raw_rows)]
        if rest:
            sub = {name: value[rest] for name, value in outputs.items()}
            for k, answer in zip(rest, self.task.postprocess(sub, [encodings[k] for k in rest],
                                                             [batch[k].text for k in rest])):
                results[k] = answer
        return results

    def observe(self, batch: Sequence[Item], queue_s: list[float], compute_s: float) -> None:
        with self._observe_lock:  # engine instances report from their own threads
            self._observe(batch, queue_s, compute_s)

    def _observe(self, batch: Sequence[Item], queue_s: list[float], compute_s: float) -> None:
        for q in queue_s:
            self._queue_hist.observe(q)
        self._compute_hist.observe(compute_s)
        self._size_hist.observe(len(batch))
        self._tokens_hist.observe(len(batch) * max(it.length for it in batch))
        self._queued_gauge.set(self.batcher.queued)
        s = self.stats
        s.queue_count += len(queue_s)
        s.queue_ns += int(sum(queue_s) * 1e9)
        s.compute_count += 1
        s.compute_ns += int(compute_s * 1e9)
        s.inference_count += len(batch)
        s.execution_count += 1
        s.last_inference_ms = int(time.time() * 1000)

    # -- what the data plane calls (event loop; served.ServedModel) ------------------------------
    @property
    def full(self) -> bool:
        return self.batcher.full

    @property
    def queued(self) -> int:
        return self.batcher.queued

    def metadata(self) -> ModelMetadata:
        return ModelMetadata(
            name=self.name, versions=(self.version,), platform=platform_of(self.variant.engine),
            inputs=self.input_specs(), outputs=self.output_specs(),
            parameters={"task": self.task.name, "variant": self.variant.name, "matrix_engine": self.matrix_engine,
                        "max_length": self.manifest.max_length, "tokenized_inputs": list(self.manifest.input_names)})

    async def infer(self, request: InferRequest) -> InferResponse:
        """OIP infer: text tensors (or pre-tokenized rows) in, the task's answer tensors out."""
        started = time.perf_counter()
        try:
            available = self._output_names(request.inputs)
            wanted = [o.name for o in request.outputs] if request.outputs is not None else available
            unknown = [n for n in wanted if n not in available]
            if unknown:
                raise InvalidInputError(f"unknown output {unknown[0]!r} for model '{self.name}' "
                                        f"(outputs: {', '.join(available)})")
            inputs = self._infer_inputs(request.inputs)
            answers, _ = await self.run(inputs, self.timeout(request.parameters))
            tensors = self._answer_tensors(answers, inputs)
            outputs = [OutputTensor(n, *tensors[n]) for n in wanted]
        except BaseException:
            self.record(False, time.perf_counter() - started)
            raise
        self.record(True, time.perf_counter() - started)
        return InferResponse(self.name, self.version, outputs, id=request.id)

    async def stream_infer(self, request: InferRequest) -> AsyncIterator[InferResponse]:
        """gRPC's ModelStreamInfer: one answer, flagged final, as Triton does for a model that
        is not decoupled."""
        response = await self.infer(request)
        response.parameters["triton_final_response"] = True
        yield response

    async def predict(self, request: PredictRequest) -> PredictResponse:
        """The task's own answers (``task.postprocess``), one per input."""
        started = time.perf_counter()
        try:
            self.check_texts(request.inputs)
            answers, _ = await self.run(self.task.prepare(request.inputs), self.timeout(request.parameters))
            answers = self.task.apply_parameters(answers, request.parameters)
        except BaseException:
            self.record(False, time.perf_counter() - started)
            raise
        self.record(True, time.perf_counter() - started)
        return PredictResponse(self.name, answers, request.single)

    def check_texts(self, texts: list[Any]) -> None:
        """The server's limits on one request: how many inputs, how many characters each."""
        if len(texts) > self.settings.max_inputs_per_request:
            raise InvalidInputError(
                f"{len(texts)} inputs in one request; the limit is {self.settings.max_inputs_per_request}")
        limit = self.settings.max_input_chars
        for i, t in enumerate(texts):
            parts = t if isinstance(t, (tuple, list)) else (t,)
            if any(isinstance(p, str) and len(p) > limit for p in parts):
                raise InvalidInputError(f"input {i} is longer than {limit} characters")

    def timeout(self, parameters: Mapping[str, Any] | None = None) -> float:
        """The server's request timeout, or less when the request asks."""
        return request_timeout(self.settings.request_timeout_s, parameters)

    def _output_names(self, inputs: Mapping[str, np.ndarray]) -> list[str]:
        if is_tokenized(inputs) and self.task.answers_need_text:
            return self.raw_output_names()
        return [spec.name for spec in self.output_specs()]

    def _infer_inputs(self, tensors: Mapping[str, np.ndarray]) -> list[Any]:
        if is_tokenized(tensors):
            return token_rows(tensors, self.token_limits, self.name)
        texts = self.task.inputs_from_tensors(tensors)
        self.check_texts(texts)
        return self.task.prepare(texts)

    def _answer_tensors(self, answers: list[Any], inputs: list[Any]) -> dict[str, tuple[str, np.ndarray]]:
        """Task answers → named OIP tensors (the answers themselves come from task.postprocess);
        pre-tokenized rows of a task whose answers need text come back as the model's outputs."""
        if self.task.answers_need_text and isinstance(inputs[0], TokenRow):
            tensors = raw_tensors(answers)
        else:
            tensors = self.task.answer_tensors(answers)
        return {name: (tensors_protocol.datatype(array), array) for name, array in tensors.items()}

    async def run(self, inputs: list[Any], timeout_s: float) -> tuple[list[Any], int]:
        """Answer prepared inputs (texts, pairs or TokenRows). Returns (answers, real tokens)."""
        import asyncio

        error = RequestTimeoutError(f"request timed out after {timeout_s:g}s waiting for model '{self.name}'")
        job = Job(n=len(inputs), future=asyncio.get_running_loop().create_future(),
                  deadline=time.perf_counter() + timeout_s, timeout_error=error)
        self.in_flight += 1
        try:
            self.batcher.submit([Item(job, i, None if isinstance(x, TokenRow) else x,
                                      x if isinstance(x, TokenRow) else None) for i, x in enumerate(inputs)])
            results = await wait_for(job, timeout_s, lambda: error)
        finally:
            self.in_flight -= 1
        return results, job.tokens

    def record(self, ok: bool, seconds: float) -> None:
        if ok:
            self.stats.success_count += 1
            self.stats.success_ns += int(seconds * 1e9)
        else:
            self.stats.fail_count += 1
            self.stats.fail_ns += int(seconds * 1e9)

    # -- protocol description ------------------------------------------------------------------
    def input_specs(self) -> tuple[TensorSpec, ...]:
        return self.task.input_specs()

    def output_specs(self) -> tuple[TensorSpec, ...]:
        """The answer tensors of a text request (the task's, sized by the model's outputs)."""
        return self.task.output_specs(self.engine.output_shapes if hasattr(self, "engine") else {})

    def raw_output_names(self) -> list[str]:
        """The model's own outputs: a pre-tokenized request to a task whose answers need the text
        gets these (its rows have no characters to point into)."""
        return list(self.engine.output_names)


def platform_of(engine: str | None) -> str:
    """Triton's platform name for the variant's engine (model metadata): its backend's name where
    Triton has one ("pytorch", "openvino"), else onnxruntime's."""
    return {"torch": "pytorch", "openvino": "openvino"}.get(engine or "", "onnxruntime_onnx")
