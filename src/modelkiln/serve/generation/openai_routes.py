"""OpenAI's ``POST /v1/completions`` and ``/v1/chat/completions`` on a text-generation model, so
that the unmodified ``openai`` client works (sync, async, ``stream=True``, ``beta...parse``).

Streams are server-sent events: one ``data: {chunk}`` per token that adds text (a token held back
as a possible stop string or half a character adds none and sends nothing), the finish reason
on the last chunk of each choice, with ``stream_options: {"include_usage": true}`` a final chunk
with ``usage`` and no choices, then ``data: [DONE]``. Parameters: ``generation/request/params.py``; the
table of every parameter and what this server does with it is in docs/generation.md.

``n`` answers per prompt and a list of prompts on completions are each their own engine request
(answers.py); choice ``index`` is prompt × n + answer, as OpenAI numbers them. Tools are shown to
the model by its own chat template and its calls parsed back (generation/chat/tool_calls.py,
openai_choices.py); a template that cannot show tools gets the generic format
(generation/chat/tool_prompt.py). ``best_of`` other than ``n``, ``suffix`` and the legacy ``functions`` are
refused with a 400 saying so (not silently ignored). Errors have OpenAI's shape
(``serve/http/errors.py``)."""

from __future__ import annotations

import itertools
import os
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import Response

from ...errors import InvalidInputError
from ...generation.structured_output.grammars import json_answer_schema
from ...generation.request.params import CONSTRAINT_FIELDS, choices, requested_constraint
from ...generation.sampling import SamplingParams
from ...generation.chat.tool_calls import Generic, ToolFormat, Tools, parse_tools, template_messages_with_tools, tool_format
from ...generation.chat.tool_prompt import template_chat
from ...generation.structured_output.vocabulary import Vocabulary
from ..dataplane import DataPlane
from .answers import Answers, submit, with_seed
from .http import json_body, sse, sse_response, whole_answer
from .model import GenerationModel
from .openai_choices import ChatChoice, CompletionChoice
from .resume import RESUME_FIELD, wants_token_ids

DONE = b"data: [DONE]\n\n"
_UNSUPPORTED = {"suffix": "'suffix' (insertion) is not supported by this server",
                "functions": "'functions' is OpenAI's deprecated form of 'tools': send 'tools'",
                "function_call": "'function_call' is OpenAI's deprecated form of 'tool_choice': send 'tool_choice'"}


class _Ids:
    """Completion ids: a random per-process prefix and a counter."""

    def __init__(self) -> None:
        self._prefix = os.urandom(6).hex()
        self._count = itertools.count(1)

    def next(self, kind: str) -> str:
        return f"{kind}-{self._prefix}{next(self._count)}"


_ids = _Ids()


def _check(body: dict[str, Any], chat: bool) -> None:
    for name, why in _UNSUPPORTED.items():
        if body.get(name) not in (None, [], {}, ""):
            raise InvalidInputError(why)
    if chat and body.get("echo"):
        raise InvalidInputError("'echo' is for /v1/completions")
    if not isinstance(body.get("stream", False), (bool, type(None))):
        raise InvalidInputError("'stream' must be true or false")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not body.get("stream")):
        raise InvalidInputError("'stream_options' is an object, allowed only with 'stream': true")


