"""What the generation routes share over HTTP: the JSON body, server-sent events, and noticing a
client that leaves.

A streamed answer is a ``StreamingResponse`` of SSE lines; Starlette listens for the client's
disconnect next to it (uvicorn speaks ASGI 2.3) and cancels the body iterator, whose ``finally``
closes the generation stream: the scheduler frees the sequence before its next step. A whole
answer is awaited next to a watcher of ``receive()`` for the same reason."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, TypeVar

import orjson
from fastapi import Request
from starlette.exceptions import HTTPException
from starlette.responses import Response, StreamingResponse

from ...errors import InvalidInputError, KilnError, PayloadTooLargeError
from ..codec import decompress
from ..http.errors import error_response
from .model import GenerationModel

T = TypeVar("T")
GONE: Any = object()  # what ``unless_gone`` returns when the client left first
CLIENT_CLOSED = 499  # nginx's "client closed request": counted in the metrics, never sent

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}  # no proxy buffering of tokens


async def json_body(request: Request, limit: int, timeout: float) -> dict[str, Any]:
    """The request's JSON object: at most ``limit`` bytes, all of it within ``timeout`` seconds (a
    client that stalls mid-body gets 408 and the connection closed, as on the inference routes)."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise PayloadTooLargeError(f"request body of {length} bytes exceeds the limit of {limit}")
    try:
        body = await asyncio.wait_for(request.body(), timeout)
    except asyncio.TimeoutError:
        raise HTTPException(408, f"request body not received within {timeout:g}s",
                            headers={"connection": "close"}) from None
    if len(body) > limit:
        raise PayloadTooLargeError(f"request body exceeds the limit of {limit} bytes")
    # as the inference routes: gzip and deflate undone within the limit, any other coding refused
    body = decompress(body, request.headers.get("content-encoding"), limit)
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidInputError(f"the request body is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidInputError("the request body must be a JSON object")
    return data


def sse(data: Any) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


class Answering(Protocol):
    """A stream, or a request's several (``answers.Answers``)."""

    async def started(self) -> None: ...

    async def aclose(self) -> None: ...


def sse_response(stream: Answering, events: AsyncIterator[bytes], openai: bool) -> StreamingResponse:
    """Send ``events`` once the stream is accepted (a refusal is an HTTP status); an error after
    the first byte becomes an ``error`` event (the status is sent)."""

    async def body() -> AsyncGenerator[bytes, None]:
        try:
            async for event in events:
                yield event
        except KilnError as exc:  # a timeout or a failure mid-stream: say so in the stream
            _, payload, _ = error_response(exc, openai=openai)
            yield b"data: " + payload + b"\n\n"
        finally:
            await stream.aclose()  # a cancelled body (client gone) frees the sequence

    return _AcceptedStreamResponse(stream, openai, body(), media_type="text/event-stream", headers=SSE_HEADERS)


class _AcceptedStreamResponse(StreamingResponse):
    """Starts the answer (status 200, headers) only once ``stream.started()`` returns: kiln serve's
    streams are accepted when they are made, kiln ray's router's once a replica took the request,
    which may still refuse it (a full queue: 503). A stream that names the replica it runs on
    (``replica``: kiln ray) says so in ``x-kiln-replica``, as kiln ray's other answers do."""

    def __init__(self, stream: Answering, openai: bool, body: AsyncGenerator[bytes, None], **kwargs: Any):
        super().__init__(body, **kwargs)
        self.stream, self.openai, self._sse_body = stream, openai, body

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await self.stream.started()
        except KilnError as exc:
            await self.stream.aclose()
            await self._sse_body.aclose()
            status, payload, headers = error_response(exc, openai=self.openai)
            await Response(payload, status, headers, media_type="application/json")(scope, receive, send)
            return
        replica = getattr(self.stream, "replica", None)
        if replica:
            self.raw_headers.append((b"x-kiln-replica", replica.encode()))
        await super().__call__(scope, receive, send)


async def unless_gone(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result; if the client disconnects first, ``work`` is cancelled and ``GONE`` returned."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():  # the client left: stop generating for nobody
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return GONE
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def whole_answer(request: Request, model: GenerationModel, work: Awaitable[dict[str, Any]], started: float,
                       encode: Callable[[dict[str, Any]], bytes]) -> Response:
    """The non-streamed answer of a generation route: ``work`` unless the client leaves first
    (then nothing is sent and the metrics count a 499), recorded in the model's statistics as a
    success or failure since ``started`` (time.perf_counter)."""
    try:
        answer = await unless_gone(request, work)
    except BaseException:
        model.record(False, time.perf_counter() - started)
        raise
    model.record(True, time.perf_counter() - started)
    if answer is GONE:
        return Response(status_code=CLIENT_CLOSED)
    return Response(encode(answer), media_type="application/json")
