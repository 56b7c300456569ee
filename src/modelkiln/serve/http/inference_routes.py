"""The inference routes as a bare ASGI handler: the hot path of every request under load.

FastAPI serves the management routes (health, metadata, stats, metrics). The three inference
routes skip it: its middleware stack (error, telemetry, body-limit, exception and exit-stack
layers, then routing and the endpoint wrappers) cost about four times the event-loop time of
our own work per request, and on a 2-core machine every microsecond the event loop holds the
GIL delays an engine thread that wants it back. Here a request is: match the path, read the
body (bounded in size and time), call the data plane (while watching for the client leaving),
send one response."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from ...errors import MethodNotAllowedError, PayloadTooLargeError
from .. import codec
from . import json_api
from ..dataplane import DataPlane
from .errors import error_response
from .request_watch import RequestWatch

JSON = b"application/json"
BINARY = b"application/octet-stream"

Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


class ClientGone(Exception):
    """The client disconnected before its body arrived: nothing to answer."""


def match(path: str) -> tuple[str, str | None, str] | None:
    """(model, version, route) for an inference route, else None (FastAPI takes the request):
    ``/v2/models/{m}[/versions/{v}]/infer|predict`` and ``/v1/embeddings``."""
    if path == "/v1/embeddings":
        return "", None, "embeddings"
    parts = path.split("/")  # ['', 'v2', 'models', m, ('versions', v,) route]
    if len(parts) == 5 and parts[1] == "v2" and parts[2] == "models" and parts[4] in ("infer", "predict") and parts[3]:
        return parts[3], None, parts[4]
    if (len(parts) == 7 and parts[1] == "v2" and parts[2] == "models" and parts[4] == "versions"
            and parts[6] in ("infer", "predict") and parts[3] and parts[5]):
        return parts[3], parts[5], parts[6]
    return None


async def read_body(receive: Receive, headers: dict[bytes, bytes], limit: int) -> bytes:
    """The request body, refusing (413) more than ``limit`` bytes before reading them all. (Its
    time is bounded by ``RequestWatch``.)"""
    length = headers.get(b"content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise PayloadTooLargeError(f"request body of {int(length)} bytes exceeds the limit of {limit}")
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLargeError(f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    encoding = headers.get(b"content-encoding")
    return codec.decompress(body, encoding.decode("latin-1") if encoding else None, limit)


async def send_response(send: Send, status: int, body: bytes, content_type: bytes, request_id: bytes,
                        extra: list[tuple[bytes, bytes]] | None = None) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode()),
               (b"x-request-id", request_id)]
    if extra:
        headers += extra
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def send_error(send: Send, exc: BaseException, request_id: str,
                     extra_headers: dict[str, str] | None = None, openai: bool = False) -> int:
    """Answer ``exc`` with its status (``errors.error_response``: ``{"error": ...}``, or OpenAI's
    error object when ``openai``); returns the status."""
    status, payload, headers = error_response(exc, request_id, openai)
    headers.update(extra_headers or {})
    await send_response(send, status, payload, JSON, request_id.encode(),
                        [(k.encode(), v.encode()) for k, v in headers.items()])
    return status


async def handle(plane: DataPlane, route: tuple[str, str | None, str], scope: dict[str, Any],
                 headers: dict[bytes, bytes], receive: Receive, send: Send, request_id: str,
                 watch: RequestWatch) -> tuple[int, str]:
    """Answer one inference request; returns (the status sent, the model that answered: for an
    embeddings request it is named in the body, not the path; "" when none was resolved).
    499 (nginx's "client closed request"): the client went away before its answer, which is
    not computed if it was still queued (``RequestWatch``); nothing is sent then."""
    name, version, kind = route
    rid = request_id.encode()
    openai = kind == "embeddings"
    if scope["method"] != "POST":
        return await send_error(send, MethodNotAllowedError(f"{scope['method']} is not allowed here: use POST"),
                                request_id, {"allow": "POST"}, openai), name
    watched = watch.enter(receive)
    try:
        body = await read_body(receive, headers, plane.settings.max_body_bytes)
        watch.body_read(watched, receive)
        if kind != "embeddings":  # unknown model, not ready, queue full: answered before decoding anything
            plane.admit(name, version)
        if kind == "predict":
            answer = await plane.predict(json_api.decode_predict(body, name, version))
            watch.answering(watched)
            await send_response(send, 200, json_api.encode_predict(answer), JSON, rid)
        elif kind == "embeddings":
            vectors = await plane.embeddings(json_api.decode_embeddings(body))
            watch.answering(watched)
            name = vectors.model_name
            await send_response(send, 200, json_api.encode_embeddings(vectors), JSON, rid)
        else:
            header_length = headers.get(codec.HEADER_LENGTH.encode())
            request = codec.decode_request(body, header_length.decode("latin-1") if header_length is not None else None,
                                           name, version)
            response = await plane.infer(request)
            watch.answering(watched)
            content, json_length = codec.encode_response(request, response)
            if json_length is None:
                await send_response(send, 200, content, JSON, rid)
            else:
                await send_response(send, 200, content, BINARY, rid,
                                    [(b"inference-header-content-length", str(json_length).encode())])
        return 200, name
    except ClientGone:
        return 499, name
    except asyncio.CancelledError:
        if not watched.why:
            raise  # shutdown, not the watch
        task = asyncio.current_task()
        assert task is not None  # a request is handled in a task
        task.uncancel()
        if watched.why == "gone":
            return 499, name
        error = orjson.dumps({"error": f"request body not received within {watch.body_timeout_s:g}s"})
        await send_response(send, 408, error, JSON, rid, [(b"connection", b"close")])
        return 408, name
    except Exception as exc:  # typed errors → their status; anything else is a bug → 500 (logged)
        watch.answering(watched)
        return await send_error(send, exc, request_id, openai=openai), name
    finally:
        watch.leave(watched)
