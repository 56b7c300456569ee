"""One request's state while it generates: prompt, tokens so far, sampler, detokenizer, stop
strings and why it finished. The engine advances token ids; this object turns them into text and
decides when to stop. Whoever schedules the engine (``generator.py`` here, the server's scheduler
in ``kiln serve``) keeps one per request."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np
from tokenizers import Tokenizer

from .detokenizer import IncrementalDetokenizer
from .sampling import Sampler, SamplingParams
from .stopping import StopStringMatcher

STOP = "stop"  # an end-of-sequence token or a stop string (OpenAI's finish_reason)
LENGTH = "length"  # max_new_tokens or the model's context


@dataclass
class Delta:
    """What one accepted token adds to the answer."""

    token_id: int
    text: str  # may be '' (an incomplete character, or text held back as a possible stop string)
    finish_reason: str | None = None


@dataclass
class SequenceState:
    request_id: Hashable
    prompt_ids: list[int]
    params: SamplingParams
    tokenizer: Tokenizer
    eos_ids: frozenset[int] = frozenset()
    max_context: int | None = None
    generated_ids: list[int] = field(default_factory=list)
    text: str = ""  # everything emitted so far
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        self._sampler = Sampler(self.params)
        self._detok = IncrementalDetokenizer(self.tokenizer, self.prompt_ids)
        self._stops = StopStringMatcher(self.params.stop)
        self._stop_ids = (frozenset() if self.params.ignore_eos else self.eos_ids) | frozenset(self.params.stop_token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def choose(self, logits: np.ndarray) -> int:
        """The next token for these logits, by this request's sampling settings."""
        previous: Sequence[int] = ()
        if self.params.repetition_penalty != 1.0:
            previous = self.prompt_ids + self.generated_ids
        return self._sampler(logits, previous)

    def accept(self, token_id: int) -> Delta:
        """Record a chosen token; returns the text to emit and, when it ends the answer, why."""
        if self.finished:
            raise RuntimeError(f"request {self.request_id!r} has already finished")
        self.generated_ids.append(token_id)
        if token_id in self._stop_ids:
            return self._finish(token_id, STOP, self._stops.feed(self._detok.flush()))
        text = self._stops.feed(self._detok.push(token_id))
        if self._stops.stopped:
            return self._finish(token_id, STOP, text)
        total = len(self.prompt_ids) + len(self.generated_ids)
        if len(self.generated_ids) >= self.params.max_new_tokens or (self.max_context and total >= self.max_context):
            text += self._stops.feed(self._detok.flush())
            return self._finish(token_id, STOP if self._stops.stopped else LENGTH, text)
        self.text += text
        return Delta(token_id, text)

    def _finish(self, token_id: int, reason: str, text: str) -> Delta:
        text += self._stops.flush()  # nothing more can complete a stop string
        self.text += text
        self.finish_reason = reason
        return Delta(token_id, text, reason)
