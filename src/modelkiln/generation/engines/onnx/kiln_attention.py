"""The engine over a serving graph built with KilnAttention (native/attention.c; GGUF variants with kiln's
native operators): a step's prompt chunks, decode rows and drafted tokens in one call.

Why one call can hold them all
    KilnAttention takes every token with its own cache row and position, and reduces a position's
    attention the same way whatever else the call holds; kiln's GgufMatMul gives a row the same bits
    alone or among others. So a token's logits do not depend on the other tokens of its call, and
    nothing forces a step into a prompt call and a decode call (GroupQueryAttention does force that:
    ``serving.py``). One call reads every weight once a step, where two read them twice.

One cache region of slots
    Staging and running rows are slots of one region, bound once as past and present. A sequence
    takes a slot for its first chunk and keeps it to its end: joining the decode batch copies
    nothing, and leaving it moves no other row into the hole. ``rows`` (the running sequences, in
    the order their logits come back) and ``_slots`` (where each one's cache is) go together."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnxruntime as ort

from ....errors import InvalidInputError, KilnError
from ...plan import Chunk, EngineCapabilities, SeqId, StepPlan, StepResult, begin_step
from . import graph_io as io
from .kv_cache import RowRegion
from .serving import TILE_ROWS, ServingEngine


class KilnAttentionEngine(ServingEngine):
    kiln_attention = True

    def _allocate(self, staging_rows: int) -> None:
        self.running = self.staging = RowRegion(self.shape, self.max_rows + staging_rows)
        self._free_staging = list(range(self.running.rows))
        self._slots: list[int] = []  # each running sequence's slot, in ``rows`` order
        self._whole: ort.IOBinding | None = None  # every slot bound, made once

    def _capabilities(self, prefix_cache: bool) -> EngineCapabilities:
        return EngineCapabilities("cpu", self.max_rows, mixed_steps=True, prefix_cache=prefix_cache,
                                  prefill_is_decode=True, verifies_drafts=True)

    # -- primitives (each one call of the packed form) -----------------------------------------------
    def prefill(self, seq_id: SeqId, token_ids: Sequence[int], all_logits: bool = False) -> np.ndarray:
        self._check_prefill(seq_id, token_ids)
        staged = self._stage(seq_id)
        self._check_length(staged.length + len(token_ids))
        call = _Call()
        logits = call.add(token_ids, staged.row, staged.length, every=all_logits)
        out = self._call(call)
        staged.length += len(token_ids)
        return out[logits] if all_logits else out[logits][-1]

    def prefill_first(self, prompts: Sequence[tuple[SeqId, Sequence[int]]]) -> list[np.ndarray]:
        if any(seq_id in self for seq_id, _ in prompts) or any(not ids for _, ids in prompts):
            raise InvalidInputError("prefill_first takes new sequences with at least one token each")
        for _, token_ids in prompts:
            self._check_length(len(token_ids))
        staged = [self._stage(seq_id) for seq_id, _ in prompts]
        call = _Call()
        wanted = [call.add(token_ids, s.row, 0, every=False) for s, (_, token_ids) in zip(staged, prompts)]
        out = self._call(call)
        for s, (_, token_ids) in zip(staged, prompts):
            s.length = len(token_ids)
        return [out[w][-1] for w in wanted]

    def join(self, seq_id: SeqId) -> None:
        if len(self.rows) >= self.max_rows:
            raise KilnError(f"the decode batch is full ({self.max_rows} rows)")
        staged = self._staged.pop(seq_id)
        self.rows.append(seq_id)
        self._slots.append(staged.row)
        self._lengths = np.append(self._lengths, np.int32(staged.length))

    def step(self, next_tokens: Mapping[SeqId, int]) -> np.ndarray:
        if len(next_tokens) != len(self.rows) or any(s not in next_tokens for s in self.rows):
            raise InvalidInputError(f"step needs one token for each running sequence {self.rows}, got {list(next_tokens)}")
        if not self.rows:
            return np.zeros((0, 0), dtype=np.float32)
        return np.stack([logits[0] for logits in self.verify({s: [next_tokens[s]] for s in self.rows})])

    def verify(self, tokens: Mapping[SeqId, Sequence[int]]) -> list[np.ndarray]:
        """A decode step where a row may feed drafted tokens after its next one: each running row's
        tokens at its positions L, L+1, ..., every token's logits per row, in ``rows`` order. Each
        row keeps its first token (``advance`` keeps the accepted drafts). A rejected token's key and
        value stay beyond the row's length, never read and written over later."""
        if len(tokens) != len(self.rows) or any(not tokens.get(s) for s in self.rows):
            raise InvalidInputError(f"verify needs tokens for each running sequence {self.rows}, got {list(tokens)}")
        call = _Call()
        wanted = self._decode_tokens(call, [list(tokens[s]) for s in self.rows])
        out = self._call(call)
        self._lengths += 1
        return [out[w] for w in wanted]

    def advance(self, seq_id: SeqId, accepted: int) -> None:
        """Keep ``accepted`` drafted tokens of the last ``verify`` in the row's cache."""
        self._lengths[self.rows.index(seq_id)] += accepted

    def remove(self, seq_id: SeqId) -> None:
        staged = self._staged.pop(seq_id, None)
        if staged is not None:
            self._free_staging_row(staged.row)
            return
        row = self.rows.index(seq_id)
        self._free_staging_row(self._slots.pop(row))
        self.rows.pop(row)
        self._lengths = np.delete(self._lengths, row)

    def _take_staging_rows(self, count: int) -> int:
        if count != 1:  # one slot at a time: a call names each token's slot, so none need be side by side
            raise KilnError("slots are taken one at a time")
        if not self._free_staging:
            raise KilnError(f"no free cache slot ({self.running.rows} in use)")
        return self._free_staging.pop(0)

    # -- the step in one call -------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult:
        """The plan's chunks, then its decode rows (those running before this step) with their drafts,
        as one call; the chunks that end a prompt join the batch after it."""
        result = begin_step(plan, self._forget, self._start)
        rows, drafts = self._decoding(plan)
        call = _Call()
        chunks: list[tuple[Chunk, slice | None]] = []  # None: the whole prompt came from the prefix cache
        for chunk in plan.chunks:
            if chunk.seq in result.errors:
                continue
            if not chunk.token_ids:
                chunks.append((chunk, None))
                continue
            self._check_prefill(chunk.seq, chunk.token_ids)
            staged = self._stage(chunk.seq)
            self._check_length(staged.length + len(chunk.token_ids))
            every = chunk.keep_logits or chunk.targets is not None
            chunks.append((chunk, call.add(chunk.token_ids, staged.row, staged.length, every)))
        wanted = self._decode_tokens(call, [[self._next[seq], *drafts.get(seq, ())] for seq in rows])
        out = self._call(call) if call.ids else np.zeros((0, 0), dtype=np.float32)
        for chunk, places in chunks:
            if places is not None:
                self._staged[chunk.seq].length += len(chunk.token_ids)
        self._lengths[:len(rows)] += 1
        to_choose: list[tuple[SeqId, np.ndarray]] = []
        verifying: list[tuple[SeqId, np.ndarray]] = []
        for seq, w in zip(rows, wanted):
            if seq in drafts:
                verifying.append((seq, out[w]))
            else:
                to_choose.append((seq, out[w][0]))
        for chunk, places in chunks:
            if places is None:  # the whole prompt came from the prefix cache, with its last logits
                self._chunk_done(chunk, self._stored[chunk.seq], to_choose)
                continue
            logits = out[places]
            if chunk.keep_logits or chunk.targets is not None:
                self._prompt_outputs(chunk, logits, result)
            self._chunk_done(chunk, logits[-1], to_choose)
        return self._choose(plan, to_choose, verifying, drafts, result)

    def _decode_tokens(self, call: _Call, fed: list[list[int]]) -> list[slice]:
        """Each running row's tokens at the positions after its length; their logits' places."""
        for tokens, length in zip(fed, self._lengths):
            self._check_length(int(length) + len(tokens))
        return [call.add(tokens, slot, int(length), every=True) for tokens, slot, length in zip(fed, self._slots, self._lengths)]

    def _call(self, call: _Call) -> np.ndarray:
        """Run the tokens laid out in ``call``: logits [wanted, vocab] in the order they were asked."""
        if self._whole is None:
            self._whole = self._binding_of(self.running.views(0, self.running.rows))
        ids, rows, places, positions = call.arrays(pad=self.ghost_rows)
        self._whole.bind_output(io.LOGITS)  # unbound from the last call's shape: this call's has its own
        return self._run_tokens(self._whole, ids, rows, places, positions)

    def _run_tokens(self, binding: ort.IOBinding, ids: np.ndarray, rows: np.ndarray, places: np.ndarray,
                    positions: np.ndarray) -> np.ndarray:
        """KilnAttention's form: each token ``ids[b, t]`` with its cache row and position (-1: padding);
        logits at ``positions`` of the tokens flattened."""
        binding.bind_cpu_input(io.INPUT_IDS, ids)
        binding.bind_cpu_input(io.CACHE_ROWS, rows)
        binding.bind_cpu_input(io.POSITIONS, places)
        binding.bind_cpu_input(io.LOGIT_POSITIONS, positions)
        self.session.run_with_iobinding(binding)
        return binding.get_outputs()[0].numpy()

    def _probe(self, tokens: np.ndarray) -> np.ndarray:
        """Each token alone in a slot of its own at position 0 (the lone-row check at load)."""
        call = _Call()
        for slot, token in enumerate(tokens.tolist()):
            call.add([token], slot, 0, every=True)
        logits = self._call(call).copy()
        for slot in range(len(tokens)):
            self.running.release(slot)
        return logits


