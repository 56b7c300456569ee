"""``inference.GRPCInferenceService`` over the data plane, served by ``grpc.aio``.

A thin edge, like the REST routes: decode (``codec``), call ``types.InferenceService``, encode.
It runs on uvicorn's event loop in the same process (started from the HTTP app's lifespan), so
both transports share the models, batchers, limits and metrics. Errors carry an ``ErrorKind``,
mapped here once to a gRPC status code (``GRPC_STATUS``), as ``serve/http/errors.py`` maps it to HTTP."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from ...errors import ErrorKind, InvalidInputError, KilnError, UnauthorizedError
from ..auth import bearer_matches
from ..http.errors import bug_key, kind_of, throttle
from ..metrics import Metrics
from ..settings import ServeSettings
from ..types import InferenceService
from . import codec
from . import kserve_pb2 as pb
from . import kserve_pb2_grpc as pb_grpc

log = logging.getLogger("modelkiln.serve")

GRPC_STATUS: dict[ErrorKind, grpc.StatusCode] = {
    ErrorKind.INVALID_INPUT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorKind.NOT_READY: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.TIMED_OUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorKind.TOO_LARGE: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    ErrorKind.METHOD_NOT_ALLOWED: grpc.StatusCode.UNIMPLEMENTED,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
}

# Health methods answer without a key, like HTTP's /v2/health/* (probes carry no credentials).
HEALTH = ("ServerLive", "ServerReady", "ModelReady")
# Routes timed in kiln_request_duration_seconds, named as the HTTP routes are.
_TIMED = {"ModelInfer": "infer"}


def _route_name(method: str) -> str:
    return _TIMED.get(method, method)


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, plane: InferenceService, api_key: str | None, metrics: Metrics):
        self.plane = plane
        self.api_key = api_key.encode() if api_key else None
        self.metrics = metrics
        # prometheus_client's ``labels(...)`` validates and hashes its arguments on every call (a few
        # µs, twice per request): keep the labelled children, bounded as model names come from clients.
        self._requests_child = functools.lru_cache(maxsize=1024)(
            lambda model, route, status: metrics.requests.labels(model, route, status, "grpc"))
        self._seconds_child = functools.lru_cache(maxsize=256)(
            lambda model, route: metrics.request_seconds.labels(model, route, "grpc"))

    # Every method goes through ``_call``: auth, metrics, and errors → status codes in one place.
    async def _call(self, method: str, context: grpc.aio.ServicerContext, model: str,
                    work: Callable[[], Awaitable[Any]]) -> Any:
        started = time.perf_counter()
        status = grpc.StatusCode.OK
        self.metrics.in_flight.inc()
        try:
            if self.api_key is not None and method not in HEALTH:
                metadata = dict(context.invocation_metadata() or ())
                if not bearer_matches(str(metadata.get("authorization", "")).encode(), self.api_key):
                    raise UnauthorizedError("missing or wrong bearer token")
            return await work()
        except asyncio.CancelledError:  # the client went away: its queued work is dropped (batcher)
            status = grpc.StatusCode.CANCELLED
            raise
        except Exception as exc:  # typed errors → their status; anything else is a bug → INTERNAL
            status = GRPC_STATUS[kind_of(exc)]
            await context.abort(status, _message(exc))
        finally:
            self.metrics.in_flight.dec()
            route = _route_name(method)
            self._requests_child(model, route, status.name).inc()
            if method in _TIMED:
                self._seconds_child(model, route).observe(time.perf_counter() - started)

    async def ServerLive(self, request: pb.ServerLiveRequest, context: Any) -> pb.ServerLiveResponse:
        return await self._call("ServerLive", context, "", _now(lambda: pb.ServerLiveResponse(live=self.plane.live())))

    async def ServerReady(self, request: pb.ServerReadyRequest, context: Any) -> pb.ServerReadyResponse:
        return await self._call("ServerReady", context, "",
                                _now(lambda: pb.ServerReadyResponse(ready=self.plane.ready())))

    async def ModelReady(self, request: pb.ModelReadyRequest, context: Any) -> pb.ModelReadyResponse:
        return await self._call("ModelReady", context, request.name, _now(lambda: pb.ModelReadyResponse(
            ready=self.plane.model_ready(request.name, request.version or None))))

    async def ServerMetadata(self, request: pb.ServerMetadataRequest, context: Any) -> pb.ServerMetadataResponse:
        def answer() -> pb.ServerMetadataResponse:
            m = self.plane.server_metadata()
            return pb.ServerMetadataResponse(name=m.name, version=m.version, extensions=list(m.extensions))

        return await self._call("ServerMetadata", context, "", _now(answer))

    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context: Any) -> pb.ModelMetadataResponse:
        return await self._call("ModelMetadata", context, request.name, _now(lambda: codec.metadata_to_proto(
            self.plane.model_metadata(request.name, request.version or None))))

    async def ModelInfer(self, request: pb.ModelInferRequest, context: Any) -> pb.ModelInferResponse:
        async def answer() -> pb.ModelInferResponse:
            typed = codec.request_from_proto(request)
            remaining = context.time_remaining()
            if remaining is not None:  # the client's deadline bounds the wait, as Triton's "timeout" (µs) does
                asked = typed.parameters.get("timeout")
                deadline_us = max(1, int(remaining * 1e6))
                typed.parameters["timeout"] = min(asked, deadline_us) if isinstance(asked, int) else deadline_us
            return codec.response_to_proto(await self.plane.infer(typed))

        return await self._call("ModelInfer", context, request.model_name, answer)

    async def ModelStreamInfer(self, requests: Any, context: Any) -> Any:
        """Triton's decoupled stream: each request of the stream generates, and every token that adds
        text is one response (``text_output``); the last carries ``triton_final_response`` = true
        and ``finish_reason``. Requests of one stream run concurrently; an error ends only its own
        request, as a response with ``error_message``. A stream the client cancels cancels its
        generations: the scheduler frees their sequences before its next step."""
        responses: asyncio.Queue = asyncio.Queue()
        tasks: set[asyncio.Task] = set()
        reading_done, request_done = object(), object()
        pending = [0]  # requests started and not finished

        async def one(request: pb.ModelInferRequest) -> None:
            started = time.perf_counter()
            status = grpc.StatusCode.OK
            self.metrics.in_flight.inc()
            try:
                if self.api_key is not None:
                    metadata = dict(context.invocation_metadata() or ())
                    if not bearer_matches(str(metadata.get("authorization", "")).encode(), self.api_key):
                        raise UnauthorizedError("missing or wrong bearer token")
                async for response in self.plane.stream_infer(codec.request_from_proto(request)):
                    responses.put_nowait(pb.ModelStreamInferResponse(infer_response=codec.response_to_proto(response)))
            except asyncio.CancelledError:
                status = grpc.StatusCode.CANCELLED
                raise
            except Exception as exc:
                status = GRPC_STATUS[kind_of(exc)]
                responses.put_nowait(pb.ModelStreamInferResponse(
                    error_message=_message(exc), infer_response=pb.ModelInferResponse(
                        model_name=request.model_name, id=request.id)))
            finally:
                self.metrics.in_flight.dec()
                self.metrics.requests.labels(request.model_name, "stream_infer", status.name, "grpc").inc()
                self.metrics.request_seconds.labels(request.model_name, "stream_infer", "grpc").observe(
                    time.perf_counter() - started)
                responses.put_nowait(request_done)

        async def read() -> None:
            try:
                async for request in requests:
                    pending[0] += 1
                    task = asyncio.ensure_future(one(request))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
            finally:
                responses.put_nowait(reading_done)

        reader = asyncio.ensure_future(read())
        try:
            reading = True
            while reading or pending[0]:
                item = await responses.get()
                if item is reading_done:
                    reading = False
                elif item is request_done:
                    pending[0] -= 1
                else:
                    yield item
        finally:  # the client cancelled the stream (or it ended): nothing may keep generating
            reader.cancel()
            for task in list(tasks):
                task.cancel()

    async def ModelStatistics(self, request: pb.ModelStatisticsRequest, context: Any) -> pb.ModelStatisticsResponse:
        async def answer() -> pb.ModelStatisticsResponse:
            return codec.statistics_to_proto(
                await self.plane.model_statistics(request.name or None, request.version or None))

        return await self._call("ModelStatistics", context, request.name, answer)

    async def RepositoryIndex(self, request: pb.RepositoryIndexRequest, context: Any) -> pb.RepositoryIndexResponse:
        async def answer() -> pb.RepositoryIndexResponse:
            entries = await self.plane.repository_index(ready_only=request.ready)
            return pb.RepositoryIndexResponse(models=[
                pb.RepositoryIndexResponse.ModelIndex(name=e.name, version=e.version, state=e.state, reason=e.reason)
                for e in entries])

        return await self._call("RepositoryIndex", context, "", answer)

    async def RepositoryModelLoad(self, request: pb.RepositoryModelLoadRequest, context: Any
                                  ) -> pb.RepositoryModelLoadResponse:
        async def answer() -> pb.RepositoryModelLoadResponse:
            _no_repository_name(request.repository_name)
            await self.plane.load_model(request.model_name)
            return pb.RepositoryModelLoadResponse()

        return await self._call("RepositoryModelLoad", context, request.model_name, answer)

    async def RepositoryModelUnload(self, request: pb.RepositoryModelUnloadRequest, context: Any
                                    ) -> pb.RepositoryModelUnloadResponse:
        async def answer() -> pb.RepositoryModelUnloadResponse:
            _no_repository_name(request.repository_name)
            await self.plane.unload_model(request.model_name)
            return pb.RepositoryModelUnloadResponse()

        return await self._call("RepositoryModelUnload", context, request.model_name, answer)


def _now(answer: Callable[[], Any]) -> Callable[[], Awaitable[Any]]:
    """A synchronous answer in the shape ``_call`` awaits."""

    @functools.wraps(answer)
    async def run() -> Any:
        return answer()

    return run


def _no_repository_name(name: str) -> None:
    if name:  # Triton's multi-repository naming; modelkiln serves one repository
        raise InvalidInputError(f"unknown repository '{name}': leave repository_name empty")


def _message(exc: BaseException) -> str:
    """The status details a client sees: the typed error's message, never a traceback or a path."""
    if isinstance(exc, KilnError):
        return str(exc)
    first, repeats = throttle.should_log(bug_key(exc))
    if first:
        more = f" (and {repeats} more like it since the last traceback)" if repeats else ""
        log.error("gRPC request failed: internal error%s", more, exc_info=exc)
    return f"internal server error ({type(exc).__name__})"


async def start_grpc_server(plane: InferenceService, settings: ServeSettings, metrics: Metrics) -> grpc.aio.Server:
    """Bind ``settings.host:settings.grpc_port`` and start serving (on the running event loop)."""
    limit = settings.max_body_bytes
    # One process: no port sharing, so that a port in use is an error. A worker of --workers N
    # shares the port with the others (serve/workers.py: its supervisor has checked it is free).
    shared = (settings.workers or 1) > 1
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", limit),
                                      ("grpc.max_send_message_length", max(limit, 64 * 1024 * 1024)),
                                      ("grpc.so_reuseport", 1 if shared else 0)])
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceServicer(plane, settings.api_key, metrics), server)
    address = f"{settings.host}:{settings.grpc_port}"
    try:
        server.add_insecure_port(address)
    except RuntimeError:
        raise KilnError(f"cannot listen for gRPC on {address} (in use?): pass --grpc-port PORT, or 0 for none") from None
    await server.start()
    log.info("gRPC (KServe v2) listening on %s", address)
    return server
