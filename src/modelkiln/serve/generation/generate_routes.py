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
from .model import GenerationModel, Stream


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

    async def start(request: Request, name: str, version: str | None) -> tuple[GenerationModel, Stream]:
        body = await json_body(request, limit, timeout)
        model = plane.generation_model(name, version)
        text, fields = _fields(body)
        ids = await model.prompt_ids(text)
        params = await model.params(fields, len(ids))
        return model, model.generate(ids, params, model.timeout(fields))

    @app.post("/v2/models/{name}/generate")
    @app.post("/v2/models/{name}/versions/{version}/generate")
    async def generate(request: Request, name: str, version: str | None = None) -> Response:
        started = time.perf_counter()
        model, stream = await start(request, name, version)

        async def whole() -> dict[str, Any]:
            async with stream:
                text = "".join([delta.text async for delta in stream])
            return {"model_name": model.name, "model_version": model.version, "text_output": text,
                    "finish_reason": stream.finish_reason, "prompt_tokens": stream.prompt_tokens,
                    "completion_tokens": stream.completion_tokens}

        return await whole_answer(request, model, whole(), started, orjson.dumps)

    @app.post("/v2/models/{name}/generate_stream")
    @app.post("/v2/models/{name}/versions/{version}/generate_stream")
    async def generate_stream(request: Request, name: str, version: str | None = None) -> Response:
        model, stream = await start(request, name, version)
        return sse_response(stream, _events(model, stream), openai=False)


async def _events(model: GenerationModel, stream: Stream) -> AsyncIterator[bytes]:
    head = {"model_name": model.name, "model_version": model.version}
    async for delta in stream:
        if delta.finish_reason:
            yield sse({**head, "text_output": delta.text, "finish_reason": delta.finish_reason,
                       "prompt_tokens": stream.prompt_tokens, "completion_tokens": stream.completion_tokens})
        elif delta.text:
            yield sse({**head, "text_output": delta.text})
