"""Choosing the next token from a row of logits, per sequence, with numpy only (the host engines).

Logit bias and penalties come first (OpenAI's and vLLM's order), then a grammar's mask, then Hugging
Face ``generate``'s temperature, top-k, top-p and min-p (``selection.py``), so the same settings mean
the same thing here and there. The random draw of each token is keyed by the request's seed and the
token's index in the answer (``draws.py``), so the same seed gives the same tokens whatever else is
in the batch."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from ...errors import InvalidInputError
from ..structured_output import bitmask
from .draws import uniform
from .params import SamplingParams
from .selection import draw


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
        self._seen_ids: np.ndarray | None = None  # the set as an array, made again when it grows
        self._counts: dict[int, int] = {}
        if params.frequency_penalty or params.presence_penalty:
            for token in generated:
                self._counts[token] = self._counts.get(token, 0) + 1
        self._bias = (np.asarray([t for t, _ in params.logit_bias], dtype=np.int64),
                      np.asarray([b for _, b in params.logit_bias], dtype=np.float32)) if params.logit_bias else None

    def choose(self, logits: np.ndarray, allowed: np.ndarray | None = None, u: float | None = None) -> int:
        """The next token for this row of logits ([vocab], the model's own); ``allowed`` is a
        grammar's bitmask (int32 words, bit set = allowed); ``u``: this token's uniform where the
        caller drew the step's at once (``uniforms``). Records the token as chosen."""
        p = self.params
        if u is None:
            u = 0.0 if p.greedy else self._uniform()  # greedy draws nothing
        scores = self._processed(logits)
        if allowed is None:
            token = int(np.argmax(scores)) if p.greedy else draw(scores, p, u)
        else:
            # Among the grammar's tokens alone, in vocabulary order: the token the whole row gives
            # with every other token at -inf (the first best one; the same inverse transform, where
            # the others' probabilities are exact zeros and only the normalising sum may round
            # differently), at the cost of their number rather than the vocabulary's.
            ids = np.flatnonzero(bitmask.to_bool(allowed, scores.shape[-1]))
            if ids.size == 0:
                raise InvalidInputError("the grammar allows no token here")
            kept = scores[ids]
            token = int(ids[int(np.argmax(kept)) if p.greedy else draw(kept, p, u)])
        self._record(token)
        return token

    @property
    def plain(self) -> bool:
        """Whether the logits go to the draw as they are (no bias, no penalty to apply): such rows of a
        step can be drawn together (``selection.bounded_draws``), then ``accept``-ed."""
        return self._bias is None and not self._seen and not self._counts

    def accept(self, token: int) -> None:
        """Records a token drawn for this sequence elsewhere (with this chooser's settings and uniform)."""
        self._record(token)

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
            if self._seen_ids is None:
                self._seen_ids = np.fromiter(self._seen, dtype=np.int64)
            seen = self._seen_ids
            values = scores[seen]
            scores[seen] = np.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if self._counts:
            ids = np.fromiter(self._counts, dtype=np.int64)
            counts = np.fromiter(self._counts.values(), dtype=np.float32)
            scores[ids] -= counts * p.frequency_penalty + p.presence_penalty
        return scores

    def _uniform(self) -> float:
        return uniform(self.seed, self.position)

    def _record(self, token: int) -> None:
        self.position += 1
        if self.params.repetition_penalty != 1.0:
            if token not in self._seen:
                self._seen.add(token)
                self._seen_ids = None
        if self.params.frequency_penalty or self.params.presence_penalty:
            self._counts[token] = self._counts.get(token, 0) + 1


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
        order = sorted(ids.tolist(), key=lambda i: (-logprobs[i], i))
        best = [(int(i), float(logprobs[i])) for i in order]
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
