"""Choosing tokens on the torch engine's device, every row of a step at once, with
``TokenChooser``'s semantics (sampling.py): logit bias, the repetition penalty, OpenAI's frequency
and presence penalties, the grammar's bitmask, then temperature, top-k, top-p and min-p, and the inverse
transform of one uniform per token in vocabulary order, in float64.

The uniforms are ``sampling.uniforms(seeds, positions)``, computed on the host for every sampled row
of the step in one call, so a request draws what it would on any engine and a resumed one what its
first run would have. The state the penalties need (tokens seen, how often each was generated, the
bias) stays on the device, one row per slot, and is updated there; a row whose settings do not ask
for it adds exact zeros.

The decode step graphs choose their rows' tokens themselves, captured with the forward pass
(``graph_choice``): every setting is applied to every row from the slots' settings on the device, with
no branch on the rows' settings and no host value, and gives each row the bits ``choose`` gives it
(a row's neutral settings add exact zeros and divide by one). ``settle`` is the host's part of
either.

A step's choice is two parts: the device's (``choice`` or a graph's ``graph_choice``, then ``commit``:
the penalties' state and the draws' positions advance, queued behind the choice, so the next step
may be queued before the host has seen this one's tokens) and the host's (``settle``: errors and
log-probabilities, once the tokens came back in their one copy, ``engines/torch/transfers.py``). A
row whose best score overflowed (a bias or penalty of float range) takes TokenChooser's uniform
choice among the tokens at the top on the device too, so no token is corrected on the host after
the next step used it. Only rows that need more on the host wait again: those asking for
log-probabilities."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ...errors import InvalidInputError
from ..engines.torch.transfers import to_device, to_host
from ..structured_output import bitmask
from .draws import uniforms
from .params import SamplingParams

# A row's status word after a choice, bit by bit
NO_PROBABILITIES = 1  # its settings gave no probabilities (an error of its own)
NOTHING_ALLOWED = 2  # its grammar allows no token here (an error of its own)


# a slot's settings that change nothing: temperature 1, top_p 1, min_p 0; repetition 1, frequency and presence 0
_NEUTRAL_DRAW = [1.0, 1.0, 0.0]
_NEUTRAL_PENALTIES = [1.0, 0.0, 0.0]


@dataclass(frozen=True)
class _Used:
    """Which settings some row of a choice asks for: only those are applied (each costs operations);
    a row that does not ask for one gets the same bits either way."""

    bias: bool
    penalties: bool
    top_k: bool
    top_p: bool
    min_p: bool

    @staticmethod
    def of(params: Sequence[SamplingParams]) -> _Used:
        return _Used(any(p.logit_bias for p in params),
                     any(p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty for p in params),
                     any(p.top_k for p in params), any(p.top_p < 1.0 for p in params), any(p.min_p > 0.0 for p in params))


_EVERY = _Used(True, True, True, True, True)  # the step graphs' choice: no branch on the rows' settings


@dataclass
class _Slot:
    params: SamplingParams
    seed: int
    position: int  # index in the answer of the next token


@dataclass
class Choice:
    tokens: list[int]
    errors: dict[int, Exception]  # row → what failed for it (its own settings)
    logprobs: dict[int, tuple[float, list[tuple[int, float]]]]  # row → (chosen token's, top ones), rows that asked


class DeviceSampler:
    def __init__(self, slots: int, vocab: int, device: torch.device):
        self.vocab, self.device = vocab, device
        self._slots: dict[int, _Slot] = {}
        self.seen = torch.zeros(slots, vocab, dtype=torch.bool, device=device)
        self.counts = torch.zeros(slots, vocab, dtype=torch.float32, device=device)
        self.bias = torch.zeros(slots, vocab, dtype=torch.float32, device=device)
        self._biased: set[int] = set()
        # each slot's settings as the step graphs' choice reads them (``graph_choice``); a slot no
        # sequence took (the graphs' spare one) chooses greedily, with no penalty
        self.greedy = torch.ones(slots, dtype=torch.bool, device=device)
        self.draw_settings = torch.tensor([_NEUTRAL_DRAW] * slots, dtype=torch.float64, device=device)
        self.top_k = torch.zeros(slots, dtype=torch.long, device=device)
        self.penalties = torch.tensor([_NEUTRAL_PENALTIES] * slots, dtype=torch.float32, device=device)

    def start(self, slot: int, params: SamplingParams, seed: int, prompt_ids: Sequence[int],
              generated: Sequence[int]) -> None:
        """A sequence takes ``slot``: its settings, and what its prompt and resumed tokens count for."""
        self._slots[slot] = _Slot(params, seed, len(generated))
        self.seen[slot] = False
        self.counts[slot] = 0.0
        if params.repetition_penalty != 1.0:
            ids = [t for t in set(prompt_ids) | set(generated) if 0 <= t < self.vocab]
            self.seen[slot, to_device(ids, torch.long, self.device)] = True
        if generated:
            counts = np.bincount(np.asarray([t for t in generated if 0 <= t < self.vocab], dtype=np.int64),
                                 minlength=self.vocab)
            self.counts[slot] = to_device(counts.astype(np.float32), torch.float32, self.device)
        if slot in self._biased:
            self.bias[slot] = 0.0
            self._biased.discard(slot)
        self.greedy[slot] = params.greedy
        self.draw_settings[slot] = to_device(_NEUTRAL_DRAW if params.greedy else
                                             [params.temperature, params.top_p, params.min_p], torch.float64, self.device)
        self.top_k[slot] = params.top_k if params.top_k and params.top_k < self.vocab else 0
        self.penalties[slot] = to_device([params.repetition_penalty, params.frequency_penalty, params.presence_penalty],
                                         torch.float32, self.device)
        if params.logit_bias:
            bias = np.zeros(self.vocab, dtype=np.float32)
            for token, value in params.logit_bias:  # as numpy's ``scores[ids] += bias``: the last of a repeated id counts
                if 0 <= token < self.vocab:
                    bias[token] = value
            self.bias[slot] = to_device(bias, torch.float32, self.device)
            self._biased.add(slot)

    def leave(self, slot: int) -> None:
        self._slots.pop(slot, None)

    def params(self, slot: int) -> SamplingParams:
        return self._slots[slot].params

    # -- choosing --------------------------------------------------------------------------------
    def choose(self, slots: Sequence[int], logits: torch.Tensor, masks: Sequence[np.ndarray | None]) -> Choice:
        """One token per row, both parts at once (``choice``, ``commit``, ``settle``): ``logits``
        [rows, vocab] (the model's, fp32) of the sequences in ``slots``; ``masks``: each row's grammar
        bitmask (int32 words) or None."""
        chosen = self.choice(slots, logits, masks)
        self.commit(slots, to_device(slots, torch.long, self.device), chosen)
        return self.settle(slots, logits, to_host(chosen))

    def choice(self, slots: Sequence[int], logits: torch.Tensor, masks: Sequence[np.ndarray | None]) -> torch.Tensor:
        """The device's part of ``choose``: tokens and status words [2, rows], nothing waited for."""
        rows = len(slots)
        states = [self._slots[s] for s in slots]
        params = [s.params for s in states]
        index = to_device(slots, torch.long, self.device)
        allowed = self._mask_rows(masks) if any(m is not None for m in masks) else None
        used = _Used.of(params)
        scores = self._processed(logits, index, used, allowed)
        sampled = [r for r, p in enumerate(params) if not p.greedy]
        if len(sampled) == rows:
            tokens, status = self._draw(scores, index, used, self._uniforms(states))
        else:
            tokens = scores.argmax(dim=-1)
            status = torch.zeros_like(tokens)
            if sampled:
                picked = to_device(sampled, torch.long, self.device)
                chosen, flags = self._draw(scores.index_select(0, picked), index.index_select(0, picked),
                                           _Used.of([params[r] for r in sampled]),
                                           self._uniforms([states[r] for r in sampled]))
                tokens.index_copy_(0, picked, chosen)
                status.index_copy_(0, picked, flags)
        if allowed is not None:
            status |= torch.where(allowed.gather(1, tokens[:, None])[:, 0], 0, NOTHING_ALLOWED)
        return torch.stack([tokens, status])

    def graph_choice(self, index: torch.Tensor, logits: torch.Tensor, draws: torch.Tensor | None) -> torch.Tensor:
        """``choose``'s tokens and status words ([2, rows]) for rows without a grammar mask, computed
        from the slots' settings on the device alone: no host value, no branch on the rows' settings,
        so the step graphs capture it with the forward pass. Every step applies every setting (a row's
        own neutral values add exact zeros, divide by one), so each row gets the bits ``choose`` gives
        it; ``draws``: each row's uniform (``draws``), any value for greedy rows; None where every row
        is greedy (the graph for such steps leaves the draw, and its sorts over the vocabulary, out)."""
        scores = self._processed(logits, index, _EVERY, None)
        best = scores.argmax(dim=-1)
        if draws is None:
            return torch.stack([best, torch.zeros_like(best)])
        drawn, status = self._draw(scores, index, _EVERY, draws)
        greedy = self.greedy.index_select(0, index)
        return torch.stack([torch.where(greedy, best, drawn), torch.where(greedy, 0, status)])

    def draws(self, slots: Sequence[int]) -> np.ndarray | None:
        """The uniforms of these slots' next tokens for ``graph_choice`` (0.5 for greedy rows); None
        when every row is greedy."""
        drawn = [(r, state) for r, state in enumerate(map(self._slots.get, slots))
                 if state is not None and not state.params.greedy]
        if not drawn:
            return None
        values = np.full(len(slots), 0.5)
        values[[r for r, _ in drawn]] = uniforms([s.seed for _, s in drawn], [s.position for _, s in drawn])
        return values

    def commit(self, slots: Sequence[int], index: torch.Tensor, chosen: torch.Tensor) -> None:
        """The device's state after a choice (``chosen``: tokens and status words of the rows in
        ``slots``, ``index`` those slots on the device): the penalties count the tokens of the rows
        without an error, and each row's next draw is its answer's next position. Queued behind the
        choice: nothing is waited for."""
        states = [self._slots[s] for s in slots]
        tokens, status = chosen[0], chosen[1]
        self._count(index, tokens, (status & (NO_PROBABILITIES | NOTHING_ALLOWED)) == 0, [s.params for s in states])
        for state in states:  # a row with an error leaves: its position no longer matters
            state.position += 1

    def settle(self, slots: Sequence[int], logits: torch.Tensor, chosen: np.ndarray) -> Choice:
        """The host's part of a choice, once its tokens and status words came back (``chosen``
        [2, rows]): each row's error, and the log-probabilities of the rows that ask (``logits``:
        the rows' own; read only for those)."""
        params = [self._slots[s].params for s in slots]
        host_tokens, host_status = chosen.tolist()
        errors: dict[int, Exception] = {}
        for r, flags in [(r, flags) for r, flags in enumerate(host_status) if flags]:
            if flags & NO_PROBABILITIES:
                errors[r] = InvalidInputError(
                    f"the sampling settings give no probabilities (temperature {params[r].temperature})")
            else:
                errors[r] = InvalidInputError("the grammar allows no token here")
        asking = [r for r in range(len(slots)) if r not in errors and params[r].logprobs is not None]
        logprobs: dict[int, tuple[float, list[tuple[int, float]]]] = {}
        if asking:  # waits on the device again: these rows' log-probabilities come to the host
            found = token_logprobs(logits.index_select(0, to_device(asking, torch.long, self.device)),
                                   [host_tokens[r] for r in asking], [params[r].logprobs or 0 for r in asking])
            logprobs = dict(zip(asking, found))
        return Choice(host_tokens, errors, logprobs)

    def _uniforms(self, states: list[_Slot]) -> torch.Tensor:
        """The draws of these rows' next tokens, all in one call (``sampling.uniforms``)."""
        return to_device(uniforms([s.seed for s in states], [s.position for s in states]), torch.float64, self.device)

    def _count(self, index: torch.Tensor, tokens: torch.Tensor, kept: torch.Tensor,
               params: list[SamplingParams]) -> None:
        """Record the tokens of the ``kept`` rows as seen and generated, on the device (a row not kept
        writes back what it had). Only the settings that read them need them: a slot's state is
        reset when a sequence takes it, and its settings do not change."""
        if any(p.repetition_penalty != 1.0 for p in params):
            self.seen[index, tokens] |= kept
        if any(p.frequency_penalty or p.presence_penalty for p in params):
            self.counts[index, tokens] += kept.float()

    def _processed(self, logits: torch.Tensor, index: torch.Tensor, used: _Used,
                   allowed: torch.Tensor | None) -> torch.Tensor:
        """Logit bias, penalties and the grammar's mask, in TokenChooser's order (fp32); ``used``: the
        settings some row asks for (a row's neutral values change none of its bits)."""
        scores = logits
        if used.bias:
            scores = scores + self.bias.index_select(0, index)
        if used.penalties:
            penalties = self.penalties.index_select(0, index)
            penalty, frequency, presence = penalties[:, 0:1], penalties[:, 1:2], penalties[:, 2:3]
            seen = self.seen.index_select(0, index)
            scores = torch.where(seen, torch.where(scores > 0, scores / penalty, scores * penalty), scores)
            counts = self.counts.index_select(0, index)
            scores = scores - (counts * frequency + (counts > 0).float() * presence)
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        return scores

    def _mask_rows(self, masks: Sequence[np.ndarray | None]) -> torch.Tensor:
        """Each row's bitmask as bool [rows, vocab] (a row without one allows everything)."""
        words = bitmask.words(self.vocab)
        packed = np.full((len(masks), words), -1, dtype=np.int32)
        for r, mask in enumerate(masks):
            if mask is not None:
                packed[r] = 0
                packed[r, :min(words, mask.shape[-1])] = mask[:words]
        shifts = torch.arange(32, device=self.device, dtype=torch.int32)
        bits = to_device(packed, torch.int32, self.device).unsqueeze(-1) >> shifts
        return (bits & 1).bool().view(len(masks), words * 32)[:, :self.vocab]

    def _draw(self, scores: torch.Tensor, index: torch.Tensor, used: _Used,
              draws: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """TokenChooser._draw for several rows (the settings of their slots ``index``): (tokens, status
        words: NO_PROBABILITIES where the settings gave none). A row whose best score is not finite
        takes the reference's rule: a uniform choice among the tokens at the top (none where it is NaN)."""
        scores = scores.double()
        best = scores.max(dim=-1, keepdim=True).values
        finite = torch.isfinite(best)
        top = scores == best
        ties = top.sum(dim=-1)
        nth = torch.minimum((draws * ties.double()).floor().long(), ties - 1)  # the reference's int(u * len(top))
        at_top = (top.cumsum(dim=-1) > nth[:, None]).int().argmax(dim=-1)  # the tie of that rank
        settings = self.draw_settings.index_select(0, index)
        temperature, top_p, min_p = settings[:, 0:1], settings[:, 1:2], settings[:, 2:3]
        scores = torch.where(finite, (scores - best) / temperature, scores)
        if used.top_k:
            k = self.top_k.index_select(0, index)
            ordered = scores.sort(dim=-1, descending=True).values
            kth = ordered.gather(1, (k - 1).clamp(min=0)[:, None])
            scores = torch.where((k[:, None] > 0) & (scores < kth), float("-inf"), scores)
        exp = torch.exp(scores - scores.max(dim=-1, keepdim=True).values)
        probs = exp / exp.sum(dim=-1, keepdim=True)
        if used.top_p:
            ordered, order = probs.sort(dim=-1, descending=True, stable=True)
            keep = (ordered.cumsum(dim=-1) < top_p).sum(dim=-1, keepdim=True) + 1
            ranks = torch.arange(self.vocab, device=self.device)[None, :]
            kept = torch.zeros_like(probs).scatter(1, order, torch.where(ranks < keep, ordered, 0.0))
            probs = torch.where(top_p < 1.0, kept / kept.sum(dim=-1, keepdim=True), probs)
        if used.min_p:
            kept = torch.where(probs >= min_p * probs.max(dim=-1, keepdim=True).values, probs, 0.0)
            probs = torch.where(min_p > 0.0, kept / kept.sum(dim=-1, keepdim=True), probs)
        cumulative = probs.cumsum(dim=-1)
        total = cumulative[:, -1:]
        targets = (draws[:, None] * total).contiguous()
        tokens = torch.searchsorted(cumulative, targets, right=True)[:, 0].clamp(max=self.vocab - 1)
        finite = finite[:, 0]
        failed = torch.where(finite, ~(total[:, 0] > 0), ties == 0)
        return torch.where(finite, tokens, at_top), torch.where(failed, NO_PROBABILITIES, 0)


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int],
                   tops: Sequence[int]) -> list[tuple[float, list[tuple[int, float]]]]:
    """``sampling.token_logprobs`` for several rows: the model's log-probability of each row's token
    and its ``top`` most likely tokens with theirs (most likely first, ties by token id), in float64."""
    logprobs = torch.log_softmax(logits.double(), dim=-1)
    chosen = to_host(logprobs.gather(1, to_device(tokens, torch.long, logits.device)[:, None])[:, 0]).tolist()
    most = max(tops, default=0)
    best_values, best_ids = ([], [])
    if most:
        values, ids = logprobs.sort(dim=-1, descending=True, stable=True)
        best_values, best_ids = to_host(values[:, :most]).tolist(), to_host(ids[:, :most]).tolist()
    return [(chosen[r], [(int(best_ids[r][j]), float(best_values[r][j])) for j in range(top)])
            for r, top in enumerate(tops)]