def _completion_prompts_given(prompt: Any) -> list[str | list[int]]:
    """One prompt (a string, a list of token ids) or a list of them."""
    def one(p: Any) -> bool:
        return isinstance(p, str) or (isinstance(p, list) and bool(p) and all(isinstance(i, int) for i in p))

    if one(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(one(p) for p in prompt):
        return list(prompt)
    raise InvalidInputError("'prompt' must be a string, a list of token ids, or a non-empty list of either")


_MESSAGE_FIELDS = ("name", "tool_calls", "tool_call_id")


def openai_messages(messages: Any) -> list[dict[str, Any]]:
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
        if m.get("tool_calls") is not None and (m["role"] != "assistant" or not isinstance(m["tool_calls"], list)):
            raise InvalidInputError(f"message {i}: 'tool_calls' is a list, on an assistant message")
        if m["role"] == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise InvalidInputError(f"message {i}: a tool message needs the 'tool_call_id' it answers")
        extra = {k: m[k] for k in _MESSAGE_FIELDS if m.get(k) is not None}
        out.append({"role": m["role"], "content": content or "", **extra})
    return template_messages_with_tools(out)


def _special_id(model: GenerationModel, text: str) -> int | None:
    """The id of ``text`` when the tokenizer has it as one special token."""
    token = model.tokenizer.token_to_id(text)
    added = model.tokenizer.get_added_tokens_decoder().get(token) if token is not None else None
    return token if added is not None and added.special else None


@dataclass
class _Prompts:
    """What a request asks the model to continue: each prompt as given (None for a chat), its ids,
    and for a chat with tools the call syntax and the constraint tool_choice asks for (``fields``:
    the request's fields the sampling settings read, when the constraint took in its own)."""

    given: list[Any]
    ids: list[list[int]]
    syntax: ToolFormat | None = None
    constraint: tuple[str, Any] | None = None
    fields: dict[str, Any] | None = None


async def _chat_prompt(model: GenerationModel, body: dict[str, Any]) -> _Prompts:
    tools = parse_tools(body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls"))
    shown = tools if tools is not None and tools.choice != "none" else None
    template = model.artifact.chat_template
    syntax = tool_format(template)
    constraint, fields, answer = None, None, None
    if shown is not None and syntax.constrains(shown):
        if isinstance(syntax, Generic) and shown.choice == "auto":
            answer, fields = _generic_answer(body)
        constraint = ("lark", _tool_grammar(model, syntax, shown, answer))
    messages, template_tools = template_chat(template, openai_messages(body.get("messages")), shown, syntax,
                                             answer is not None)
    ids = await model.chat_ids(messages, template_tools)
    return _Prompts([None], [ids], syntax if shown is not None else None, constraint, fields)


def _generic_answer(body: dict[str, Any]) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """Under the generic format's "auto", a response format is the non-call answer's: its JSON
    schema, and the fields without it (the tool grammar takes it in)."""
    asked = requested_constraint(body)
    if asked is None:
        return None, None
    schema = json_answer_schema(*asked)
    if schema is None:
        raise InvalidInputError("with tools and 'tool_choice' \"auto\" on this model (its chat template does not "
                                "show tools), a structured output can be a JSON object or schema only")
    return schema, {k: v for k, v in body.items() if k not in CONSTRAINT_FIELDS}


def _tool_grammar(model: GenerationModel, syntax: ToolFormat, tools: Tools, answer: dict[str, Any] | None) -> str:
    def special(text: str) -> int | None:
        return _special_id(model, text)

    return syntax.grammar(tools, special, answer) if isinstance(syntax, Generic) else syntax.grammar(tools, special)


@dataclass
class ChatStart:
    """One chat answer submitted: its stream, the template's call syntax (None without tools), its
    settings, the vocabulary when it reports log-probabilities, the prompt's length."""

    answers: Answers
    syntax: ToolFormat | None
    params: SamplingParams
    vocabulary: Vocabulary | None
    prompt_tokens: int


async def start_chat(model: GenerationModel, body: dict[str, Any]) -> ChatStart:
    """One answer (n = 1) to a chat request's body, through the chat route's own steps: the chat
    template with the tools, the grammar tool_choice or response_format asks for, the sampling
    settings. The Responses API (responses_routes.py) translates its requests into such a body."""
    prompts = await _chat_prompt(model, body)
    ids = prompts.ids[0]
    params = await model.params(prompts.fields or body, len(ids), prompts.constraint)
    vocabulary = await model.vocabulary() if params.logprobs is not None else None
    answers = await submit(model, [(0, ids, params)])
    return ChatStart(answers, prompts.syntax, params, vocabulary, len(ids))


async def _completion_prompts(model: GenerationModel, body: dict[str, Any], n: int) -> _Prompts:
    given = _completion_prompts_given(body.get("prompt"))
    rows = model.settings.max_batch_size
    if len(given) * n > rows:
        raise InvalidInputError(f"{len(given)} prompts x n = {n} make {len(given) * n} answers; this "
                                f"server runs at most {rows} at once (--max-batch-size)")
    return _Prompts(given, [await model.prompt_ids(p) for p in given])


def register(app: FastAPI, plane: DataPlane) -> None:
    limit, timeout = plane.settings.max_body_bytes, plane.settings.body_read_timeout_s

    async def run(request: Request, chat: bool) -> Response:
        body = await json_body(request, limit, timeout)
        _check(body, chat)
        name = body.get("model")
        if name is not None and not isinstance(name, str):
            raise InvalidInputError(f"'model' must be a string, got {name!r}")
        model = plane.generation_model(name)
        n = choices(body, model.settings.max_batch_size)
        prompts = await (_chat_prompt(model, body) if chat else _completion_prompts(model, body, n))
        params = [await model.params(prompts.fields or body, len(ids), prompts.constraint) for ids in prompts.ids]
        if n * len(params) > 1 and params[0].seed is None:  # answer i draws with seed + i: one seed for all
            params = [replace(p, seed=secrets.randbits(63)) for p in params]
        streaming = bool(body.get("stream"))
        token_ids = wants_token_ids(body)
        vocab = await model.vocabulary() if params[0].logprobs is not None else None
        echo = bool(body.get("echo"))
        writers: dict[int, ChatChoice | CompletionChoice] = {}
        requests = []
        for p, (given, ids, settings) in enumerate(zip(prompts.given, prompts.ids, params)):
            for i in range(n):
                index = p * n + i  # OpenAI's numbering of n answers to each of several prompts
                if chat:
                    writers[index] = ChatChoice(index, vocab, vocab is not None, prompts.syntax, streaming, token_ids)
                else:
                    text = (given if isinstance(given, str) else model.tokenizer.decode(ids)) if echo else None
                    writers[index] = CompletionChoice(index, vocab, vocab is not None, text, ids, streaming, token_ids)
                requests.append((index, ids, with_seed(settings, i)))
        resume_ids = None
        if body.get(RESUME_FIELD):
            if len(requests) > 1:
                raise InvalidInputError(f"'{RESUME_FIELD}' resumes one answer: not with n > 1 or several prompts")
            resume_ids = model.resume_ids(body, requests[0][1], requests[0][2])
        answers = await submit(model, requests, resume_ids=resume_ids)
        kind = "chatcmpl" if chat else "cmpl"
        head = {"id": _ids.next(kind), "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": model.name}
        prompt_tokens = sum(len(ids) for ids in prompts.ids)
        started = time.perf_counter()
        if streaming:
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return sse_response(answers, _chunks(answers, writers, head, chat, usage, prompt_tokens), openai=True)

        async def whole() -> dict[str, Any]:
            async with answers:
                async for index, delta in answers.deltas():
                    writers[index].feed(delta)
            return {**head, "seed": answers.seed, "choices": [writers[i].whole() for i in sorted(writers)],
                    "usage": _usage(prompt_tokens, answers.completion_tokens)}

        return await whole_answer(request, model, whole(), started, _json)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await run(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await run(request, chat=True)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _json(data: Any) -> bytes:
    import orjson

    return orjson.dumps(data)


async def _chunks(answers: Answers, writers: dict[int, ChatChoice | CompletionChoice], head: dict[str, Any],
                  chat: bool, usage: bool, prompt_tokens: int) -> AsyncIterator[bytes]:
    """The answers' chunks; the first one carries the first answer's ``seed`` (kiln's extension:
    with it and ``return_token_ids``, a client can resume a cut stream: ``resume.py``)."""
    head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
    first = {**head, "seed": answers.seed}
    if chat:
        for index in sorted(writers):
            writer = writers[index]
            assert isinstance(writer, ChatChoice)  # a chat's writers
            yield sse({**first, "choices": [writer.first()]})
            first = head
    async for index, delta in answers.deltas():
        for piece in writers[index].feed(delta):
            yield sse({**first, "choices": [piece]})
            first = head
    if usage:
        yield sse({**head, "choices": [], "usage": _usage(prompt_tokens, answers.completion_tokens)})
    yield DONE
