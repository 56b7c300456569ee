"""The router's ASGI app (``Router`` in ``deployments.py`` serves it at ``/``): the ingress of a
kiln ray deployment (``plan.py`` says why it is laid out so).

- Its own: ``/v2/health/*``, ``/v2``, ``/v1/models``, ``/metrics`` (the router's: its generation
  routes' metrics and the failover counters ``kiln_retries_total``, ``kiln_streams_resumed_total``,
  ``kiln_failovers_failed_total``).
- Generation routes of a text-generation model (OpenAI completions and chat, Triton's generate and
  generate_stream, OIP infer): kiln serve's own app (``serve.http.app.create_app``) over
  ``RemoteGenerationModel``s, whose streams go on on another replica when theirs is lost.
- Every other route of a deployed model (an encoder's infer, predict and embeddings; any model's
  metadata, ready, stats): forwarded to one of its replicas (``ModelReplica.forward``, which runs
  kiln serve's app there, so errors are the same as kiln serve's) and sent again to another when
  the replica is lost before the answer started (``failover.py``)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from ray.serve.handle import DeploymentHandle

from .. import __version__
from ..errors import (InvalidInputError, KilnError, MethodNotAllowedError, ModelNotFoundError, PayloadTooLargeError,
                      RouteNotFoundError, UnauthorizedError)
from ..serve.http.app import OPENAI_PREFIX, PUBLIC_PREFIX, bearer_matches, create_app
from ..serve.dataplane import EXTENSIONS, DataPlane
from ..serve.http.errors import error_response
from ..serve.http.inference_routes import ClientGone
from ..serve.metrics import Metrics
from ..serve.settings import ModelSpec, ServeSettings
from .failover import Retry, replica_lost, unwrap
from .plan import Failover
from .remote_generation import RemoteGenerationModel

Send = Callable[[dict], Awaitable[None]]
Receive = Callable[[], Awaitable[dict]]

GENERATION_ROUTES = ("generate", "generate_stream", "infer")  # per-model routes the router runs itself
OPENAI_GENERATION = ("/v1/completions", "/v1/chat/completions")


class RouterApp:
    def __init__(self, models: list[str], generation: list[dict[str, Any]], settings: ServeSettings,
                 handles: dict[str, DeploymentHandle], failover: Failover):
        self.models = models
        self.settings = settings
        self.handles = handles
        self.failover = failover
        self.api_key = settings.api_key.encode() if settings.api_key else None
        self.metrics = Metrics()
        remote = {m["name"]: RemoteGenerationModel(ModelSpec(m["name"], m["path"], m.get("variant")), settings,
                                                   self.metrics, handles[m["name"]], failover) for m in generation}
        for model in remote.values():
            model.load()
        self.generation = set(remote)
        self.local = without_request_id(create_app(DataPlane(remote, settings, self.metrics), self.metrics))

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
            elif path == "/metrics":
                body, content_type = self.metrics.render()
                await self._send(send, 200, body, [], content_type.encode())
            elif openai:
                if method != "POST":
                    raise MethodNotAllowedError(f"{method} is not allowed here: use POST")
                body = await self._body(receive)
                model = self._model_for(body)
                if model in self.generation and path in OPENAI_GENERATION:
                    await self.local(scope, _replay(body, receive), send)
                else:
                    await self._forward(model, scope, body, send)
            elif path == "/v2/models/stats":
                raise RouteNotFoundError("statistics are per model and replica here: GET /v2/models/{name}/stats")
            elif path.startswith("/v2/models/"):
                parts = path.split("/")  # ['', 'v2', 'models', m, ('versions', v,) route]
                model = parts[3]
                if model not in self.handles:
                    raise ModelNotFoundError(f"unknown model '{model}' (serving: {', '.join(self.models)})")
                if model in self.generation and parts[-1] in GENERATION_ROUTES and len(parts) in (5, 7):
                    await self.local(scope, receive, send)
                else:
                    await self._forward(model, scope, await self._body(receive), send)
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

    async def _forward(self, model: str, scope: dict, body: bytes, send: Send) -> None:
        """The request on one of ``model``'s replicas; sent again to another when that one is lost
        before the answer started. The response start is held until the first body chunk (an
        answer is sent whole), so a loss between the two is still retried; once the last chunk is
        out, the answer is whole, whatever happens to the replica after."""
        handle = self.handles[model].options(stream=True)
        retry = Retry(self.failover, model, self.metrics)
        first_wait = self.settings.request_timeout_s  # the replica answers by then (a 503 if it must)
        while True:
            call = handle.forward.remote(scope["method"], scope["path"], scope["query_string"], scope["headers"], body)
            start: dict | None = None
            sent = False
            try:
                async for chunk in _first_within(call, first_wait):
                    if isinstance(chunk, dict):
                        start = chunk
                        continue
                    data, more = chunk
                    if not sent and start is not None:
                        await send({"type": "http.response.start", "status": start["status"],
                                    "headers": start["headers"]})
                        sent = True
                    await send({"type": "http.response.body", "body": data, "more_body": more})
                    if not more:
                        call.cancel()  # the answer is whole: the call's own end does not matter
                        return
                raise KilnError(f"model '{model}': the replica ended the answer early")
            except asyncio.TimeoutError:
                call.cancel()
                raise retry.timed_out() from None
            except Exception as exc:
                if sent or not replica_lost(exc):  # half an answer out: nothing clean left to say
                    error = unwrap(exc)
                    if sent or not isinstance(error, KilnError):
                        raise
                    raise error from None  # the replica's typed error, as kiln serve answers it
                call.cancel()
                await retry.after_loss(exc, resumed=False)
                first_wait = retry.remaining()

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
    async def _send(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]],
                    content_type: bytes = b"application/json") -> None:
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", content_type), (b"content-length", str(len(body)).encode()), *headers]})
        await send({"type": "http.response.body", "body": body})


async def _first_within(call: Any, seconds: float) -> Any:
    """``call``'s items, the first within ``seconds`` (else ``asyncio.TimeoutError``)."""
    first = True
    while True:
        try:
            item = await (asyncio.wait_for(call.__anext__(), seconds) if first else call.__anext__())
        except StopAsyncIteration:
            return
        first = False
        yield item


def _replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` with the body already read given back first (then the client's own messages:
    a disconnect still reaches the app)."""
    given = False

    async def replayed() -> dict:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


def without_request_id(app: Callable[..., Awaitable[None]], tag: tuple[bytes, bytes] | None = None
                       ) -> Callable[..., Awaitable[None]]:
    """``app`` as served behind Ray's proxy: no ``root_path`` (the proxy sets it to the route prefix,
    and Starlette would then match routes against the path with the prefix cut off; kiln serve's
    routes are the full paths), no ``x-request-id`` of its own (the proxy gives every request one,
    which the app adopts, and puts it on the answer itself), and ``tag`` added to every answer."""

    async def served(scope: dict, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        scope = {**scope, "root_path": ""}

        async def send_tagged(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0] != b"x-request-id"]
                message["headers"] = [*headers, tag] if tag else headers
            await send(message)

        await app(scope, receive, send_tagged)

    return served
