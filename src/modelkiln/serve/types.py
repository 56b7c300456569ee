"""The data plane's typed requests and responses, shared by every transport.

A transport edge (the REST codec, the gRPC servicer, a Ray deployment) decodes its wire format
into these objects, calls ``DataPlane``, and encodes what comes back. Nothing here knows HTTP,
protobuf or a task: tensors are named numpy arrays (BYTES as object arrays of ``bytes``) with the
Open Inference Protocol's datatype names, and per-request facts the edges need afterwards (the
model that answered, for metrics and statistics) travel in the response, not in a side channel."""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import AsyncIterator, Mapping
from typing import Any, Protocol

import numpy as np

from ..tasks.tensors import TensorSpec

Parameters = dict[str, Any]  # OIP parameters: str / int / float / bool values
MODEL_VERSION = "1"  # every served model has one version (a Triton repository folder without versions)


def request_timeout(limit_s: float, parameters: Mapping[str, Any] | None) -> float:
    """The server's timeout ``limit_s``, or less when the request asks for less (Triton's
    ``timeout`` parameter, in microseconds)."""
    asked = (parameters or {}).get("timeout")
    if isinstance(asked, (int, float)) and not isinstance(asked, bool) and asked > 0:
        return min(limit_s, asked / 1e6)
    return limit_s


@dataclass
class RequestedOutput:
    name: str
    parameters: Parameters = field(default_factory=dict)  # e.g. {"binary_data": True} (REST only)


@dataclass
class InferRequest:
    model_name: str
    model_version: str | None
    inputs: dict[str, np.ndarray]  # name → array; BYTES tensors are object arrays of bytes
    outputs: list[RequestedOutput] | None = None  # None: every output of the model
    id: str | None = None
    parameters: Parameters = field(default_factory=dict)


@dataclass
class OutputTensor:
    name: str
    datatype: str
    data: np.ndarray
    parameters: Parameters = field(default_factory=dict)


@dataclass
class InferResponse:
    model_name: str
    model_version: str
    outputs: list[OutputTensor]
    id: str | None = None
    parameters: Parameters = field(default_factory=dict)


@dataclass(frozen=True)
class ServerMetadata:
    name: str
    version: str
    extensions: tuple[str, ...]


@dataclass(frozen=True)
class ModelMetadata:
    name: str
    versions: tuple[str, ...]
    platform: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    parameters: Parameters = field(default_factory=dict)


@dataclass(frozen=True)
class RepositoryModel:
    """One entry of the model repository index (Triton's repository extension)."""

    name: str
    version: str
    state: str  # READY, UNAVAILABLE, LOADING, UNLOADING
    reason: str = ""


@dataclass(frozen=True)
class Duration:
    count: int = 0
    ns: int = 0


@dataclass(frozen=True)
class ModelStatistics:
    """Triton's per-model statistics (``/v2/models/{m}/stats``, gRPC ModelStatistics)."""

    name: str
    version: str
    last_inference_ms: int
    inference_count: int  # inputs run
    execution_count: int  # batches run
    success: Duration
    fail: Duration
    queue: Duration
    compute_infer: Duration


class InferenceService(Protocol):
    """What a transport edge may call. ``DataPlane`` implements it; the REST routes, the gRPC
    servicer and a Ray deployment call nothing else. Errors are ``KilnError`` subclasses whose
    ``kind`` each transport maps once to its own status codes."""

    def live(self) -> bool: ...
    def ready(self) -> bool: ...
    def model_ready(self, name: str, version: str | None = None) -> bool: ...  # NOT_FOUND if unknown
    def server_metadata(self) -> ServerMetadata: ...
    def model_metadata(self, name: str, version: str | None = None) -> ModelMetadata: ...
    async def infer(self, request: InferRequest) -> InferResponse: ...
    def stream_infer(self, request: InferRequest) -> AsyncIterator[InferResponse]: ...  # decoupled (gRPC stream)
    # async: with ``kiln serve --workers N`` both are asked of every worker process
    async def model_statistics(self, name: str | None = None, version: str | None = None) -> list[ModelStatistics]: ...
    # Triton's model repository extension
    async def repository_index(self, ready_only: bool = False) -> list[RepositoryModel]: ...
    async def load_model(self, name: str) -> None: ...
    async def unload_model(self, name: str) -> None: ...
