"""The data plane: the logic behind every model route, whatever the transport.

It implements ``types.InferenceService``: typed requests in, typed responses out (OIP infer,
metadata, statistics), plus the two JSON APIs' typed calls (``json_api``: /predict and OpenAI
embeddings). Transport edges (the REST codec in ``inference_routes``, the gRPC servicer) decode
their wire format and call nothing else. The data plane finds the model, admits the request or
refuses it, and hands it to the model (``served.ServedModel``: an encoder or a text generator,
each shaping its own requests and answers). Everything here runs on the event loop and is cheap;
tokenizing and the model run on the model's own threads. Per-request facts the edges need
afterwards (the model that answered) travel back in the responses."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from .. import __version__
from ..errors import (InvalidInputError, KilnError, ModelControlError, ModelNotFoundError, ModelNotReadyError,
                      OverloadedError)
from .generation.model import GenerationModel
from .http.json_api import EmbeddingsRequest, EmbeddingsResponse, PredictRequest, PredictResponse
from .local_models import LocalModels
from .metrics import Metrics
from .model import EncoderModel
from .repository import Folder, ModelRepository
from .served import ServedModel, served_model
from .settings import ServeSettings
from .types import (Duration, InferRequest, InferResponse, ModelMetadata, ModelStatistics, RepositoryModel,
                    ServerMetadata)

EXTENSIONS = ("binary_tensor_data", "statistics", "model_repository")


class Repository(Protocol):
    """The model repository a data plane answers with: ``repository.ModelRepository`` over this
    process's models, or, in a worker of ``kiln serve --workers N``, the supervisor's
    (``workers.SupervisorLink``), which changes every worker's models at once."""

    @property
    def mode(self) -> str: ...  # none, explicit or poll

    async def start(self) -> None: ...
    async def close(self) -> None: ...
    async def index(self, ready_only: bool = False) -> list[RepositoryModel]: ...
    async def load(self, name: str) -> None: ...
    async def unload(self, name: str) -> None: ...


class Peers(Protocol):
    """The worker processes of ``kiln serve --workers N`` (this one included), through their
    supervisor (``workers.SupervisorLink``)."""

    async def statistics(self, name: str | None, version: str | None) -> list[ModelStatistics]: ...


def build_dataplane(settings: ServeSettings, metrics: Metrics | None = None,
                    repository: Repository | None = None) -> DataPlane:
    """Load every model of ``settings`` (checked before any is loaded: a bad artifact fails fast)
    and return the data plane over them. Blocking; any front-end (uvicorn, gRPC, Ray) calls it.
    Without ``repository``, the plane keeps its own (``--model-repository``'s folders are loaded
    here too); with one, ``settings.models`` are all it loads (a worker process: the supervisor
    decides what every worker serves)."""
    metrics = metrics or Metrics()
    own = None
    folders: list[Folder] = []
    if repository is None:
        own = ModelRepository(settings, Path(settings.model_repository) if settings.model_repository else None)
        folders = own.startup_folders()
    models: dict[str, ServedModel] = {}
    for spec in (*settings.models, *(own.spec(f) for f in folders if own is not None)):
        model = served_model(spec, settings, metrics)
        if model.name in models:
            raise KilnError(f"two models are named '{model.name}': use NAME=PATH")
        models[model.name] = model
    for model in models.values():
        model.load()
    plane = DataPlane(models, settings, metrics)
    if own is not None:
        own.attach(LocalModels(plane), folders)
    plane.repository = own or repository
    return plane


