"""A draft model: a smaller model that shares the target's tokenizer proposes a sequence's next k
tokens, greedily (vLLM's ``draft_model`` method). The target verifies them as it verifies any
drafts, so the answer is the target's whatever the draft model proposes.

``DraftModel`` is the draft model's engine, opened once per core beside the target's, with a KV
cache of its own (``generation/model.py`` opens it: ``TextGenerationModel.draft_model``).
``DraftModelDrafter`` is one request's drafter: a slot of that engine and the tokens whose keys
and values are in it. A proposal feeds the slot the sequence's tokens not yet there (one prompt
chunk: the prompt at the first proposal, then the tokens the target returned since), then each
drafted token, one call each: k tokens cost k calls of the draft model. The slot then holds k - 1
drafted tokens; those the target refused are rolled back on the next proposal, to the prefix the
slot shares with the sequence (``truncate``: the engine's length of the slot, set back; the keys and
values after it are never read and the next tokens write over them).

The engine is used through a prompt's primitives only (``prefill`` into a slot that never joins the
decode batch), so that each request drafts alone, when its speculator asks: the serving graph's
engines (``engines/onnx/serving.py``, ``kiln_attention.py``) have them."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Hashable, Iterable, Sequence
from typing import Protocol, runtime_checkable

import numpy as np

log = logging.getLogger("modelkiln.generation")


@runtime_checkable
class DraftEngine(Protocol):
    """What a draft model's engine must do: prompt chunks into a slot of its own, set back, freed."""

    max_context: int | None

    def prefill(self, seq_id: Hashable, token_ids: Sequence[int], all_logits: bool = False) -> np.ndarray: ...
    def truncate(self, seq_id: Hashable, tokens: int) -> None: ...
    def remove(self, seq_id: Hashable) -> None: ...
    def __contains__(self, seq_id: Hashable) -> bool: ...


class DraftModel:
    """A draft model's engine, shared by the requests of one core (one thread steps it).
    ``vocab_size``: the target's token ids (its tokenizer's); a drafted id beyond them (a padded
    row of the draft model's head) ends the proposal there, as the target could not take it."""

    def __init__(self, engine: DraftEngine, vocab_size: int, name: str = "draft model"):
        self.engine = engine
        self.vocab_size = vocab_size
        self.name = name
        self._ids = itertools.count()
        self.token_seconds = 0.0  # a one-token call's seconds (decayed mean; 0 before the first)

    def measured(self, seconds: float) -> None:
        weight = 0.25 if self.token_seconds else 1.0
        self.token_seconds += weight * (seconds - self.token_seconds)

    def drafter(self, prompt_ids: Iterable[int] = ()) -> DraftModelDrafter:
        return DraftModelDrafter(self, prompt_ids)

    def _slot_id(self) -> tuple[str, int]:
        return ("draft", next(self._ids))


class DraftModelDrafter:
    """One sequence's drafts from the draft model: ``tokens``, the sequence (prompt + accepted
    answer); ``cached``, the tokens whose keys and values the draft engine's slot holds (a prefix
    of the sequence, then drafted tokens the target may have refused). The slot is taken at the
    first proposal and given back by ``close``. A failure of the draft engine (a sequence longer
    than the draft model's context, no free slot) ends this sequence's drafting, never its answer."""

    costly = True  # a drafted token costs a call of the draft model: propose only what will be verified

    def __init__(self, model: DraftModel, tokens: Iterable[int] = ()):
        self.model = model
        self.seq = model._slot_id()
        self.tokens: list[int] = list(tokens)
        self.cached: list[int] = []
        self.known = 0  # tokens of ``cached`` that are the sequence's own (the drafted ones follow)
        self.stopped = False

    @property
    def token_seconds(self) -> float:
        """Seconds of one drafted token's call, measured over the draft model's recent one-token calls."""
        return self.model.token_seconds

    def extend(self, tokens: Iterable[int]) -> None:
        self.tokens.extend(tokens)

    def propose(self, k: int) -> list[int]:
        if k < 1 or not self.tokens or self.stopped:
            return []
        limit = self.model.engine.max_context
        if limit is not None:  # the sequence and k - 1 drafted tokens are fed
            k = min(k, limit - len(self.tokens) + 1)
            if k < 1:
                return []
        try:
            return self._propose(k)
        except Exception as exc:  # noqa: BLE001 - drafts only save time: this sequence drafts no more
            log.warning("%s: drafting stopped for a sequence of %d tokens (%s)", self.model.name, len(self.tokens), exc)
            self.close()
            self.stopped = True
            return []

    def _propose(self, k: int) -> list[int]:
        engine = self.model.engine
        # keep the slot's prefix that the sequence shares, less its last token at least: that
        # token's logits give the first drafted token
        shared = self.known + _common_prefix(self.cached[self.known:], self.tokens[self.known:])
        keep = min(shared, len(self.tokens) - 1)
        if keep < len(self.cached):
            engine.truncate(self.seq, keep)
            del self.cached[keep:]
        feed = self.tokens[keep:]
        self.known = len(self.tokens)
        proposal: list[int] = []
        while True:
            started = time.perf_counter()
            logits = engine.prefill(self.seq, feed)
            if len(feed) == 1:
                self.model.measured(time.perf_counter() - started)
            self.cached += feed
            token = int(np.argmax(logits))
            if token >= self.model.vocab_size:
                break
            proposal.append(token)
            if len(proposal) == k:
                return proposal
            feed = [token]
        return proposal

    def close(self) -> None:
        """The request ended: its slot is given back."""
        if self.seq in self.model.engine:
            self.model.engine.remove(self.seq)
        self.cached = []
        self.known = 0


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
