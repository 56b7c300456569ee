"""The Ray Serve deployments (``plan.py`` says how they are laid out and why).

``ModelReplica``: one model's replica, the whole ``kiln serve`` HTTP front-end
(``serve.app.create_app``) over a data plane built in the replica (``build_dataplane``), with its
own batcher and engine threads sized from the replica's CPU share. Ray's proxy hands it the ASGI
requests of ``/v2/models/{name}/...``; ``forward`` runs the same app for a request the router
passes on (OpenAI routes name their model in the body). Every answer carries ``x-kiln-replica``,
the replica's id, so that a client can see which replica answered.

``Router``: the routes at ``/`` that name no model in their path."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from ray import serve
from ray.serve.handle import DeploymentHandle

from .. import __version__
from ..errors import (InvalidInputError, KilnError, MethodNotAllowedError, ModelNotFoundError, ModelNotReadyError,
                      PayloadTooLargeError, RouteNotFoundError, UnauthorizedError)
from ..serve.app import OPENAI_PREFIX, PUBLIC_PREFIX, bearer_matches, create_app
from ..serve.dataplane import EXTENSIONS, DataPlane, build_dataplane
from ..serve.errors import error_response
from ..serve.inference_routes import ClientGone
from ..serve.settings import ModelSpec, ServeSettings
from .plan import MODEL_DEPLOYMENT, ROUTER_DEPLOYMENT

log = logging.getLogger("modelkiln.ray")

REPLICA_HEADER = b"x-kiln-replica"
Send = Callable[[dict], Awaitable[None]]
Receive = Callable[[], Awaitable[dict]]


def replica_settings(values: dict[str, Any], model: dict[str, Any] | None = None) -> ServeSettings:
    """The settings a replica runs with, validated by the declaration (a bad value in a hand-edited
    config fails the replica's start with the setting's name)."""
    settings = ServeSettings().replace(**values)
    if model is not None:
        settings = settings.with_models((ModelSpec(model["name"], model["path"], model.get("variant")),))
    return settings


def replica_front(app: Callable[..., Awaitable[None]], replica: str) -> Callable[..., Awaitable[None]]:
    """The ASGI ``app`` as a replica serves it: ``x-kiln-replica: replica`` added to every answer,
    and no ``root_path``. Ray's proxy sets it to the route prefix (``/v2/models/{name}``) and
    Starlette would then match routes against the path with the prefix cut off; kiln serve's
    routes are the full paths. Ray's proxy gives every request an ``x-request-id`` (the app
    adopts it) and puts it on the answer itself, so the app's copy is left out."""
    tag = (REPLICA_HEADER, replica.encode())

    async def tagged(scope: dict, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        scope = {**scope, "root_path": ""}

        async def send_tagged(message: dict) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*(h for h in message.get("headers", []) if h[0] != b"x-request-id"), tag]
            await send(message)

        await app(scope, receive, send_tagged)

    return tagged


@serve.deployment(name=MODEL_DEPLOYMENT)
@serve.ingress()
class ModelReplica:
    def __init__(self, model: dict[str, Any], settings: dict[str, Any]):
        self.settings = replica_settings(settings, model)
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.plane: DataPlane | None = None

    def __serve_build_asgi_app__(self) -> Any:
        # Blocking (loads and warms the model) before the replica takes requests, as kiln serve does
        # before binding its port; Serve runs the app's lifespan (which starts and stops the batchers).
        self.plane = build_dataplane(self.settings)
        model = next(iter(self.plane.models.values()))
        log.info("replica %s: %s (%s), %d engine instance(s) x %d thread(s) on %s cpu(s)", self.replica, model.name,
                 model.variant.name, model.instances, model.threads, self.settings.cpus)
        return replica_front(create_app(self.plane), self.replica)

    def ready(self) -> bool:
        return self.plane is not None and self.plane.ready()

    async def forward(self, method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]],
                      body: bytes) -> AsyncIterator[dict[str, Any] | bytes]:
        """Run one HTTP request through this replica's app; yields the response start
        (``{"status", "headers"}``), then its body chunks (streamed routes stream)."""
        messages: asyncio.Queue[dict | None] = asyncio.Queue()
        answered = asyncio.Event()
        body_sent = False

        async def receive() -> dict:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await answered.wait()  # the router's client is still there until the answer is out
            return {"type": "http.disconnect"}

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query,
                 "root_path": "", "headers": headers, "client": None, "server": None, "state": {}}
        task = asyncio.create_task(self.app(scope, receive, messages.put))  # type: ignore[attr-defined]
        task.add_done_callback(lambda _: messages.put_nowait(None))
        try:
            while (message := await messages.get()) is not None:
                if message["type"] == "http.response.start":
                    yield {"status": message["status"], "headers": list(message.get("headers", []))}
                elif message.get("body"):
                    yield message["body"]
            await task  # an exception in the app is the router's 500
        finally:
            answered.set()
            if not task.done():  # the router's client left: stop the request like a disconnect would
                task.cancel()


def model_app(args: dict[str, Any]) -> Any:
    """``serve deploy``'s builder for one model (``import_path: modelkiln.ray.deployments:model_app``)."""
    return ModelReplica.bind(args["model"], args["settings"])


