"""Choosing the next token from a row of logits, per sequence, with numpy only.

Logit bias and penalties come first (OpenAI's and vLLM's order), then a grammar's mask, then Hugging
Face ``generate``'s temperature, top-k and top-p, so the same settings mean the same thing here and
there. The random draw of each token is keyed by the request's seed and the token's index in the
answer (``TokenChooser``), so the same seed gives the same tokens whatever else is in the batch."""

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


class TokenChooser:
    """One sequence's token chooser, kept by the engine that runs it: its settings, its seed, and
    what the penalties need (the tokens seen so far). The random draw of token ``i`` of an answer is
    a pure function of (seed, i): Philox, a counter-based generator, keyed by the seed and started
    at counter i. So the same request gives the same answer whatever else runs, and a request
    resumed elsewhere after i tokens (``generated``) draws what the first one would have."""

    def __init__(self, params: SamplingParams, seed: int, prompt_ids: Iterable[int] = (),
                 generated: Iterable[int] = ()):
        self.params = params
        self.seed = seed
        generated = list(generated)
        self.position = len(generated)  # index in the answer of the next token
        self._seen = set(prompt_ids) | set(generated) if params.repetition_penalty != 1.0 else set()
        self._counts: dict[int, int] = {}
        if params.frequency_penalty or params.presence_penalty:
            for token in generated:
                self._counts[token] = self._counts.get(token, 0) + 1
        self._bias = (np.asarray([t for t, _ in params.logit_bias], dtype=np.int64),
                      np.asarray([b for _, b in params.logit_bias], dtype=np.float32)) if params.logit_bias else None

    def choose(self, logits: np.ndarray, allowed: np.ndarray | None = None) -> int:
        """The next token for this row of logits ([vocab], the model's own); ``allowed`` is a
        grammar's bitmask (int32 words, bit set = allowed). Records the token as chosen."""
        p = self.params
        scores = self._processed(logits)
        if allowed is None:
            token = int(np.argmax(scores)) if p.greedy else self._draw(scores)
        else:
            # Among the grammar's tokens alone, in vocabulary order: the token the whole row gives
            # with every other token at -inf (the first best one; the same inverse transform, where
            # the others' probabilities are exact zeros and only the normalising sum may round
            # differently), at the cost of their number rather than the vocabulary's.
            ids = np.flatnonzero(bitmask_to_bool(allowed, scores.shape[-1]))
            if ids.size == 0:
                raise InvalidInputError("the grammar allows no token here")
            kept = scores[ids]
            token = int(ids[int(np.argmax(kept)) if p.greedy else self._draw(kept)])
        self._record(token)
        return token

    def _processed(self, logits: np.ndarray) -> np.ndarray:
        """Logit bias and penalties, in that order (OpenAI's and vLLM's); the grammar's mask comes after."""
        p = self.params
        if self._bias is None and not self._seen and not self._counts:
            return logits
        scores = logits.astype(np.float32, copy=True)
        if self._bias is not None:
            ids, bias = self._bias
            inside = ids < scores.shape[-1]
            scores[ids[inside]] += bias[inside]
        if self._seen:
            seen = np.fromiter(self._seen, dtype=np.int64)
            values = scores[seen]
            scores[seen] = np.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if self._counts:
            ids = np.fromiter(self._counts, dtype=np.int64)
            counts = np.fromiter(self._counts.values(), dtype=np.float32)
            scores[ids] -= counts * p.frequency_penalty + p.presence_penalty
        return scores

    def _draw(self, logits: np.ndarray) -> int:
        p = self.params
        scores = logits.astype(np.float64)
        best = np.max(scores)
        if not np.isfinite(best):  # a huge bias or penalty overflowed: the tokens at the top remain
            top = np.flatnonzero(scores == best)
            return int(top[min(int(self._uniform() * len(top)), len(top) - 1)])
        scores = (scores - best) / p.temperature  # the best token scores 0: a tiny temperature cannot make inf - inf
        if p.top_k and p.top_k < scores.shape[-1]:
            kth = np.partition(scores, -p.top_k)[-p.top_k]
            scores = np.where(scores < kth, -np.inf, scores)
        probs = _softmax(scores)
        if p.top_p < 1.0:
            probs = _top_p(probs, p.top_p)
        cumulative = np.cumsum(probs)  # inverse transform in vocabulary order: one uniform per token
        if not cumulative[-1] > 0:  # NaN too: settings the checks let through cannot give probabilities
            raise InvalidInputError(f"the sampling settings give no probabilities (temperature {p.temperature})")
        return min(int(np.searchsorted(cumulative, self._uniform() * cumulative[-1], side="right")),
                   probs.shape[-1] - 1)

    def _uniform(self) -> float:
        return uniform(self.seed, self.position)

    def _record(self, token: int) -> None:
        self.position += 1
        if self.params.repetition_penalty != 1.0:
            self._seen.add(token)
        if self.params.frequency_penalty or self.params.presence_penalty:
            self._counts[token] = self._counts.get(token, 0) + 1


def uniform(seed: int, position: int) -> float:
    """The uniform in [0, 1) that token ``position`` of an answer with ``seed`` draws with: Philox
    keyed by the seed, started at the position (every engine draws with it, on the host)."""
    return float(np.random.Generator(np.random.Philox(counter=position, key=seed)).random())


def bitmask_to_bool(bitmask: np.ndarray, vocab: int) -> np.ndarray:
    """int32 words (bit j of word i = token 32·i + j) → bool [vocab]; tokens past the mask are disallowed."""
    bits = np.unpackbits(np.ascontiguousarray(bitmask, dtype=np.int32).view(np.uint8), bitorder="little")
    allowed = np.zeros(vocab, dtype=bool)
    n = min(vocab, bits.shape[0])
    allowed[:n] = bits[:n].astype(bool)
    return allowed


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-probabilities of a row (or rows) of logits, in float64."""
    scores = logits.astype(np.float64)
    top = np.max(scores, axis=-1, keepdims=True)
    return scores - top - np.log(np.exp(scores - top).sum(axis=-1, keepdims=True))


def token_logprobs(logits: np.ndarray, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """The model's log-probability of ``token`` in this row, and the ``top`` most likely tokens
    with theirs (most likely first; ties by token id)."""
    logprobs = log_softmax(logits)
    best: list[tuple[int, float]] = []
    if top:
        ids = np.argpartition(-logprobs, top - 1)[:top] if top < logprobs.shape[-1] else np.arange(logprobs.shape[-1])
        ids = sorted(ids.tolist(), key=lambda i: (-logprobs[i], i))
        best = [(int(i), float(logprobs[i])) for i in ids]
    return float(logprobs[token]), best


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
