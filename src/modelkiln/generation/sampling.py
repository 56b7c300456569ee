"""Choosing the next token from a row of logits, per sequence, with numpy only.

The order of the transformations is Hugging Face ``generate``'s (repetition penalty, temperature,
top-k, top-p), so that the same settings mean the same thing here and there. Each sequence owns
its random generator, seeded from the request: the same seed gives the same tokens whatever else
is in the batch."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import InvalidInputError


MAX_LOGPROBS = 20  # most alternatives per token (OpenAI's top_logprobs limit)


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks for. ``temperature == 0`` means greedy (and ignores top-k/top-p/seed)."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    repetition_penalty: float = 1.0  # 1.0: off; > 1 discourages tokens already in prompt or answer
    seed: int | None = None  # None: a fresh random seed (not reproducible)
    stop: tuple[str, ...] = ()  # stop strings, matched in the text (across token boundaries)
    stop_token_ids: tuple[int, ...] = ()  # in addition to the model's end-of-sequence ids
    ignore_eos: bool = False  # keep going after an end-of-sequence token (load tests)
    # OpenAI's penalties: each subtracts from a token's logit, by how often (frequency) or whether
    # (presence) it appears in the answer so far (not the prompt), both in [-2, 2]
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]) added to the logits
    logprobs: int | None = None  # None: none; k >= 0: the chosen token's log-probability and the k most likely
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (completions' echo)
    # a compiled grammar (generation/constraints.py) every token must keep the answer inside
    constraint: Any = field(default=None, compare=False)
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        # Every check is written so that NaN fails it (NaN compares false with anything).
        if not self.max_new_tokens >= 1:
            raise InvalidInputError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if not 0 <= self.temperature < math.inf:
            raise InvalidInputError(f"temperature must be >= 0 and finite, got {self.temperature}")
        if not self.top_k >= 0:
            raise InvalidInputError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidInputError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 < self.repetition_penalty < math.inf:
            raise InvalidInputError(f"repetition_penalty must be > 0 and finite, got {self.repetition_penalty}")
        if self.seed is not None and not 0 <= self.seed < 2**64:  # numpy refuses negative seeds; 64-bit as OpenAI's
            raise InvalidInputError(f"seed must be in [0, 2**64), got {self.seed}")
        if any(not s for s in self.stop):
            raise InvalidInputError("stop strings must not be empty")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidInputError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        for token, bias in self.logit_bias:
            if not -100.0 <= bias <= 100.0:
                raise InvalidInputError(f"logit_bias for token {token} must be in [-100, 100], got {bias}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise InvalidInputError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Sampler:
    """One sequence's token chooser: its parameters and its own random generator."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray, previous: Iterable[int] = ()) -> int:
        p = self.params
        if p.repetition_penalty != 1.0:
            logits = apply_repetition_penalty(logits, previous, p.repetition_penalty)
        if p.greedy:
            return int(np.argmax(logits))
        scores = logits.astype(np.float64)
        best = np.max(scores)
        if not np.isfinite(best):  # a tiny or huge penalty overflowed: only the tokens at the top remain
            return int(self.rng.choice(np.flatnonzero(scores == best)))
        scores = (scores - best) / p.temperature  # the best token scores 0, so a tiny temperature cannot make inf - inf
        if p.top_k and p.top_k < scores.shape[-1]:
            kth = np.partition(scores, -p.top_k)[-p.top_k]
            scores = np.where(scores < kth, -np.inf, scores)
        probs = _softmax(scores)
        if p.top_p < 1.0:
            probs = _top_p(probs, p.top_p)
        return int(self.rng.choice(probs.shape[-1], p=probs))


def apply_repetition_penalty(logits: np.ndarray, previous: Iterable[int], penalty: float) -> np.ndarray:
    """CTRL's penalty as in transformers: a seen token's logit is divided by ``penalty`` when
    positive and multiplied when negative (so it always becomes less likely)."""
    seen = np.fromiter(set(previous), dtype=np.int64)
    if seen.size == 0:
        return logits
    logits = logits.copy()
    values = logits[seen]
    logits[seen] = np.where(values > 0, values / penalty, values * penalty)
    return logits


def _softmax(scores: np.ndarray) -> np.ndarray:
    e = np.exp(scores - np.max(scores))
    return e / e.sum()


def _top_p(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p`` (at least one)."""
    order = np.argsort(-probs, kind="stable")
    cumulative = np.cumsum(probs[order])
    keep = int(np.searchsorted(cumulative, top_p) + 1)
    kept = np.zeros_like(probs)
    kept[order[:keep]] = probs[order[:keep]]
    return kept / kept.sum()