class RouterApp:
    """ASGI app of the routes without a model in the path: health, server metadata, OpenAI's model
    list, and the OpenAI routes (``/v1/...``) whose model is named in the JSON body."""

    def __init__(self, models: list[str], settings: ServeSettings,
                 handles: dict[str, DeploymentHandle]):
        self.models = models
        self.settings = settings
        self.handles = handles
        self.api_key = settings.api_key.encode() if settings.api_key else None

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        openai = path.startswith(OPENAI_PREFIX)
        try:
            if self.api_key is not None and not path.startswith(PUBLIC_PREFIX):
                if not bearer_matches(dict(scope["headers"]).get(b"authorization", b""), self.api_key):
                    raise UnauthorizedError("missing or wrong bearer token")
            if path == "/v2/health/live":
                await self._json(send, 200, None)
            elif path == "/v2/health/ready":
                await self._json(send, 200 if await self._ready() else 503, None)
            elif path == "/v2":
                extensions = [e for e in EXTENSIONS if e != "model_repository"]  # the models are fixed at deploy
                await self._json(send, 200, {"name": "modelkiln", "version": __version__, "extensions": extensions})
            elif path == "/v1/models":
                await self._json(send, 200, {"object": "list", "data": [
                    {"id": m, "object": "model", "owned_by": "modelkiln", "created": 0} for m in self.models]})
            elif openai:
                if method != "POST":
                    raise MethodNotAllowedError(f"{method} is not allowed here: use POST")
                await self._forward(scope, receive, send)
            elif path == "/v2/models/stats":
                raise RouteNotFoundError("statistics are per model and replica here: GET /v2/models/{name}/stats")
            elif path.startswith("/v2/models/"):  # a model that is not deployed (those are routed past the router)
                raise ModelNotFoundError(f"unknown model '{path.split('/')[3]}' (serving: {', '.join(self.models)})")
            else:
                raise RouteNotFoundError(f"no route {path} (per-model routes are under /v2/models/{{name}}/)")
        except ClientGone:
            return  # nobody to answer
        except Exception as exc:  # typed errors → their status, anything else → 500 (logged, throttled)
            status, body, headers = error_response(exc, None, openai=openai)
            await self._send(send, status, body, [(k.encode(), v.encode()) for k, v in headers.items()])

    async def _ready(self) -> bool:
        try:
            return all(await asyncio.gather(*(h.ready.remote() for h in self.handles.values())))
        except Exception:  # a replica that cannot answer is not ready
            return False

    async def _forward(self, scope: dict, receive: Receive, send: Send) -> None:
        body = await self._body(receive)
        handle = self.handles[self._model_for(body)]
        chunks = handle.options(stream=True).forward.remote(scope["method"], scope["path"], scope["query_string"],
                                                           scope["headers"], body)
        started = False
        try:
            async for chunk in chunks:
                if isinstance(chunk, dict):
                    await send({"type": "http.response.start", "status": chunk["status"], "headers": chunk["headers"]})
                    started = True
                else:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except KilnError:
            raise
        except Exception as exc:  # the replica died or was stopped under the request
            if started:
                raise  # half an answer sent: nothing clean left to say; the connection is dropped
            raise ModelNotReadyError(f"the model replica failed before answering ({type(exc).__name__}); "
                                     "retry") from exc
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _model_for(self, body: bytes) -> str:
        """The deployed model the body names; with one model deployed, that one (its replica then
        answers a bad body exactly as kiln serve does)."""
        try:
            named = orjson.loads(body).get("model") if body else None
        except (orjson.JSONDecodeError, AttributeError):
            named = None
        if isinstance(named, str) and named in self.handles:
            return named
        if len(self.models) == 1:
            return self.models[0]
        if named is None:
            raise InvalidInputError(f"name the model in the body's \"model\" (serving: {', '.join(self.models)})")
        raise ModelNotFoundError(f"unknown model {named!r} (serving: {', '.join(self.models)})")

    async def _body(self, receive: Receive) -> bytes:
        limit = self.settings.max_body_bytes
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone()
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                raise PayloadTooLargeError(f"request body exceeds the limit of {limit} bytes")
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _json(self, send: Send, status: int, data: Any) -> None:
        await self._send(send, status, b"" if data is None else orjson.dumps(data), [])

    @staticmethod
    async def _send(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]})
        await send({"type": "http.response.body", "body": body})


@serve.deployment(name=ROUTER_DEPLOYMENT)
@serve.ingress()
class Router:
    def __init__(self, models: list[str], settings: dict[str, Any]):
        self.models = list(models)
        self.settings = replica_settings(settings)

    def __serve_build_asgi_app__(self) -> Any:
        handles = {m: serve.get_deployment_handle(MODEL_DEPLOYMENT, app_name=m) for m in self.models}
        return RouterApp(self.models, self.settings, handles)


def router_app(args: dict[str, Any]) -> Any:
    """``serve deploy``'s builder for the router (``import_path: modelkiln.ray.deployments:router_app``)."""
    return Router.bind(args["models"], args["settings"])


def build(application: dict[str, Any]) -> Any:
    """One application of ``plan()``'s config, bound with its deployment options, as ``serve
    deploy`` would build it from the YAML."""
    options = dict(application["deployments"][0])
    name = options.pop("name")
    deployment = {MODEL_DEPLOYMENT: ModelReplica, ROUTER_DEPLOYMENT: Router}[name]
    args = application["args"]
    if deployment is ModelReplica:
        return ModelReplica.options(**options).bind(args["model"], args["settings"])
    return Router.options(**options).bind(args["models"], args["settings"])


__all__ = ["ModelReplica", "Router", "RouterApp", "build", "model_app", "router_app", "REPLICA_HEADER"]
