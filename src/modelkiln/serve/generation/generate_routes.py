"""Triton's generate extension on a text-generation model, as Triton's Hugging Face and vLLM
tutorials call it:

``POST /v2/models/{m}[/versions/{v}]/generate`` with ``{"text_input": "...", "parameters": {...}}``
→ ``{"model_name", "model_version", "text_output"}``, and ``.../generate_stream``: the same
request, answered as server-sent events, one ``data: {"model_name", "model_version",
"text_output": "<new text>"}`` per token that adds text, the last with ``"finish_reason"``.
Triton maps top-level JSON keys to inputs and parameters alike, so sampling settings are taken
from ``parameters`` or from the top level (``params.py`` names); ``stream`` is ignored (the route
decides). Triton's parameters are scalars, so the object-valued ones (``response_format``,
``structured_outputs``, ``guided_json``, ``guided_choice``, ``json_schema``, ``logit_bias``) may
also come as JSON text. An error before the first token is an HTTP status; after it, a ``data: {"error": ...}``
event, as Triton sends."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import FastAPI, Request
from starlette.responses import Response

from ...errors import InvalidInputError
from ...tasks import text_generation as contract
from ..dataplane import DataPlane
from .http import json_body, sse, sse_response, whole_answer
from .model import DeltaStream, GenerationModel
from .resume import wants_token_ids


def _fields(body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    text = body.get(contract.TEXT_INPUT)
    if isinstance(text, list) and len(text) == 1:
        text = text[0]
    if not isinstance(text, str):
        raise InvalidInputError(f"'{contract.TEXT_INPUT}' must be a string")
    parameters = body.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise InvalidInputError("'parameters' must be an object")
    fields = {k: v for k, v in body.items() if k not in (contract.TEXT_INPUT, "parameters", "id")}
    fields = {**fields, **parameters}
    for name in _JSON_TEXT_FIELDS:
        if isinstance(fields.get(name), str):
            try:
                fields[name] = orjson.loads(fields[name])
            except orjson.JSONDecodeError:
                raise InvalidInputError(f"'{name}' as text must be JSON") from None
    return text, fields


_JSON_TEXT_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_choice", "json_schema",
                     "logit_bias")


def register(app: FastAPI, plane: DataPlane) -> None:
    limit, timeout = plane.settings.max_body_bytes, plane.settings.body_read_timeout_s

    async def start(request: Request, name: str, version: str | None) -> tuple[GenerationModel, DeltaStream, bool]:
        """The request's model, its stream, and whether it asked for token ids."""
        body = await json_body(request, limit, timeout)
        model = plane.generation_model(name, version)
        text, fields = _fields(body)
        ids = await model.prompt_ids(text)
        params = await model.params(fields, len(ids))
        token_ids = wants_token_ids(fields)
        resume_ids = model.resume_ids(fields, ids, params)
        return model, model.generate(ids, params, model.timeout(fields), resume_ids), token_ids

    @app.post("/v2/models/{name}/generate")
    @app.post("/v2/models/{name}/versions/{version}/generate")
    async def generate(request: Request, name: str, version: str | None = None) -> Response:
        started = time.perf_counter()
        model, stream, token_ids = await start(request, name, version)

        async def whole() -> dict[str, Any]:
            async with stream:
                deltas = [delta async for delta in stream]
            answer = {"model_name": model.name, "model_version": model.version,
                      "text_output": "".join(delta.text for delta in deltas), "finish_reason": stream.finish_reason,
                      "prompt_tokens": stream.prompt_tokens, "completion_tokens": stream.completion_tokens,
                      "seed": stream.seed}
            return {**answer, "token_ids": [delta.token_id for delta in deltas]} if token_ids else answer

        return await whole_answer(request, model, whole(), started, orjson.dumps)

    @app.post("/v2/models/{name}/generate_stream")
    @app.post("/v2/models/{name}/versions/{version}/generate_stream")
    async def generate_stream(request: Request, name: str, version: str | None = None) -> Response:
        model, stream, token_ids = await start(request, name, version)
        return sse_response(stream, _events(model, stream, token_ids), openai=False)


async def _events(model: GenerationModel, stream: DeltaStream, token_ids: bool) -> AsyncIterator[bytes]:
    """One event per token that adds text; the first carries the answer's ``seed``, and with
    ``return_token_ids`` each carries the ids of the tokens since the last one (``resume.py``)."""
    head: dict[str, object] = {"model_name": model.name, "model_version": model.version}
    first: dict[str, object] = {**head, "seed": stream.seed}
    unsent: list[int] = []
    async for delta in stream:
        if token_ids:
            unsent.append(delta.token_id)
        if not (delta.text or delta.finish_reason):
            continue
        event = {**first, "text_output": delta.text}
        if delta.finish_reason:
            event.update(finish_reason=delta.finish_reason, prompt_tokens=stream.prompt_tokens,
                         completion_tokens=stream.completion_tokens)
        if token_ids:
            event["token_ids"], unsent = unsent, []
        yield sse(event)
        first = head
