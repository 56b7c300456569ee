"""HTTP: a thin ASGI gate in front of two route sets.

``Gate`` does what every request needs: bearer-token check, request id, in-flight gauge,
per-route outcome metrics and the optional access log. Inference requests then go to the bare
ASGI handler in ``inference_routes`` (the hot path); everything else (health, metadata, stats,
metrics, OpenAI's model list, the web page of ``ui/``) is a small FastAPI app. Both call the same
data plane, and errors become responses in one place (``errors.error_response``)."""

from __future__ import annotations

import functools
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import asdict
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from ...errors import (InvalidInputError, KilnError, MethodNotAllowedError, RouteNotFoundError,
                      UnauthorizedError)
from .. import ui
from . import inference_routes
from ..auth import bearer_matches
from ..dataplane import DataPlane, build_dataplane
from .errors import error_response
from ..generation import generate_routes, openai_routes, responses_routes, tokenize_routes
from ..generation.http import CLIENT_CLOSED
from ..metrics import Metrics
from .request_watch import RequestWatch
from ..settings import ServeSettings
from ..types import Duration, ModelMetadata, ModelStatistics, TensorSpec

log = logging.getLogger("modelkiln.serve")
access = logging.getLogger("modelkiln.serve.access")

JSON = "application/json"
PUBLIC_PREFIX = "/v2/health/"  # routes that need no API key: the probes, and the web page's files (ui.PATHS)
TIMED_ROUTES = frozenset(("infer", "predict", "embeddings", "completions", "chat_completions", "generate",
                          "generate_stream"))  # in kiln_request_duration_seconds
OPENAI_PREFIX = "/v1/"  # errors in OpenAI's shape


def json_response(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type=JSON)


def metadata_json(m: ModelMetadata) -> dict[str, Any]:
    def tensor(t: TensorSpec) -> dict[str, Any]:
        return {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}

    return {"name": m.name, "versions": list(m.versions), "platform": m.platform,
            "inputs": [tensor(t) for t in m.inputs], "outputs": [tensor(t) for t in m.outputs],
            "parameters": m.parameters}


def stats_json(s: ModelStatistics) -> dict[str, Any]:
    """Triton's JSON for one model's statistics."""
    def duration(d: Duration) -> dict[str, int]:
        return {"count": d.count, "ns": d.ns}

    return {"name": s.name, "version": s.version, "last_inference": s.last_inference_ms,
            "inference_count": s.inference_count, "execution_count": s.execution_count,
            "inference_stats": {"success": duration(s.success), "fail": duration(s.fail),
                                "queue": duration(s.queue), "compute_infer": duration(s.compute_infer)}}


def route_of(path: str) -> tuple[str, str]:
    """(model, route) labels for metrics, without a regex per request."""
    parts = path.strip("/").split("/")
    if len(parts) >= 3 and parts[0] == "v2" and parts[1] == "models":
        return parts[2], parts[-1] if parts[-1] in ("infer", "predict", "ready", "stats", "generate",
                                                    "generate_stream") else "metadata"
    if path in ("/v1/embeddings", "/v1/completions", "/v1/chat/completions", "/v1/responses"):
        return "", path[4:].replace("/", "_")
    if path in ui.PATHS:
        return "", "ui"
    return "", parts[-1] if parts[0] in ("v2", "metrics") else "other"


class RequestIds:
    """Unique ids for requests that bring none: a random per-process prefix and a counter
    (uuid4 per request was a measurable share of the event loop's time under load)."""

    def __init__(self) -> None:
        self._prefix = os.urandom(6).hex()
        self._count = itertools.count(1)

    def next(self) -> str:
        return f"{self._prefix}-{next(self._count)}"


