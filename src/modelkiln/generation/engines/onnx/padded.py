"""The engine over an exported decoder graph (convert/generation/decoder_export.py: the architectures the
serving graph does not cover, and artifacts converted before it existed): prefill, then decode
steps over a batch of sequences that can change between steps. The same primitives as
``engines/onnx/serving.py``; ``execute`` (engines/onnx/base.py) runs the core's plans with them.

How sequences of different lengths share one batch
    Each sequence is prefilled alone, into its own cache (several prefill calls extend it: chunked
    prefill). ``join`` moves it into the running batch, whose cache is one tensor per layer
    [batch, kv_heads, width, head_dim]. Rows are aligned on the right (left padding): every row's
    newest token is in the last column, so a decode step appends one column for all rows at once.
    A row's padding columns have attention_mask 0 for the rest of its life, and its position ids
    count its own tokens only, so a sequence sees exactly what it would see alone: batched greedy
    tokens equal the lone run's (tested). Joining pads the shorter side on the left; leaving drops
    the row and then the padding columns no row needs any more. Both copy the cache once; a decode
    step copies nothing outside the graph (see ``decoder.py``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ....errors import InvalidInputError
from .decoder import DecoderSession, Past
from .base import HostEngine
from ..memory import host_kv_capacity
from ...plan import EngineCapabilities, SeqId



@dataclass
class _Pending:
    """A sequence being prefilled, with its own cache, not yet in the running batch."""

    past: Past
    length: int


class PaddedEngine(HostEngine):
    def __init__(self, decoder: DecoderSession, max_context: int | None = None, max_rows: int = 32,
                 keep_logits: bool = False):
        super().__init__()
        self.decoder = decoder
        self.keep_logits = keep_logits
        self.capabilities = EngineCapabilities(decoder.device, max_rows)
        self.max_context = max_context
        self._pending: dict[SeqId, _Pending] = {}
        self.rows: list[SeqId] = []  # running sequences, in batch row order
        self._past: Past | None = None  # [rows, kv_heads, width, head_dim] per layer and kind
        self._mask = np.zeros((0, 0), dtype=np.int64)  # [rows, width]: 1 where a row has a token
        self._positions = np.zeros(0, dtype=np.int64)  # [rows]: position id of each row's next token

    # -- queries ---------------------------------------------------------------------------
    @property
    def width(self) -> int:
        """Cache columns in the running batch (the longest row, plus padding no longer needed)."""
        return self._mask.shape[1]

    @property
    def cache_tokens(self) -> int:
        """Token slots the caches hold now, padding included (running rows × width, plus pending)."""
        return len(self.rows) * self.width + sum(p.length for p in self._pending.values())

    # no prefix cache (HostEngine's answers): the padded batch re-pads every sequence that joins

    def prefill_first(self, prompts: Sequence[tuple[SeqId, Sequence[int]]]) -> list[np.ndarray]:
        """One prefill per sequence: the exported graph would pad them to a shared width."""
        return [self.prefill(seq_id, ids) for seq_id, ids in prompts]

    @staticmethod
    def kv_tokens_needed(reserves: Sequence[int]) -> int:
        """Cache tokens for sequences that may reach ``reserves`` tokens: every row is as wide as
        the widest (left padding)."""
        return len(reserves) * max(reserves, default=0)

    def kv_capacity(self) -> int:
        d = self.decoder
        per_token = 2 * d.layers * int(d.kv_heads) * int(d.head_dim) * np.dtype(d.cache_dtype).itemsize
        return host_kv_capacity(per_token, self.capabilities.max_rows * (self.max_context or 4096))

    def _joining(self) -> dict[SeqId, _Pending]:
        return self._pending

    def _row_lengths(self) -> np.ndarray:
        return self._positions  # a row's next position is its cache's length

    # -- prefill ---------------------------------------------------------------------------
    def prefill(self, seq_id: SeqId, token_ids: Sequence[int], all_logits: bool = False) -> np.ndarray:
        self._check_prefill(seq_id, token_ids)
        pending = self._pending.get(seq_id) or _Pending(self.decoder.empty_past(1), 0)
        n = len(token_ids)
        self._check_context(pending.length + n)
        logits, present = self.decoder.forward(
            np.asarray([token_ids], dtype=np.int64),
            np.ones((1, pending.length + n), dtype=np.int64),
            np.arange(pending.length, pending.length + n, dtype=np.int64)[None],
            pending.past,
        )
        self._pending[seq_id] = _Pending(present, pending.length + n)
        return logits[0] if all_logits else logits[0, -1]

    def join(self, seq_id: SeqId) -> None:
        """Move a prefilled sequence into the running batch (it takes part in the next step)."""
        pending = self._pending.pop(seq_id)
        if self._past is None or not self.rows:
            self._past, self._mask = pending.past, np.ones((1, pending.length), dtype=np.int64)
        else:
            width = max(self.width, pending.length)
            batch = [self._pad_left(a, width) for a in self.decoder.past_to_numpy(self._past)]
            new = [self._pad_left(a, width) for a in self.decoder.past_to_numpy(pending.past)]
            self._past = self.decoder.past_from_numpy([np.concatenate(pair) for pair in zip(batch, new)])
            mask = np.zeros((len(self.rows) + 1, width), dtype=np.int64)
            mask[:-1, width - self.width:] = self._mask
            mask[-1, width - pending.length:] = 1
            self._mask = mask
        self.rows.append(seq_id)
        self._positions = np.append(self._positions, pending.length)

    def add(self, seq_id: SeqId, prompt_ids: Sequence[int]) -> np.ndarray:
        """Prefill a whole prompt and join: returns the logits for the first new token."""
        logits = self.prefill(seq_id, prompt_ids)
        self.join(seq_id)
        return logits

    # -- decode ----------------------------------------------------------------------------
    def step(self, next_tokens: Mapping[SeqId, int]) -> np.ndarray:
        """Feed each running sequence its next token; return logits [rows, vocab] in ``rows`` order."""
        if set(next_tokens) != set(self.rows):
            raise InvalidInputError(f"step needs one token for each running sequence {self.rows}, got {list(next_tokens)}")
        if not self.rows:
            return np.zeros((0, 0), dtype=np.float32)
        self._check_context(int(self._positions.max()) + 1)
        assert self._past is not None  # running rows have their cache
        ids = np.asarray([[next_tokens[s]] for s in self.rows], dtype=np.int64)
        mask = np.concatenate([self._mask, np.ones((len(self.rows), 1), dtype=np.int64)], axis=1)
        logits, self._past = self.decoder.forward(ids, mask, self._positions[:, None], self._past)
        self._mask = mask
        self._positions = self._positions + 1
        return logits[:, -1]

    # -- leaving ---------------------------------------------------------------------------
    def remove(self, seq_id: SeqId) -> None:
        """Drop a sequence (running or pending) and free its cache."""
        if self._pending.pop(seq_id, None) is not None:
            return
        row = self.rows.index(seq_id)
        self.rows.pop(row)
        self._positions = np.delete(self._positions, row)
        if not self.rows:
            self._past, self._mask = None, np.zeros((0, 0), dtype=np.int64)
            return
        mask = np.delete(self._mask, row, axis=0)
        assert self._past is not None  # rows ran: they have their cache
        first = int(np.argmax(mask.any(axis=0)))  # columns before this are padding in every row
        arrays = self.decoder.past_to_numpy(self._past)
        self._past = self.decoder.past_from_numpy([np.delete(a, row, axis=0)[:, :, first:] for a in arrays])
        self._mask = np.ascontiguousarray(mask[:, first:])

    # -- helpers ---------------------------------------------------------------------------
    def _check_context(self, tokens: int) -> None:
        if self.max_context is not None and tokens > self.max_context:
            raise InvalidInputError(f"{tokens} tokens exceed the model's context of {self.max_context}")

    @staticmethod
    def _pad_left(array: np.ndarray, width: int) -> np.ndarray:
        missing = width - array.shape[2]
        if missing == 0:
            return array
        return np.pad(array, ((0, 0), (0, 0), (missing, 0), (0, 0)))
