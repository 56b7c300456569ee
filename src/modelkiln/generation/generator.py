"""Run requests to completion on one engine: the loop behind ``kiln generate``, bench and eval.

A deliberately small scheduler: up to ``max_batch`` requests run together; between two decode
steps finished requests leave and waiting ones are prefilled and join. ``kiln serve`` replaces
this loop with its own (token budget, chunked prefill, cancellation) around the same engine and
the same ``SequenceState``."""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass

from tokenizers import Tokenizer

from .engine import GenerationEngine
from .sampling import SamplingParams
from .sequence import Delta, SequenceState


@dataclass
class Request:
    request_id: Hashable
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class Event:
    request_id: Hashable
    delta: Delta


@dataclass
class Completion:
    request_id: Hashable
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int


class Generator:
    def __init__(self, engine: GenerationEngine, tokenizer: Tokenizer, eos_ids: Iterable[int] = (),
                 max_batch: int = 32):
        self.engine = engine
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(eos_ids)
        self.max_batch = max_batch

    def stream(self, requests: Iterable[Request]) -> Iterator[Event]:
        """Yield every request's deltas as they are produced (requests interleave)."""
        waiting = deque(requests)
        running: dict[Hashable, SequenceState] = {}
        next_tokens: dict[Hashable, int] = {}
        try:
            while waiting or running:
                while waiting and len(running) < self.max_batch:
                    request = waiting.popleft()
                    state = SequenceState(request.request_id, list(request.prompt_ids), request.params,
                                          self.tokenizer, self.eos_ids, self.engine.max_context)
                    logits = self.engine.add(request.request_id, state.prompt_ids)
                    yield from self._advance(state, logits, running, next_tokens)
                if not running:
                    continue
                logits = self.engine.step(next_tokens)
                for row, request_id in enumerate(list(self.engine.rows)):
                    yield from self._advance(running[request_id], logits[row], running, next_tokens)
        finally:  # a consumer that stops early must not leave sequences in the engine
            for request_id in list(running):
                self.engine.remove(request_id)

    def _advance(self, state: SequenceState, logits, running: dict, next_tokens: dict) -> Iterator[Event]:
        token = state.choose(logits)
        delta = state.accept(token)
        if state.finished:
            running.pop(state.request_id, None)
            next_tokens.pop(state.request_id, None)
            self.engine.remove(state.request_id)
        else:
            running[state.request_id] = state
            next_tokens[state.request_id] = token
        yield Event(state.request_id, delta)

    def generate(self, requests: Iterable[Request]) -> list[Completion]:
        """Run every request to the end; completions in request order."""
        requests = list(requests)
        texts: dict[Hashable, list[str]] = {r.request_id: [] for r in requests}
        tokens: dict[Hashable, list[int]] = {r.request_id: [] for r in requests}
        reasons: dict[Hashable, str] = {}
        for event in self.stream(requests):
            texts[event.request_id].append(event.delta.text)
            tokens[event.request_id].append(event.delta.token_id)
            if event.delta.finish_reason:
                reasons[event.request_id] = event.delta.finish_reason
        return [Completion(r.request_id, "".join(texts[r.request_id]), tokens[r.request_id],
                           reasons[r.request_id], len(r.prompt_ids)) for r in requests]