class Gate:
    """Pure ASGI middleware (no per-request task or body buffering, unlike BaseHTTPMiddleware)."""

    def __init__(self, app: Callable[..., Awaitable[None]], api_key: str | None, metrics: Metrics,
                 plane: DataPlane, access_log: bool, watch: RequestWatch, open_paths: frozenset[str] = frozenset()):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.open_paths = open_paths  # besides /v2/health/*: the web page's files (``ui.PATHS``)
        self.metrics = metrics
        self.plane = plane
        self.access_log = access_log
        self.ids = RequestIds()
        self.watch = watch
        # prometheus_client's ``labels(...)`` validates and hashes its arguments on every call: keep
        # the labelled children (bounded: model names come from request paths)
        self._requests_child = functools.lru_cache(maxsize=1024)(
            lambda model, route, status: metrics.requests.labels(model, route, str(status), "http"))
        self._seconds_child = functools.lru_cache(maxsize=256)(
            lambda model, route: metrics.request_seconds.labels(model, route, "http"))

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        headers = dict(scope["headers"])
        request_id = (headers.get(b"x-request-id") or b"").decode("latin-1")[:128] or self.ids.next()
        scope.setdefault("state", {})["request_id"] = request_id
        path: str = scope["path"]
        if self.api_key is not None and not path.startswith(PUBLIC_PREFIX) and path not in self.open_paths:
            if not bearer_matches(headers.get(b"authorization", b""), self.api_key):
                status = await inference_routes.send_error(send, UnauthorizedError("missing or wrong bearer token"),
                                                           request_id, {"www-authenticate": "Bearer"},
                                                           openai=path.startswith(OPENAI_PREFIX))
                self._done(path, status, started, request_id, scope, "")
                return
        route = inference_routes.match(path)
        status, model = 500, ""  # unless an answer is sent: for the metrics
        self.metrics.in_flight.inc()
        try:
            if route is not None:  # the hot path, without FastAPI
                status, model = await inference_routes.handle(self.plane, route, scope, headers, receive, send,
                                                              request_id, self.watch)
            else:
                status = await self._fastapi(scope, receive, send, request_id)
        finally:
            self.metrics.in_flight.dec()
            self._done(path, status, started, request_id, scope, model)

    async def _fastapi(self, scope: dict, receive: Callable, send: Callable, request_id: str) -> int:
        """The other routes, through FastAPI, with the request id added to the answer; returns the
        status answered."""
        status = [500]

        async def send_wrapper(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            await send(message)

        await self.app(scope, receive, send_wrapper)
        return status[0]

    def _done(self, path: str, status: int, started: float, request_id: str, scope: dict, answered_by: str) -> None:
        """``answered_by``: the model the data plane resolved (embeddings name it in the body)."""
        seconds = time.perf_counter() - started
        model, route = route_of(path)
        model = answered_by or model
        self._requests_child(model, route, status).inc()
        if route in TIMED_ROUTES:
            self._seconds_child(model, route).observe(seconds)
        if self.access_log:
            access.info("%s %s %s %d %.1fms", request_id, scope["method"], path, status, seconds * 1000)


def build_app(settings: ServeSettings) -> Any:
    """The HTTP front-end over ``build_dataplane(settings)`` (loads the models: blocking)."""
    return create_app(build_dataplane(settings))


def create_app(plane: DataPlane, metrics: Metrics | None = None, *, on_shutdown: Callable[[], None] | None = None
               ) -> Any:
    """The HTTP front-end over a data plane (``build_dataplane``). ``on_shutdown`` runs once uvicorn
    has answered every accepted request (default: drain and stop the models)."""
    settings = plane.settings
    metrics = metrics or plane.metrics
    watch = RequestWatch(settings.body_read_timeout_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await plane.start()  # poll mode's repository scans
        grpc_server = None
        if settings.grpc_port:  # the same process, loop, models and batchers as HTTP
            from ..grpc.server import start_grpc_server

            grpc_server = await start_grpc_server(plane, settings, metrics)
        yield
        if grpc_server is not None:  # new calls are refused; accepted ones get the grace period
            await grpc_server.stop(settings.request_timeout_s)
        watch.close()
        await plane.close()
        # uvicorn has stopped accepting and every accepted request has been answered by now;
        # the batchers drain whatever is still queued, then their threads end.
        (on_shutdown or plane.stop)()

    app = FastAPI(title="modelkiln", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)

    def fail(request: Request, exc: BaseException) -> Response:
        status, body, headers = error_response(exc, request.scope.get("state", {}).get("request_id"),
                                               openai=request.url.path.startswith(OPENAI_PREFIX))
        return Response(body, status_code=status, media_type=JSON, headers=headers)

    @app.exception_handler(KilnError)
    async def kiln_error(request: Request, exc: KilnError) -> Response:
        return fail(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = {404: RouteNotFoundError, 405: MethodNotAllowedError}.get(exc.status_code)
        if kind is not None:
            return fail(request, kind(str(exc.detail)))
        return Response(orjson.dumps({"error": str(exc.detail)}), status_code=exc.status_code, media_type=JSON,
                        headers=exc.headers)  # a 408's "connection: close"

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, exc: ClientDisconnect) -> Response:
        return Response(status_code=CLIENT_CLOSED)  # gone before its body was in: nobody to answer, no bug

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        return fail(request, InvalidInputError(str(exc)))

    @app.exception_handler(Exception)
    async def bug(request: Request, exc: Exception) -> Response:
        return fail(request, exc)

    # -- health and metadata --------------------------------------------------------------------
    @app.get("/v2/health/live")
    async def live() -> Response:
        return Response(status_code=200)

    @app.get("/v2/health/ready")
    async def ready() -> Response:
        return Response(status_code=200 if plane.ready() else 503)

    @app.get("/v2")
    async def server_metadata() -> Response:
        return json_response(asdict(plane.server_metadata()))

    @app.get("/v2/models/stats")
    @app.get("/v2/models/{name}/stats")
    @app.get("/v2/models/{name}/versions/{version}/stats")
    async def model_stats(name: str | None = None, version: str | None = None) -> Response:
        return json_response({"model_stats": [stats_json(s) for s in await plane.model_statistics(name, version)]})

    @app.get("/v2/models/{name}")
    @app.get("/v2/models/{name}/versions/{version}")
    async def model_metadata(name: str, version: str | None = None) -> Response:
        return json_response(metadata_json(plane.model_metadata(name, version)))

    @app.get("/v2/models/{name}/ready")
    @app.get("/v2/models/{name}/versions/{version}/ready")
    async def model_ready(name: str, version: str | None = None) -> Response:
        return Response(status_code=200 if plane.model_ready(name, version) else 503)

    # -- Triton's model repository extension (serve/repository.py) --------------------------------
    @app.post("/v2/repository/index")
    async def repository_index(request: Request) -> Response:
        body = await request.body()
        try:
            options = orjson.loads(body) if body.strip() else {}
        except orjson.JSONDecodeError as exc:
            raise InvalidInputError(f"the index request body is not JSON: {exc}") from None
        ready = options.get("ready", False) if isinstance(options, dict) else None
        if not isinstance(ready, bool):
            raise InvalidInputError('the index request body must be {} or {"ready": true|false}')
        return json_response([asdict(e) for e in await plane.repository_index(ready_only=ready)])

    @app.post("/v2/repository/models/{name}/load")
    async def repository_load(name: str) -> Response:
        await plane.load_model(name)  # Triton's optional body (config/file overrides) is not supported
        return Response(status_code=200)  # Triton answers an empty 200

    @app.post("/v2/repository/models/{name}/unload")
    async def repository_unload(name: str) -> Response:
        await plane.unload_model(name)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics_route() -> Response:
        plane.publish_queue_gauges()
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    # -- text generation: OpenAI completions, chat and responses, Triton's generate extension (serve/generation/)
    generate_routes.register(app, plane)
    openai_routes.register(app, plane)
    responses_routes.register(app, plane)
    tokenize_routes.register(app, plane)

    @app.get("/v1/models")
    async def openai_models() -> Response:
        return json_response({"object": "list", "data": [
            {"id": m.name, "object": "model", "owned_by": "modelkiln", "created": 0} for m in plane.models.values()]})

    if settings.ui:  # the page at / and its files (--no-ui: / is a 404, as any unknown route)
        ui.register(app)
    return Gate(app, settings.api_key, metrics, plane, settings.access_log, watch,
                open_paths=ui.PATHS if settings.ui else frozenset())
