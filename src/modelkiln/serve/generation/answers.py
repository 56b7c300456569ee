"""A request's several answers (OpenAI's ``n``, a list of prompts) submitted together and read as
one stream.

Each answer is its own engine request. The answers to one prompt share its prefill through the
engine's prefix cache: the core admits a request whose prompt another one is still prefilling
only once that prompt is in the cache (``generation/core.py``), so the siblings' first tokens come
from the stored prompt with no computation."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

from ...generation.request.params import choice_seed
from ...generation.sampling import SamplingParams
from ...generation.sequence import Delta
from .model import DeltaStream, GenerationModel

def with_seed(params: SamplingParams, index: int) -> SamplingParams:
    return params if index == 0 else replace(params, seed=choice_seed(params.seed, index))


class Answers:
    """The streams of one request's answers, by choice index; closing closes them all."""

    def __init__(self, streams: dict[int, DeltaStream]):
        self.streams = streams

    @property
    def prompt_tokens(self) -> int:
        return sum(s.prompt_tokens for s in self.streams.values())

    @property
    def completion_tokens(self) -> int:
        return sum(s.completion_tokens for s in self.streams.values())

    @property
    def seed(self) -> int:
        """The first answer's seed (answer i of n draws with seed + i)."""
        return next(iter(self.streams.values())).seed

    @property
    def replica(self) -> str | None:
        """The replica the first answer runs on (kiln ray's router's streams name theirs)."""
        return getattr(next(iter(self.streams.values())), "replica", None)

    async def started(self) -> None:
        """Once every answer was accepted (kiln ray's router: a replica took it)."""
        for stream in self.streams.values():
            await stream.started()

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
                 timeout_s: float | None = None, resume_ids: list[int] | None = None) -> Answers:
    """Submit every (choice index, prompt ids, params) now; if one is refused (a full queue), the
    ones already submitted are cancelled and the refusal raised. ``resume_ids``: the tokens of the
    one answer a client resumes (``resume.py``)."""
    streams: dict[int, DeltaStream] = {}
    try:
        for index, ids, params in requests:
            streams[index] = model.generate(ids, params, timeout_s, resume_ids or ())
    except BaseException:
        await Answers(streams).aclose()
        raise
    return Answers(streams)