class _Call:
    """One call's tokens as KilnAttention takes them: each with its slot and position, and the
    positions whose logits come back."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.slots: list[int] = []
        self.places: list[int] = []
        self.wanted: list[int] = []

    def add(self, tokens: Sequence[int], slot: int, start: int, every: bool) -> slice:
        """``tokens`` at positions start, start + 1, ... of ``slot``; every position's logits or the
        last one's. Returns where they are among the call's logits."""
        first, n = len(self.ids), len(tokens)
        self.ids.extend(tokens)
        self.slots.extend([slot] * n)
        self.places.extend(range(start, start + n))
        before = len(self.wanted)
        self.wanted.extend(range(first, first + n) if every else [first + n - 1])
        return slice(before, len(self.wanted))

    def arrays(self, pad: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """[1, tokens] ids, slots, places, and the logits' positions; with ``pad``, one padding token
        (place -1: neither written nor attended) where the tokens would leave a lone row in the last
        128-row tile of an int4/int8 MatMulNBits (``serving.py``)."""
        total = len(self.ids)
        width = total + 1 if pad and total % TILE_ROWS == 1 else total
        ids = np.zeros((1, width), dtype=np.int64)
        ids[0, :total] = self.ids
        slots = np.zeros((1, width), dtype=np.int64)
        slots[0, :total] = self.slots
        places = np.full((1, width), -1, dtype=np.int64)
        places[0, :total] = self.places
        return ids, slots, places, np.asarray(self.wanted, dtype=np.int64)

