"""One request's state while it generates, on the core's side: prompt, tokens so far, detokenizer,
stop strings, its grammar's matcher and why it finished. The engine chooses token ids; this object
turns them into text and decides when to stop. The engine core keeps one per admitted request."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from typing import Any

import numpy as np
from tokenizers import Tokenizer

from ..errors import KilnError
from .detokenizer import IncrementalDetokenizer
from .sampling import SamplingParams
from .stopping import StopStringMatcher

STOP = "stop"  # an end-of-sequence token or a stop string (OpenAI's finish_reason)
LENGTH = "length"  # max_new_tokens or the model's context


@dataclass
class Delta:
    """What one accepted token adds to the answer."""

    token_id: int
    text: str  # may be '' (an incomplete character, or text held back as a possible stop string)
    finish_reason: str | None = None
    logprob: float | None = None  # the model's log-probability of the token, when asked (``logprobs``)
    top_logprobs: list[tuple[int, float]] | None = None  # the most likely tokens there, with theirs
    # with the first token of a request that asked for ``prompt_logprobs``: per prompt token, (its
    # log-probability, the most likely tokens there), None for the first one (nothing precedes it)
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = None


@dataclass
class SequenceState:
    request_id: Hashable
    prompt_ids: list[int]
    params: SamplingParams
    tokenizer: Tokenizer
    eos_ids: frozenset[int] = frozenset()
    max_context: int | None = None
    resumed: Sequence[int] = ()  # answer tokens already sent by an earlier run of this request
    generated_ids: list[int] = field(default_factory=list)
    text: str = ""  # everything emitted so far
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        self._detok = IncrementalDetokenizer(self.tokenizer, self.prompt_ids)
        self._stops = StopStringMatcher(self.params.stop)
        self._stop_ids = (frozenset() if self.params.ignore_eos else self.eos_ids) | frozenset(self.params.stop_token_ids)
        self.matcher: Any = self.params.constraint.matcher() if self.params.constraint is not None else None
        for token in self.resumed:  # the state the first run had after sending them (held-back text included)
            self.accept(token)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def bitmask(self) -> np.ndarray | None:
        """The grammar's mask for the next token (None without a grammar)."""
        if self.matcher is None:
            return None
        words = np.zeros(-(-self.tokenizer.get_vocab_size(with_added_tokens=True) // 32), dtype=np.int32)
        self.matcher.fill_bitmask(words)
        return words

    def accept(self, token_id: int) -> Delta:
        """Record a chosen token; returns the text to emit and, when it ends the answer, why."""
        if self.finished:
            raise RuntimeError(f"request {self.request_id!r} has already finished")
        self.generated_ids.append(token_id)
        if self.matcher is not None and not self.matcher.accept(token_id):  # the engine did not apply its mask
            raise KilnError(f"the grammar refused token {token_id}: {getattr(self.matcher, 'error', None) or 'no reason'}")
        if token_id in self._stop_ids:
            return self._finish(token_id, STOP, self._stops.feed(self._detok.flush()))
        text = self._stops.feed(self._detok.push(token_id))
        if self._stops.stopped or (self.matcher is not None and self.matcher.is_terminated()):
            text += self._stops.feed(self._detok.flush())
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
