"""One request's state while it generates, on the core's side: prompt, tokens so far, detokenizer,
stop strings, its grammar's matcher and why it finished. The engine chooses token ids; this object
turns them into text and decides when to stop. The engine core keeps one per admitted request."""

from __future__ import annotations

import sys
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from ..errors import GrammarLimitError, KilnError
from .sampling import SamplingParams
from .structured_output import bitmask
from .text.detokenizer import IncrementalDetokenizer
from .text.stopping import StopStringMatcher

STOP = "stop"  # an end-of-sequence token or a stop string (OpenAI's finish_reason)
LENGTH = "length"  # max_new_tokens or the model's context

# Closing a constrained answer within its budget (structured_output/closing.py finds the tokens that complete it).
# The closing path is followed, one allowed token a step, once it takes all but a margin of the
# tokens left. The margin is what one freely chosen token may add to the path (a key's opening
# quote, an object that brings its required keys): CLOSING_MARGIN at first, then the most that one
# token was seen to add. The path is looked at every step once the tokens left exceed it by at
# most CLOSING_HORIZON (where that growth is seen), and further away as rarely as the margin
# allows: after a look that finds the tokens left exceed the path by g, the next look comes
# (g - CLOSING_HORIZON) // (margin + 1) tokens later, at least 1. The path may be any length (a
# recursive answer's grows with its depth); a look costs as much as the path is long (0.13 ms a
# token with SmolLM2). A token that adds more than the margin may leave the answer to end with
# "length".
CLOSING_MARGIN = 8
CLOSING_HORIZON = 64


@dataclass(slots=True)
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
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        self._detok = IncrementalDetokenizer(self.tokenizer, self.prompt_ids)
        self._texts: list[str] = []  # what each token emitted (joined when asked: adding to a string copies it)
        self._stops = StopStringMatcher(self.params.stop)
        self._stop_ids = (frozenset() if self.params.ignore_eos else self.eos_ids) | frozenset(self.params.stop_token_ids)
        # the answer's length at most: max_new_tokens, and what the model's context leaves
        self._longest = self.params.max_new_tokens
        if self.max_context:
            self._longest = min(self._longest, self.max_context - len(self.prompt_ids))
        self.matcher: Any = self.params.constraint.matcher() if self.params.constraint is not None else None
        self._mask: np.ndarray | None = None  # the last mask handed to the engine
        # The closing path from the current state, once computed (None: not computed or none found).
        # It only saves work: the path is a function of the matcher's state, so its rest is the path
        # from the state after its first token.
        self._closing: list[int] | None = None
        self._margin = CLOSING_MARGIN
        self._last_look: tuple[int, int] | None = None  # (tokens left, the path's length) at the last look
        # Tokens left at the next look: the first follows from the grammar's shortest answer (the
        # path at the start), or comes at once when it was not measured.
        self._look_at = 0
        if self.matcher is not None:
            shortest = self.params.constraint.shortest_answer
            self._look_at = self._next_look(self.tokens_left, shortest) if shortest else sys.maxsize
        for token in self.resumed:  # the state the first run had after sending them (held-back text included)
            if self.matcher is not None:  # and its looks at closing, which set the margin
                self.closing_token()
            self.accept(token)

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._texts)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def tokens_left(self) -> int:
        """Tokens the answer may still take (max_new_tokens, and the model's context)."""
        return self._longest - len(self.generated_ids)

    def bitmask(self) -> np.ndarray | None:
        """The grammar's mask for the next token (None without a grammar): near the end of the
        budget, only the next token of the shortest way to complete the grammar."""
        if self.matcher is None:
            return None
        words = bitmask.empty(self.tokenizer.get_vocab_size(with_added_tokens=True))
        closing = self.closing_token()
        if closing is None:
            self.matcher.fill_bitmask(words)
        else:
            bitmask.allow(words, closing)
        self._mask = words  # what the token was chosen from: tells a grammar's failure from an engine's
        return words

    def closing_token(self) -> int | None:
        """The token the answer must take now to end within its budget, or None (far from the end,
        or no way to end in time: then it ends with "length", as anywhere else)."""
        left = self.tokens_left
        if self.matcher is None or left > self._look_at:
            return None
        if self._closing is None:
            self._closing = self.matcher.closing_path(limit=left)
        if self._closing is None:  # longer than the tokens left: look again once the answer may have closed some
            self._last_look, self._look_at = None, left - self._margin - 1
            return None
        if self._last_look is not None and self._last_look[0] == left + 1:  # the last token's growth
            self._margin = max(self._margin, len(self._closing) - self._last_look[1])
        self._last_look = (left, len(self._closing))
        if len(self._closing) + self._margin < left:
            self._look_at = self._next_look(left, len(self._closing))
            return None
        return self._closing[0] if self._closing else None

    def _next_look(self, left: int, path: int) -> int:
        """Tokens left at the next look, after one that found a path of ``path`` tokens with ``left`` left."""
        return left - max(1, (left - path - CLOSING_HORIZON) // (self._margin + 1))

    def accept(self, token_id: int) -> Delta:
        """Record a chosen token; returns the text to emit and, when it ends the answer, why."""
        if self.finished:
            raise RuntimeError(f"request {self.request_id!r} has already finished")
        self.generated_ids.append(token_id)
        if self.matcher is not None and not self.matcher.accept(token_id):
            raise self._refused(token_id)
        if self._closing:  # still the path when the token is its first; else found again when needed
            self._closing = self._closing[1:] if self._closing[0] == token_id else None
        if token_id in self._stop_ids:
            return self._finish(token_id, STOP, self._stops.feed(self._detok.flush()))
        text = self._stops.feed(self._detok.push(token_id))
        if self._stops.stopped or (self.matcher is not None and self.matcher.is_terminated()):
            text += self._stops.feed(self._detok.flush())
            return self._finish(token_id, STOP, text)
        if len(self.generated_ids) >= self._longest:
            text += self._stops.feed(self._detok.flush())
            return self._finish(token_id, STOP if self._stops.stopped else LENGTH, text)
        self._texts.append(text)
        return Delta(token_id, text)

    def _refused(self, token_id: int) -> KilnError:
        """Why the grammar refused a token: one its mask allowed means the grammar went past the
        grammar engine's limits there (the request's fault: 400); else the engine did not apply
        the mask (a bug: 500)."""
        why = (getattr(self.matcher, "error", None) or "no reason").strip().splitlines()[0][:500]
        mask = self._mask
        if mask is not None and bitmask.allows(mask, token_id):
            return GrammarLimitError(f"the request's grammar is too complex for the grammar engine at answer token "
                                     f"{len(self.generated_ids)}: {why}")
        return KilnError(f"the grammar refused token {token_id}: {why}")

    def _finish(self, token_id: int, reason: str, text: str) -> Delta:
        text += self._stops.flush()  # nothing more can complete a stop string
        self._texts.append(text)
        self.finish_reason = reason
        return Delta(token_id, text, reason)
