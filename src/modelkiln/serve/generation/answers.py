"""What the generation routes need besides the model itself: its vocabulary and grammar compiler
(built on first use: llguidance reads tokenizer.json in about 0.2 s), the request's settings parsed
off the event loop when they compile a grammar, and a request's several answers (OpenAI's ``n``, a
list of prompts) submitted together and read as one stream.

Each answer is its own engine request. The answers to one prompt share its prefill only through
the engine's prefix cache, which keeps a prompt once its prefill is done: answers admitted in the
same step each prefill the prompt again."""

from __future__ import annotations

import asyncio
import json
import threading
import weakref
from collections.abc import AsyncIterator, Mapping
from dataclasses import replace
from typing import Any

from ...generation.constraints import Grammars
from ...generation.params import choice_seed, requested_constraint, sampling_params
from ...generation.sampling import SamplingParams
from ...generation.sequence import Delta
from ...generation.vocabulary import Vocabulary
from .model import INLINE_CHARS, GenerationModel, Stream

_lock = threading.Lock()
_grammars: weakref.WeakKeyDictionary[GenerationModel, Grammars] = weakref.WeakKeyDictionary()


def grammars(model: GenerationModel) -> Grammars:
    """The model's grammar compiler and vocabulary, built once (from any thread)."""
    with _lock:
        found = _grammars.get(model)
    if found is None:
        found = Grammars(Vocabulary(model.tokenizer, model.artifact.eos_ids))
        with _lock:
            found = _grammars.setdefault(model, found)
    return found


async def vocabulary(model: GenerationModel) -> Vocabulary:
    with _lock:
        found = _grammars.get(model)
    return found.vocabulary if found is not None else (await asyncio.to_thread(grammars, model)).vocabulary


async def request_params(model: GenerationModel, fields: Mapping[str, Any], prompt_tokens: int,
                         constraint: tuple[str, Any] | None = None) -> SamplingParams:
    """``fields`` → SamplingParams for ``model``; a grammar is compiled in a thread (a large schema
    takes tens of milliseconds, which the event loop's other streams should not wait for)."""
    if constraint is None and requested_constraint(fields) is None and fields.get("logit_bias") is None:
        return sampling_params(fields, model.defaults, prompt_tokens, model.max_context)
    return await asyncio.to_thread(lambda: sampling_params(fields, model.defaults, prompt_tokens, model.max_context,
                                                           grammars(model), constraint))


async def chat_ids(model: GenerationModel, messages: list[dict[str, Any]],
                   tools: list[dict[str, Any]] | None = None) -> list[int]:
    """``model.chat_ids`` with OpenAI's ``tools`` rendered by the chat template too."""
    if tools is None:
        return await model.chat_ids(messages)
    chars = sum(len(m.get("content") or "") for m in messages) + len(json.dumps(tools))
    model._check_chars(chars)
    ids = model.chat.ids(messages, tools) if chars <= INLINE_CHARS else await asyncio.to_thread(model.chat.ids,
                                                                                                 messages, tools)
    return model._fit(ids)


def with_seed(params: SamplingParams, index: int) -> SamplingParams:
    return params if index == 0 else replace(params, seed=choice_seed(params.seed, index))


class Answers:
    """The streams of one request's answers, by choice index; closing closes them all."""

    def __init__(self, streams: dict[int, Stream]):
        self.streams = streams

    @property
    def prompt_tokens(self) -> int:
        return sum(s.prompt_tokens for s in self.streams.values())

    @property
    def completion_tokens(self) -> int:
        return sum(s.completion_tokens for s in self.streams.values())

    async def aclose(self) -> None:
        for stream in self.streams.values():
            await stream.aclose()

    async def __aenter__(self) -> Answers:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def deltas(self) -> AsyncIterator[tuple[int, Delta]]:
        """(choice index, delta) as they arrive, from every answer; an error ends them all."""
        if len(self.streams) == 1:
            (index, stream), = self.streams.items()
            async for delta in stream:
                yield index, delta
            return
        pending = {asyncio.ensure_future(stream.__anext__()): index for index, stream in self.streams.items()}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for future in sorted(done, key=pending.__getitem__):
                    index = pending.pop(future)
                    try:
                        delta = future.result()
                    except StopAsyncIteration:
                        continue
                    yield index, delta
                    if delta.finish_reason is None:
                        pending[asyncio.ensure_future(self.streams[index].__anext__())] = index
        finally:
            for future in pending:
                future.cancel()


async def submit(model: GenerationModel, requests: list[tuple[int, list[int], SamplingParams]],
                 timeout_s: float | None = None) -> Answers:
    """Submit every (choice index, prompt ids, params) now; if one is refused (a full queue), the
    ones already submitted are cancelled and the refusal raised."""
    streams: dict[int, Stream] = {}
    try:
        for index, ids, params in requests:
            streams[index] = model.generate(ids, params, timeout_s)
    except BaseException:
        await Answers(streams).aclose()
        raise
    return Answers(streams)
