"""What the data plane, the model repository and the metrics route ask of a served model,
whatever its kind. Two kinds implement ``ServedModel``: ``EncoderModel`` (``model.py``: a task, a
tokenizer, ONNX sessions behind a dynamic batcher) and ``GenerationModel``
(``generation/model.py``: a decoder behind a continuous-batching scheduler; a worker of ``kiln serve
--workers N`` serves it as a ``FrontGenerationModel``, its engine in the engine process). ``served_model``
picks the kind for an artifact folder; nothing else asks which kind a model is, except the routes
only one kind serves (OpenAI completions, embeddings), which look for models that can."""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Protocol

from ..machine import cpu_description, timed_elsewhere
from ..manifest import Manifest, Variant
from ..tasks.text_generation import is_generation
from .generation.engine_process import ENGINE_ADDRESS
from .generation.front import FrontGenerationModel
from .generation.model import GenerationModel
from .http.json_api import PredictRequest, PredictResponse
from .metrics import Metrics
from .model import EncoderModel, Stats
from .settings import ModelSpec, ServeSettings
from .types import InferRequest, InferResponse, ModelMetadata

log = logging.getLogger("modelkiln.serve")


class ServedModel(Protocol):
    name: str
    version: str
    manifest: Manifest
    variant: Variant
    task: Any  # what the routes read of it: .name, .embeds
    stats: Stats  # Triton's statistics: the data plane and the gRPC servicer report them
    ready: bool
    in_flight: int  # requests accepted and not yet answered: an unload waits for 0
    instances: int
    threads: int
    queue_unit: str  # what its queue holds ("inputs"), for the message of a refusal

    def load(self) -> None: ...  # blocking: sessions, warm-up, then its worker threads
    def stop(self) -> None: ...  # refuse new requests, finish the accepted ones
    def release(self) -> None: ...  # stop, then drop sessions and tokenizer (an unloaded model)

    @property
    def full(self) -> bool: ...  # a new request would be refused (503) before it is decoded

    @property
    def queued(self) -> int: ...

    def record(self, ok: bool, seconds: float) -> None: ...
    def metadata(self) -> ModelMetadata: ...
    async def infer(self, request: InferRequest) -> InferResponse: ...
    def stream_infer(self, request: InferRequest) -> AsyncIterator[InferResponse]: ...  # gRPC ModelStreamInfer
    async def predict(self, request: PredictRequest) -> PredictResponse: ...  # /v2/models/{m}/predict


def served_model(spec: ModelSpec, settings: ServeSettings, metrics: Metrics) -> ServedModel:
    """The served model for an artifact folder, not loaded yet (``load`` is blocking)."""
    model: ServedModel
    if is_generation(Manifest.load(Path(spec.path))):
        engine_address = os.environ.get(ENGINE_ADDRESS)
        # a worker of kiln serve --workers N: the engines run in the engine process
        model = (FrontGenerationModel(spec, settings, metrics, engine_address) if engine_address
                 else GenerationModel(spec, settings, metrics))
    else:
        model = EncoderModel(spec, settings, metrics)
    choices = [v for v in model.manifest.kept_variants() if v.device == model.variant.device]
    if spec.variant or settings.variant or model.variant.device != "cpu" or len(choices) < 2:
        return model  # a variant named, or no other to choose
    # The default variant is the fastest where the artifact was converted: an AMX Xeon may run
    # another one fastest (OpenVINO's bf16) than the AMD EPYC of a CI runner did.
    here = cpu_description()
    elsewhere = timed_elsewhere(model.manifest.machine, here)
    if elsewhere:
        log.warning("model %s: its variants were timed on %s, this host is %s (%s): variant %s is that machine's "
                    "choice; `kiln tune` measures them here, --variant names one", model.name, elsewhere,
                    here["cpu"], here["isa"], model.variant.name)
    return model
