"""``POST /tokenize`` and ``POST /detokenize`` on a text-generation model, in vLLM's shapes and
llama-server's (the same paths; llama-server's requests say ``content``):

- vLLM: ``{"model", "prompt", "add_special_tokens": true}`` or ``{"model", "messages", "tools",
  "add_generation_prompt": true}`` (the chat template, message text kept as text as in a chat
  request) → ``{"tokens", "count", "max_model_len"}`` (+ ``"token_strs"`` with
  ``"return_token_strs": true``); ``{"model", "tokens"}`` → ``{"prompt"}``;
- llama-server: ``{"content", "add_special": false, "with_pieces": false}`` → ``{"tokens"}`` (with
  pieces: ``[{"id", "piece"}]``); ``{"tokens"}`` → ``{"content"}``.

A prompt longer than the context is tokenized all the same (this asks what it costs; a generation
request would refuse it)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from functools import partial
from typing import Any

import orjson
from fastapi import FastAPI, Request
from starlette.responses import Response

from ...errors import InvalidInputError
from ...generation.chat.tokens import encode
from ...generation.chat.tool_calls import parse_tools, tool_format
from ...generation.chat.tool_prompt import template_chat
from ..dataplane import DataPlane
from .http import json_body
from .model import INLINE_CHARS, GenerationModel
from .openai_routes import openai_messages


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise InvalidInputError(f"'{name}' must be true or false, got {value!r}")
    return value


async def _tokens(model: GenerationModel, body: dict[str, Any]) -> list[int]:
    if "messages" in body:
        tools = parse_tools(body.get("tools"), None)
        template = model.artifact.chat_template  # the tools and calls as a chat request renders them
        messages, shown = template_chat(template, openai_messages(body["messages"]), tools, tool_format(template))
        work: Callable[[], list[int]] = partial(model.chat.ids, messages, shown, _flag(body, "add_generation_prompt", True))
        chars = sum(len(m["content"]) for m in messages)
    else:
        text = body.get("prompt", body.get("content"))
        if not isinstance(text, str):
            raise InvalidInputError("give 'prompt' (or llama-server's 'content') as a string, or 'messages'")
        special = _flag(body, "add_special", False) if "content" in body else _flag(body, "add_special_tokens", True)
        work = partial(encode, model.tokenizer, text, special)
        chars = len(text)
    return work() if chars <= INLINE_CHARS else await asyncio.to_thread(work)


def register(app: FastAPI, plane: DataPlane) -> None:
    limit, timeout = plane.settings.max_body_bytes, plane.settings.body_read_timeout_s

    async def model_of(body: dict[str, Any]) -> GenerationModel:
        name = body.get("model")
        if name is not None and not isinstance(name, str):
            raise InvalidInputError(f"'model' must be a string, got {name!r}")
        return plane.generation_model(name)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        body = await json_body(request, limit, timeout)
        model = await model_of(body)
        ids = await _tokens(model, body)
        if "content" in body:  # llama-server
            tokens: list[Any] = ids
            if _flag(body, "with_pieces", False):
                tokens = [{"id": i, "piece": model.tokenizer.decode([i], skip_special_tokens=False)} for i in ids]
            return Response(orjson.dumps({"tokens": tokens}), media_type="application/json")
        answer: dict[str, Any] = {"tokens": ids, "count": len(ids), "max_model_len": model.max_context}
        if _flag(body, "return_token_strs", False):
            answer["token_strs"] = [model.tokenizer.id_to_token(i) for i in ids]
        return Response(orjson.dumps(answer), media_type="application/json")

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        body = await json_body(request, limit, timeout)
        model = await model_of(body)
        ids = body.get("tokens")
        vocab = model.tokenizer.get_vocab_size()
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab
                                                for i in ids):
            raise InvalidInputError(f"'tokens' must be a list of token ids in [0, {vocab})")
        text = model.tokenizer.decode(ids, skip_special_tokens=False)
        return Response(orjson.dumps({"prompt": text, "content": text}), media_type="application/json")
