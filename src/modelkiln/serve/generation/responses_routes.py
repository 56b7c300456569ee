"""OpenAI's Responses API on a text-generation model: ``POST /v1/responses`` (whole or streamed),
``GET`` and ``DELETE /v1/responses/{id}``, so that the unmodified ``openai`` client
(``client.responses.create``, ``.stream``, ``.parse``) and the OpenAI Agents SDK work.

A request is translated into the chat route's request (responses_request.py) and answered by the
chat route's machinery (``openai_routes.start_chat``); the answer is written back as a response
object and its events (responses_output.py). Streams are server-sent events with an ``event:``
line per event, as OpenAI sends them (no ``[DONE]``).

Stored responses (OpenAI's ``store``, true unless set to false) are kept in this process, the
least recently used dropped first past ``--stored-responses``: each holds the response object
(for ``GET``) and its conversation (its input items, those of the response it continued, and its
output), which a request naming it in ``previous_response_id`` continues. An unknown
``previous_response_id`` is a 400 (a field of the request that does not hold); ``GET`` or
``DELETE`` of an unknown id is a 404, as OpenAI answers them."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import FastAPI, Request
from starlette.responses import Response

from ...errors import InvalidInputError, KilnError, ResponseNotFoundError
from ..dataplane import DataPlane
from .answers import Answers
from .http import json_body, sse_response, whole_answer
from .openai_routes import start_chat
from .responses_output import ResponseWriter, new_response
from .responses_request import responses_request


@dataclass
class Stored:
    response: dict[str, Any]
    items: list[dict[str, Any]]  # the conversation: input items, then the output's


class ResponseStore:
    """Stored responses by id, the least recently used dropped first past ``size`` (0: none kept).
    Used from the event loop only."""

    def __init__(self, size: int):
        self.size = size
        self._kept: OrderedDict[str, Stored] = OrderedDict()

    def put(self, response: dict[str, Any], items: list[dict[str, Any]]) -> None:
        if self.size <= 0:
            return
        self._kept[response["id"]] = Stored(response, items)
        while len(self._kept) > self.size:
            self._kept.popitem(last=False)

    def get(self, response_id: str) -> Stored | None:
        stored = self._kept.get(response_id)
        if stored is not None:
            self._kept.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        return self._kept.pop(response_id, None) is not None


def register(app: FastAPI, plane: DataPlane) -> None:
    limit, timeout = plane.settings.max_body_bytes, plane.settings.body_read_timeout_s
    store = ResponseStore(plane.settings.stored_responses)

    def unknown(response_id: str) -> ResponseNotFoundError:
        return ResponseNotFoundError(f"no response {response_id!r} is stored here (made with 'store': false, deleted, "
                                     f"or no longer among the last {store.size} this server keeps: --stored-responses)")

    @app.post("/v1/responses")
    async def create(request: Request) -> Response:
        body = await json_body(request, limit, timeout)
        name = body.get("model")
        if name is not None and not isinstance(name, str):
            raise InvalidInputError(f"'model' must be a string, got {name!r}")
        model = plane.generation_model(name)
        previous = body.get("previous_response_id")
        context: list[dict[str, Any]] = []
        if previous is not None:
            stored = store.get(previous) if isinstance(previous, str) else None
            if stored is None:
                raise InvalidInputError(f"'previous_response_id': {unknown(str(previous))}")
            context = stored.items
        asked = responses_request(body, context)
        started = await start_chat(model, asked.chat)
        response = new_response(model.name, asked.echo, started.params.temperature, started.params.top_p, asked.store)
        writer = ResponseWriter(response, started.prompt_tokens, started.syntax, started.vocabulary)

        def keep() -> None:
            if asked.store:
                store.put(writer.response, asked.items + writer.response["output"])

        if asked.stream:
            return sse_response(started.answers, _events(started.answers, writer, keep), openai=True)

        async def whole() -> dict[str, Any]:
            async with started.answers:
                writer.response["seed"] = started.answers.seed  # kiln's extension, as on chat
                async for _, delta in started.answers.deltas():
                    writer.feed(delta)
            keep()
            return writer.response

        return await whole_answer(request, model, whole(), time.perf_counter(), orjson.dumps)

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> Response:
        stored = store.get(response_id)
        if stored is None:
            raise unknown(response_id)
        return Response(orjson.dumps(stored.response), media_type="application/json")

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> Response:
        if not store.delete(response_id):
            raise unknown(response_id)
        return Response(orjson.dumps({"id": response_id, "object": "response", "deleted": True}),
                        media_type="application/json")


def _sse(event: dict[str, Any]) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


async def _events(answers: Answers, writer: ResponseWriter, keep: Callable[[], None]) -> AsyncIterator[bytes]:
    """The events of a streamed response (sent once the answer was accepted: ``sse_response``);
    ``keep`` stores it once complete."""
    # kiln's extension, as on chat: the seed of the answer's draws (kiln ray's streams know it once accepted)
    writer.response["seed"] = answers.seed
    for event in writer.start():
        yield _sse(event)
    try:
        async for _, delta in answers.deltas():
            for event in writer.feed(delta):
                yield _sse(event)
    except KilnError as exc:  # after the first byte the status is sent: say so in the stream, as OpenAI does
        for event in writer.fail(exc):
            yield _sse(event)
        return
    keep()
