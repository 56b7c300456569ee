"""OpenAI's ``POST /v1/completions`` and ``/v1/chat/completions`` on a text-generation model, so
that the unmodified ``openai`` client works (sync, async, ``stream=True``).

Streams are server-sent events: one ``data: {chunk}`` per token that adds text (a token held back
as a possible stop string or half a character adds none and sends nothing), the finish reason
on the last chunk, with ``stream_options: {"include_usage": true}`` a final chunk with ``usage``
and no choices, then ``data: [DONE]``. Parameters: ``params.py``. ``n`` > 1, ``best_of``,
``echo``, ``logprobs``, ``suffix``, tools and response formats are refused with a 400 saying so
(not silently ignored). Errors have OpenAI's shape (``serve/errors.py``)."""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import Response

from ...errors import InvalidInputError
from ..dataplane import DataPlane
from .http import json_body, sse, sse_response, whole_answer
from .model import GenerationModel, Stream
from .resume import wants_token_ids

DONE = b"data: [DONE]\n\n"
_UNSUPPORTED = ("best_of", "suffix", "tools", "functions", "tool_choice", "response_format", "logit_bias")


class _Ids:
    """Completion ids: a random per-process prefix and a counter."""

    def __init__(self) -> None:
        self._prefix = os.urandom(6).hex()
        self._count = itertools.count(1)

    def next(self, kind: str) -> str:
        return f"{kind}-{self._prefix}{next(self._count)}"


_ids = _Ids()


def _check(body: dict[str, Any]) -> None:
    n = body.get("n", 1)
    if n is not None and n != 1:
        raise InvalidInputError(f"'n' must be 1 (this server returns one choice per request), got {n!r}")
    for name in _UNSUPPORTED:
        value = body.get(name)
        if value not in (None, [], {}) and not (name == "best_of" and value == 1):
            raise InvalidInputError(f"'{name}' is not supported by this server")
    if body.get("echo"):
        raise InvalidInputError("'echo' is not supported by this server")
    if body.get("logprobs") not in (None, False):
        raise InvalidInputError("'logprobs' is not supported by this server")
    if not isinstance(body.get("stream", False), (bool, type(None))):
        raise InvalidInputError("'stream' must be true or false")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not body.get("stream")):
        raise InvalidInputError("'stream_options' is an object, allowed only with 'stream': true")


async def _completion_prompt(model: GenerationModel, prompt: Any) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(i, int) for i in prompt)):
        return await model.prompt_ids(prompt)
    if isinstance(prompt, list):
        raise InvalidInputError("'prompt' must be one string or one list of token ids (n = 1 prompt per request)")
    raise InvalidInputError("'prompt' must be a string or a list of token ids")


def _chat_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise InvalidInputError("'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise InvalidInputError(f"message {i} must be an object with a 'role'")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise InvalidInputError(f"message {i}: only text content parts are supported")
            content = "".join(p["text"] for p in content)
        if content is not None and not isinstance(content, str):
            raise InvalidInputError(f"message {i}: 'content' must be a string or a list of text parts")
        out.append({"role": m["role"], "content": content or ""})
    return out


def _usage(stream: Stream) -> dict[str, int]:
    return {"prompt_tokens": stream.prompt_tokens, "completion_tokens": stream.completion_tokens,
            "total_tokens": stream.prompt_tokens + stream.completion_tokens}


def register(app: FastAPI, plane: DataPlane) -> None:
    limit, timeout = plane.settings.max_body_bytes, plane.settings.body_read_timeout_s

    async def run(request: Request, chat: bool) -> Response:
        body = await json_body(request, limit, timeout)
        _check(body)
        name = body.get("model")
        if name is not None and not isinstance(name, str):
            raise InvalidInputError(f"'model' must be a string, got {name!r}")
        model = plane.generation_model(name)
        if chat:
            ids = await model.chat_ids(_chat_messages(body.get("messages")))
        else:
            ids = await _completion_prompt(model, body.get("prompt"))
        params = model.params(body, len(ids))
        token_ids = wants_token_ids(body)
        stream = model.generate(ids, params, resume_ids=model.resume_ids(body, ids, params))
        kind = "chatcmpl" if chat else "cmpl"
        head = {"id": _ids.next(kind), "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": model.name}
        started = time.perf_counter()
        if body.get("stream"):
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return sse_response(stream, _chunks(stream, head, chat, usage, token_ids), openai=True)

        async def whole() -> dict[str, Any]:
            async with stream:
                deltas = [delta async for delta in stream]
            text = "".join(delta.text for delta in deltas)
            choice: dict[str, Any] = {"index": 0, "finish_reason": stream.finish_reason, "logprobs": None}
            choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
            if token_ids:
                choice["token_ids"] = [delta.token_id for delta in deltas]
            return {**head, "seed": stream.seed, "choices": [choice], "usage": _usage(stream)}

        return await whole_answer(request, model, whole(), started, _json)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await run(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await run(request, chat=True)


def _json(data: Any) -> bytes:
    import orjson

    return orjson.dumps(data)


async def _chunks(stream: Stream, head: dict[str, Any], chat: bool, usage: bool,
                  token_ids: bool) -> AsyncIterator[bytes]:
    """The answer's chunks; the first one carries the answer's ``seed`` (kiln's extension: with it and
    ``return_token_ids``, a client can resume a cut stream: ``resume.py``)."""
    head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
    first = {**head, "seed": stream.seed}
    piece: Callable[[str, str | None], dict[str, Any]]
    if chat:
        yield sse({**first, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None}]})
        first = head
        piece = lambda text, reason: {"index": 0, "delta": {"content": text} if text else {}, "logprobs": None,  # noqa: E731
                                      "finish_reason": reason}
    else:
        piece = lambda text, reason: {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}  # noqa: E731
    unsent: list[int] = []  # tokens whose text is held back go out with the next chunk
    async for delta in stream:
        if token_ids:
            unsent.append(delta.token_id)
        if delta.text or delta.finish_reason:
            choice = piece(delta.text, delta.finish_reason)
            if token_ids:
                choice["token_ids"], unsent = unsent, []
            yield sse({**first, "choices": [choice]})
            first = head
    if usage:
        yield sse({**head, "choices": [], "usage": _usage(stream)})
    yield DONE