class DataPlane:
    """Implements ``types.InferenceService`` over the models given (``build_dataplane`` loads them)."""

    def __init__(self, models: Mapping[str, ServedModel], settings: ServeSettings, metrics: Metrics | None = None):
        # Replaced, never mutated, by the model repository (one assignment swaps the map):
        # iterating over it while a model is loaded or unloaded is safe.
        self.models = dict(models)
        self.settings = settings
        self.metrics = metrics or Metrics()
        self.repository: Repository | None = None  # build_dataplane sets it (load/unload/poll)
        self.peers: Peers | None = None  # the other workers of ``kiln serve --workers N`` (workers.py)

    async def start(self) -> None:
        """Background work that needs the event loop (poll mode's repository scans)."""
        if self.repository is not None:
            await self.repository.start()

    async def close(self) -> None:
        if self.repository is not None:
            await self.repository.close()

    def publish_queue_gauges(self) -> None:
        """Set each model's ``kiln_queue_inputs`` to its queue now (before /metrics is rendered;
        a worker of ``--workers N`` also every ``workers.GAUGE_REFRESH_S``, for the others' renders)."""
        for model in self.models.values():
            self.metrics.queued.labels(model.name).set(model.queued)

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
        if model.full:
            raise OverloadedError(f"queue full ({model.queued} {model.queue_unit} waiting); retry later")
        return model

    def generation_model(self, name: str | None, version: str | None = None) -> GenerationModel:
        """A text-generation model, admitted (see ``admit``); no name: the only one served."""
        if not name:
            candidates = [m for m in self.models.values() if isinstance(m, GenerationModel)]
            if len(candidates) != 1:
                raise ModelNotFoundError("name the model: this server serves "
                                         f"{len(candidates)} text-generation models")
            name = candidates[0].name
        model = self.admit(name, version)
        if not isinstance(model, GenerationModel):
            raise InvalidInputError(f"model '{model.name}' is a {model.task.name} model, not a text-generation model")
        return model

    def server_metadata(self) -> ServerMetadata:
        return ServerMetadata("modelkiln", __version__, EXTENSIONS)

    def model_metadata(self, name: str, version: str | None = None) -> ModelMetadata:
        return self.model(name, version, need_ready=False).metadata()

    async def model_statistics(self, name: str | None = None, version: str | None = None) -> list[ModelStatistics]:
        """This process's statistics, or, in a worker of ``--workers N``, every worker's added up."""
        if self.peers is not None:
            return await self.peers.statistics(name, version)
        return self.local_statistics(name, version)

    def local_statistics(self, name: str | None = None, version: str | None = None) -> list[ModelStatistics]:
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
    async def repository_index(self, ready_only: bool = False) -> list[RepositoryModel]:
        if self.repository is not None:
            return await self.repository.index(ready_only)
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

    # -- OIP infer and /predict: the model shapes the request and its answer ------------------------
    async def infer(self, request: InferRequest) -> InferResponse:
        return await self.admit(request.model_name, request.model_version).infer(request)

    async def stream_infer(self, request: InferRequest) -> AsyncIterator[InferResponse]:
        """gRPC's ModelStreamInfer: a text-generation model answers token by token (decoupled);
        any other model answers once, flagged final, as Triton does for a non-decoupled model."""
        async for response in self.admit(request.model_name, request.model_version).stream_infer(request):
            yield response

    async def predict(self, request: PredictRequest) -> PredictResponse:
        """The task's own answers (``task.postprocess``), one per input."""
        return await self.admit(request.model_name, request.model_version).predict(request)

    # -- OpenAI /v1/embeddings ------------------------------------------------------------------
    async def embeddings(self, request: EmbeddingsRequest) -> EmbeddingsResponse:
        """OpenAI embeddings; the response names the model that answered (for the edge's metrics)."""
        model = self._embedding_model(request.model)
        self.admit(model.name)  # its queue full: refused before any work, as every request is
        started = time.perf_counter()
        try:
            model.check_texts(request.inputs)
            vectors, tokens = await model.run(model.task.prepare(request.inputs), self.settings.request_timeout_s)
            if request.dimensions is not None and request.dimensions != len(vectors[0]):
                raise InvalidInputError(f"model '{model.name}' has {len(vectors[0])} dimensions, not {request.dimensions}")
        except BaseException:
            model.record(False, time.perf_counter() - started)
            raise
        model.record(True, time.perf_counter() - started)
        return EmbeddingsResponse(model.name, [np.asarray(v, dtype=np.float32) for v in vectors], tokens,
                                  request.encoding_format)

    def _embedding_model(self, name: Any) -> EncoderModel:
        if isinstance(name, str) and name in self.models:
            model = self.model(name)
        else:
            candidates = [m for m in self.models.values() if m.task.embeds]
            if name is not None or len(candidates) != 1:
                raise ModelNotFoundError(
                    f"unknown embedding model {name!r} (serving: {', '.join(m.name for m in candidates) or 'none'})")
            model = self.model(candidates[0].name)
        if not (isinstance(model, EncoderModel) and model.task.embeds):
            raise InvalidInputError(f"model '{model.name}' is a {model.task.name} model, not an embedding model")
        return model


__all__ = ["DataPlane", "build_dataplane"]
