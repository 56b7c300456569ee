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

# Closing a constrained answer within its budget (closing.py finds the tokens that complete it).
# The closing path is looked at once the tokens left are at most the grammar's shortest answer
# plus CLOSING_HORIZON (a path from mid-answer is rarely more than a few dozen tokens longer than
# the shortest answer: the brackets and required keys left open), and followed, one allowed token
# a step, once it takes all but CLOSING_MARGIN of them. The margin is what one freely chosen token
# may add to the path before the next look (a key's opening quote, an object that brings required
# keys); a token that adds more leaves the answer to end with "length".
CLOSING_HORIZON = 64
CLOSING_MARGIN = 8


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
        # The closing path from the current state, once computed (None: not computed or none found).
        # It only saves work: the path is a function of the matcher's state, so its rest is the path
        # from the state after its first token (a resumed request, which replays its tokens without
        # it, computes the same one).
        self._closing: list[int] | None = None
        self._closing_from = 0  # tokens left to generate when the closing path is first looked at
        if self.matcher is not None:
            self._closing_from = CLOSING_HORIZON + self.params.constraint.shortest_answer
        for token in self.resumed:  # the state the first run had after sending them (held-back text included)
            self.accept(token)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def tokens_left(self) -> int:
        """Tokens the answer may still take (max_new_tokens, and the model's context)."""
        left = self.params.max_new_tokens - len(self.generated_ids)
        if self.max_context:
            left = min(left, self.max_context - len(self.prompt_ids) - len(self.generated_ids))
        return left

    def bitmask(self) -> np.ndarray | None:
        """The grammar's mask for the next token (None without a grammar): near the end of the
        budget, only the next token of the shortest way to complete the grammar."""
        if self.matcher is None:
            return None
        words = np.zeros(-(-self.tokenizer.get_vocab_size(with_added_tokens=True) // 32), dtype=np.int32)
        closing = self.closing_token()
        if closing is None:
            self.matcher.fill_bitmask(words)
        else:
            words.view(np.uint32)[closing // 32] = np.uint32(1 << (closing % 32))
        return words

    def closing_token(self) -> int | None:
        """The token the answer must take now to end within its budget, or None (far from the end,
        or no way to end in time: then it ends with "length", as anywhere else)."""
        left = self.tokens_left
        if self.matcher is None or left > self._closing_from:
            return None
        if self._closing is None:
            self._closing = self.matcher.closing_path(limit=left)
        if not self._closing or len(self._closing) + CLOSING_MARGIN < left:
            return None
        return self._closing[0]

    def accept(self, token_id: int) -> Delta:
        """Record a chosen token; returns the text to emit and, when it ends the answer, why."""
        if self.finished:
            raise RuntimeError(f"request {self.request_id!r} has already finished")
        self.generated_ids.append(token_id)
        if self.matcher is not None and not self.matcher.accept(token_id):  # the engine did not apply its mask
            raise KilnError(f"the grammar refused token {token_id}: {getattr(self.matcher, 'error', None) or 'no reason'}")
        if self._closing:  # still the path when the token is its first; else found again when needed
            self._closing = self._closing[1:] if self._closing[0] == token_id else None
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
