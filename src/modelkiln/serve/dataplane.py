"""The data plane: the logic behind every model route, whatever the transport.

It implements ``types.InferenceService``: typed requests in, typed responses out (OIP infer,
metadata, statistics), plus the two JSON APIs' typed calls (``json_api``: /predict and OpenAI
embeddings). Transport edges (the REST codec in ``inference_routes``, the gRPC servicer) decode
their wire format and call nothing else. Everything here runs on the event loop and is cheap:
checks, ``task.prepare`` (validation), queueing, shaping answers; tokenizing and the model run on
the model's batcher threads. Per-request facts the edges need afterwards (the model that
answered) travel back in the responses."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .. import __version__
from ..errors import (InvalidInputError, KilnError, ModelControlError, ModelNotFoundError, ModelNotReadyError,
                      OverloadedError)
from ..tasks import tensors as tensors_protocol
from .generation.oip import generation_infer, generation_stream
from .json_api import EmbeddingsRequest, EmbeddingsResponse, PredictRequest, PredictResponse
from .metrics import Metrics
from .generation import is_generation, served_model
from .generation.model import GenerationModel
from .model import ServedModel
from .repository import ModelRepository
from .tokenized import TokenRow, is_tokenized, raw_tensors, token_rows
from .settings import ServeSettings
from .types import (Duration, InferRequest, InferResponse, ModelMetadata, ModelStatistics, OutputTensor,
                    RepositoryModel, ServerMetadata)

EXTENSIONS = ("binary_tensor_data", "statistics", "model_repository")


def build_dataplane(settings: ServeSettings, metrics: Metrics | None = None) -> DataPlane:
    """Load every model of ``settings`` (checked before any is loaded: a bad artifact fails fast)
    and return the data plane over them. Blocking; any front-end (uvicorn, gRPC, Ray) calls it."""
    metrics = metrics or Metrics()
    repository = ModelRepository(settings, Path(settings.model_repository) if settings.model_repository else None)
    folders = repository.startup_folders()
    models: dict[str, ServedModel] = {}
    for spec in (*settings.models, *(repository.spec(f) for f in folders)):
        model = served_model(spec, settings, metrics)
        if model.name in models:
            raise KilnError(f"two models are named '{model.name}': use NAME=PATH")
        models[model.name] = model
    for model in models.values():
        model.load()
    plane = DataPlane(models, settings, metrics)
    repository.attach(plane, folders)
    plane.repository = repository
    return plane


class DataPlane:
    """Implements ``types.InferenceService`` over the models given (``build_dataplane`` loads them)."""

    def __init__(self, models: Mapping[str, ServedModel], settings: ServeSettings, metrics: Metrics | None = None):
        # Replaced, never mutated, by the model repository (one assignment swaps the map):
        # iterating over it while a model is loaded or unloaded is safe.
        self.models = dict(models)
        self.settings = settings
        self.metrics = metrics or Metrics()
        self.repository: ModelRepository | None = None  # build_dataplane sets it (load/unload/poll)

    async def start(self) -> None:
        """Background work that needs the event loop (poll mode's repository scans)."""
        if self.repository is not None:
            await self.repository.start()

    async def close(self) -> None:
        if self.repository is not None:
            await self.repository.close()

    def stop(self) -> None:
        """Drain every model's queue, then end its engine threads (at shutdown)."""
        for model in self.models.values():
            model.stop()

    # -- health and registry ---------------------------------------------------------------------
    def live(self) -> bool:
        return True

    def ready(self) -> bool:
        """Every model ready, and at least one, except in explicit model control mode, where a
        server with nothing loaded yet is ready to be told what to load (as Triton is)."""
        models = self.models
        explicit = self.repository is not None and self.repository.mode == "explicit"
        return (bool(models) or explicit) and all(m.ready for m in models.values())

    def model_ready(self, name: str, version: str | None = None) -> bool:
        return self.model(name, version, need_ready=False).ready

    def model(self, name: str, version: str | None = None, need_ready: bool = True) -> ServedModel:
        model = self.models.get(name)
        if model is None:
            raise ModelNotFoundError(f"unknown model '{name}' (serving: {', '.join(self.models) or 'none'})")
        if version not in (None, "", model.version):
            raise ModelNotFoundError(f"unknown version '{version}' of model '{name}' (versions: {model.version})")
        if need_ready and not model.ready:
            raise ModelNotReadyError(f"model '{name}' is not ready")
        return model

    def admit(self, name: str, version: str | None = None) -> ServedModel:
        """The model, if it can take a request now: unknown → NOT_FOUND, not ready → NOT_READY, its
        queue full → OVERLOADED, all before the request is decoded or checked, so that a refusal
        costs the event loop next to nothing (under overload most requests are refusals)."""
        model = self.model(name, version)
        if is_generation(model):
            if model.full:
                raise OverloadedError(f"queue full ({model.queued} generation requests waiting); retry later")
        elif model.batcher.full:
            raise OverloadedError(f"queue full ({model.batcher.queued} inputs waiting); retry later")
        return model

    def generation_model(self, name: str | None, version: str | None = None) -> GenerationModel:
        """A text-generation model, admitted (see ``admit``); no name: the only one served."""
        if not name:
            candidates = [m for m in self.models.values() if is_generation(m)]
            if len(candidates) != 1:
                raise ModelNotFoundError("name the model: this server serves "
                                         f"{len(candidates)} text-generation models")
            name = candidates[0].name
        model = self.admit(name, version)
        if not is_generation(model):
            raise InvalidInputError(f"model '{model.name}' is a {model.task.name} model, not a text-generation model")
        return model

    def server_metadata(self) -> ServerMetadata:
        return ServerMetadata("modelkiln", __version__, EXTENSIONS)

    def model_metadata(self, name: str, version: str | None = None) -> ModelMetadata:
        m = self.model(name, version, need_ready=False)
        if is_generation(m):
            return ModelMetadata(
                name=m.name, versions=(m.version,), platform="onnxruntime_onnx", inputs=m.input_specs(),
                outputs=m.output_specs(), parameters={"task": m.task.name, "variant": m.variant.name,
                                                      "max_context": m.max_context, "kv_tokens": m.kv_budget
                                                      if m.ready else None, "decoupled": True})
        return ModelMetadata(
            name=m.name, versions=(m.version,), platform="onnxruntime_onnx",
            inputs=m.input_specs(), outputs=m.output_specs(),
            parameters={"task": m.task.name, "variant": m.variant.name, "max_length": m.manifest.max_length,
                        "tokenized_inputs": list(m.manifest.input_names)})

    def model_statistics(self, name: str | None = None, version: str | None = None) -> list[ModelStatistics]:
        models = [self.model(name, version, need_ready=False)] if name else list(self.models.values())
        out = []
        for m in models:
            s = m.stats
            out.append(ModelStatistics(
                name=m.name, version=m.version, last_inference_ms=s.last_inference_ms,
                inference_count=s.inference_count, execution_count=s.execution_count,
                success=Duration(s.success_count, s.success_ns), fail=Duration(s.fail_count, s.fail_ns),
                queue=Duration(s.queue_count, s.queue_ns), compute_infer=Duration(s.compute_count, s.compute_ns)))
        return out

    # -- Triton's model repository extension --------------------------------------------------------
    # (serve/repository.py: modes, and how a load or unload leaves other requests alone)
    def repository_index(self, ready_only: bool = False) -> list[RepositoryModel]:
        if self.repository is not None and self.repository.plane is self:
            return self.repository.index(ready_only)
        index = [RepositoryModel(m.name, m.version, "READY" if m.ready else "UNAVAILABLE",
                                 "" if m.ready else "not loaded yet") for m in self.models.values()]
        return [e for e in index if e.state == "READY"] if ready_only else index

    async def load_model(self, name: str) -> None:
        if self.repository is None:
            raise ModelControlError(f"cannot load '{name}': this server's models are fixed at start (model control mode none)")
        await self.repository.load(name)

    async def unload_model(self, name: str) -> None:
        if self.repository is None:
            raise ModelControlError(f"cannot unload '{name}': this server's models are fixed at start (model control mode none)")
        await self.repository.unload(name)

    # -- shared checks --------------------------------------------------------------------------
    def _check_texts(self, texts: list[Any]) -> None:
        if len(texts) > self.settings.max_inputs_per_request:
            raise InvalidInputError(
                f"{len(texts)} inputs in one request; the limit is {self.settings.max_inputs_per_request}")
        limit = self.settings.max_input_chars
        for i, t in enumerate(texts):
            parts = t if isinstance(t, (tuple, list)) else (t,)
            if any(isinstance(p, str) and len(p) > limit for p in parts):
                raise InvalidInputError(f"input {i} is longer than {limit} characters")

    def _timeout(self, parameters: Mapping[str, Any] | None) -> float:
        timeout = self.settings.request_timeout_s
        asked = (parameters or {}).get("timeout")  # Triton: microseconds
        if isinstance(asked, (int, float)) and not isinstance(asked, bool) and asked > 0:
            timeout = min(timeout, asked / 1e6)
        return timeout

    # -- OIP infer ------------------------------------------------------------------------------
    async def infer(self, request: InferRequest) -> InferResponse:
        model = self.admit(request.model_name, request.model_version)
        if is_generation(model):
            return await generation_infer(model, request)
        started = time.perf_counter()
        try:
            available = self._output_names(model, request.inputs)
            wanted = [o.name for o in request.outputs] if request.outputs is not None else available
            unknown = [n for n in wanted if n not in available]
            if unknown:
                raise InvalidInputError(f"unknown output {unknown[0]!r} for model '{model.name}' "
                                        f"(outputs: {', '.join(available)})")
            inputs = self._infer_inputs(model, request.inputs)
            answers, _ = await model.run(inputs, self._timeout(request.parameters))
            tensors = self._answer_tensors(model, answers, inputs)
            outputs = [OutputTensor(n, *tensors[n]) for n in wanted]
        except BaseException:
            model.record(False, time.perf_counter() - started)
            raise
        model.record(True, time.perf_counter() - started)
        return InferResponse(model.name, model.version, outputs, id=request.id)

    async def stream_infer(self, request: InferRequest) -> AsyncIterator[InferResponse]:
        """gRPC's ModelStreamInfer: a text-generation model answers token by token (decoupled);
        any other model answers once, flagged final, as Triton does for a non-decoupled model."""
        model = self.admit(request.model_name, request.model_version)
        if is_generation(model):
            async for response in generation_stream(model, request):
                yield response
            return
        response = await self.infer(request)
        response.parameters["triton_final_response"] = True
        yield response

    def _output_names(self, model: ServedModel, inputs: Mapping[str, np.ndarray]) -> list[str]:
        if is_tokenized(inputs) and model.task.answers_need_text:
            return model.raw_output_names()
        return [spec.name for spec in model.output_specs()]

    def _infer_inputs(self, model: ServedModel, tensors: Mapping[str, np.ndarray]) -> list[Any]:
        if is_tokenized(tensors):
            return token_rows(tensors, model.token_limits, model.name)
        texts = model.task.inputs_from_tensors(tensors)
        self._check_texts(texts)
        return model.task.prepare(texts)

    @staticmethod
    def _answer_tensors(model: ServedModel, answers: list[Any], inputs: list[Any]) -> dict[str, tuple[str, np.ndarray]]:
        """Task answers → named OIP tensors (the answers themselves come from task.postprocess);
        pre-tokenized rows of a task whose answers need text come back as the model's outputs."""
        if model.task.answers_need_text and isinstance(inputs[0], TokenRow):
            tensors = raw_tensors(answers)
        else:
            tensors = model.task.answer_tensors(answers)
        return {name: (tensors_protocol.datatype(array), array) for name, array in tensors.items()}

    # -- /predict --------------------------------------------------------------------------------
    async def predict(self, request: PredictRequest) -> PredictResponse:
        """The task's own answers (``task.postprocess``), one per input."""
        model = self.admit(request.model_name, request.model_version)
        if is_generation(model):
            raise InvalidInputError(f"model '{model.name}' generates text: use /v2/models/{model.name}/generate, "
                                    "/v1/completions or /v1/chat/completions")
        started = time.perf_counter()
        try:
            self._check_texts(request.inputs)
            answers, _ = await model.run(model.task.prepare(request.inputs), self._timeout(request.parameters))
            answers = model.task.apply_parameters(answers, request.parameters)
        except BaseException:
            model.record(False, time.perf_counter() - started)
            raise
        model.record(True, time.perf_counter() - started)
        return PredictResponse(model.name, answers, request.single)

    # -- OpenAI /v1/embeddings ------------------------------------------------------------------
    async def embeddings(self, request: EmbeddingsRequest) -> EmbeddingsResponse:
        """OpenAI embeddings; the response names the model that answered (for the edge's metrics)."""
        model = self.admit(self._embedding_model(request.model).name)
        started = time.perf_counter()
        try:
            self._check_texts(request.inputs)
            vectors, tokens = await model.run(model.task.prepare(request.inputs), self.settings.request_timeout_s)
            if request.dimensions is not None and request.dimensions != len(vectors[0]):
                raise InvalidInputError(f"model '{model.name}' has {len(vectors[0])} dimensions, not {request.dimensions}")
        except BaseException:
            model.record(False, time.perf_counter() - started)
            raise
        model.record(True, time.perf_counter() - started)
        return EmbeddingsResponse(model.name, [np.asarray(v, dtype=np.float32) for v in vectors], tokens,
                                  request.encoding_format)

    def _embedding_model(self, name: Any) -> ServedModel:
        if isinstance(name, str) and name in self.models:
            model = self.model(name)
        else:
            candidates = [m for m in self.models.values() if m.task.embeds]
            if name is not None or len(candidates) != 1:
                raise ModelNotFoundError(
                    f"unknown embedding model {name!r} (serving: {', '.join(m.name for m in candidates) or 'none'})")
            model = self.model(candidates[0].name)
        if not model.task.embeds:
            raise InvalidInputError(f"model '{model.name}' is a {model.task.name} model, not an embedding model")
        return model


__all__ = ["DataPlane", "build_dataplane"]
