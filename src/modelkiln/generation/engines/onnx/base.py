"""What the two ONNX Runtime engines share: executing a ``StepPlan`` with their own primitives
(prefill a chunk, prefill several first chunks in one call, join the decode batch, decode one step,
leave) and choosing tokens from the logits on the host, one ``TokenChooser`` per sequence.

The engine, not the core, keeps each sequence's chooser and the token it chose last (the next
decode step's input), as a GPU engine keeps them on its device; the core sees token ids only. A
resumed sequence's tokens (``SeqStart.generated``) take the chooser's place until they are all fed
(only the last one when the core prefilled the others: ``SeqStart.prefill_generated``)."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ....errors import InvalidInputError, KilnError
from ...plan import Chunk, EngineCapabilities, Sampled, SeqId, SeqStart, StepPlan, StepResult, begin_step
from ...sampling import TokenChooser, token_logprobs, uniforms
from ...sampling.selection import bounded_draws


class HostEngine:
    """Subclasses provide the primitives below; ``execute`` is written once here."""

    capabilities: EngineCapabilities
    max_context: int | None
    rows: list[SeqId]
    keep_logits: bool = False  # every Sampled carries its row of logits (the gate compares them)

    def __init__(self) -> None:
        self._choosers: dict[SeqId, TokenChooser] = {}
        self._prompts: dict[SeqId, list[int]] = {}  # until the prompt is in the cache: the prefix cache keeps it
        self._next: dict[SeqId, int] = {}  # the token each running sequence feeds its next decode step
        self._forced: dict[SeqId, deque[int]] = {}  # a resumed sequence's tokens, fed instead of chosen
        self._stored: dict[SeqId, np.ndarray] = {}  # first-token logits of a whole prompt restored from the cache

    # -- primitives (subclasses) ---------------------------------------------------------------------
    def prefill(self, seq_id: SeqId, token_ids: Sequence[int], all_logits: bool = False) -> np.ndarray:
        """Run ``token_ids`` through a sequence that is not running (new, or prefilled in part).
        Returns the last position's logits [vocab] (every position's [len, vocab] with ``all_logits``)."""
        raise NotImplementedError

    def prefill_first(self, prompts: Sequence[tuple[SeqId, Sequence[int]]]) -> list[np.ndarray]:
        raise NotImplementedError

    def join(self, seq_id: SeqId) -> None: ...

    def step(self, next_tokens: Mapping[SeqId, int]) -> np.ndarray:
        raise NotImplementedError

    def verify(self, tokens: Mapping[SeqId, Sequence[int]]) -> list[np.ndarray]:
        """A decode step with drafted tokens after some rows' next one: every fed token's logits, per
        row (engines whose capabilities say ``verifies_drafts``)."""
        raise KilnError("this engine does not verify drafted tokens")

    def advance(self, seq_id: SeqId, accepted: int) -> None:
        """Keep ``accepted`` drafted tokens of the last ``verify`` in the sequence's cache."""
        raise KilnError("this engine does not verify drafted tokens")

    def remove(self, seq_id: SeqId) -> None: ...

    def _joining(self) -> Mapping[SeqId, Any]:
        """Prefilled, not yet in the decode batch: each has a ``length``."""
        raise NotImplementedError

    def _row_lengths(self) -> np.ndarray:
        """The running rows' cache lengths, in row order."""
        raise NotImplementedError

    def _check_prefill(self, seq_id: SeqId, token_ids: Sequence[int]) -> None:
        if seq_id in self.rows:
            raise InvalidInputError(f"sequence {seq_id!r} is already running")
        if not token_ids:
            raise InvalidInputError("a prompt needs at least one token")

    def length(self, seq_id: SeqId) -> int:
        """Tokens in a sequence's cache."""
        joining = self._joining()
        if seq_id in joining:
            return joining[seq_id].length
        return int(self._row_lengths()[self.rows.index(seq_id)])

    def __contains__(self, seq_id: SeqId) -> bool:
        return seq_id in self._joining() or seq_id in self.rows

    def restore_prefix(self, seq_id: SeqId, prompt_ids: Sequence[int], tokens: int) -> np.ndarray | None:
        """Start ``seq_id`` with ``tokens`` cached prompt tokens; the stored first-token logits when
        that is the whole prompt. Engines without a prefix cache are never asked."""
        raise KilnError("this engine has no prefix cache")

    def remember_prefix(self, seq_id: SeqId, prompt_ids: Sequence[int], last_logits: np.ndarray) -> None:
        """A prompt is all in the cache: keep its prefix for the prompts that follow (if cached)."""

    def cached_prefix(self, prompt_ids: Sequence[int]) -> int:
        return 0

    def use_prefix_cache(self, tokens: int) -> None:
        """Engines without a prefix cache keep none, whatever is asked."""

    def evict_prefixes(self, tokens: int) -> int:
        return 0

    @property
    def prefix_tokens(self) -> int:
        return 0

    # -- the seam --------------------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult:
        result = begin_step(plan, self._forget, self._start)
        to_choose: list[tuple[SeqId, np.ndarray]] = []
        chunks = [c for c in plan.chunks if c.seq not in result.errors]
        while chunks:
            group = self._first_chunk_group(chunks)
            if len(group) > 1:
                firsts = self.prefill_first([(c.seq, c.token_ids) for c in group])
                for chunk, row in zip(group, firsts):
                    self._chunk_done(chunk, row, to_choose)
                del chunks[:len(group)]
                continue
            chunk = chunks.pop(0)
            if not chunk.token_ids:  # the whole prompt came from the prefix cache, with its last logits
                self._chunk_done(chunk, self._stored[chunk.seq], to_choose)
                continue
            wants_all = chunk.keep_logits or chunk.targets is not None
            logits = self.prefill(chunk.seq, chunk.token_ids, all_logits=wants_all)
            if wants_all:
                self._prompt_outputs(chunk, logits, result)
                logits = logits[-1]
            self._chunk_done(chunk, logits, to_choose)
        verifying: list[tuple[SeqId, np.ndarray]] = []  # decode rows with drafts: every fed token's logits
        rows, drafts = self._decoding(plan)
        if drafts:
            fed = self.verify({seq: [self._next[seq], *drafts.get(seq, ())] for seq in rows})
            to_choose += [(seq, logits[0]) for seq, logits in zip(rows, fed) if seq not in drafts]
            verifying = [(seq, logits) for seq, logits in zip(rows, fed) if seq in drafts]
        elif rows:
            logits = self.step({seq: self._next[seq] for seq in rows})
            to_choose += list(zip(rows, logits))
        return self._choose(plan, to_choose, verifying, drafts, result)

    def _decoding(self, plan: StepPlan) -> tuple[list[SeqId], dict[SeqId, list[int]]]:
        """The running rows the plan decodes (all of them, or none), in row order, and the drafted
        tokens each feeds after its next one."""
        if not plan.decode:
            return [], {}
        rows = list(self.rows)
        if len(rows) != len(plan.decode) or set(rows) != set(plan.decode):
            raise KilnError(f"the plan decodes {list(plan.decode)}, the engine runs {rows}")
        # a row still feeding resumed tokens has no token of its own to draft after
        return rows, {seq: plan.drafts[seq] for seq in rows if plan.drafts.get(seq) and seq not in self._forced}

    def _choose(self, plan: StepPlan, to_choose: list[tuple[SeqId, np.ndarray]],
                verifying: list[tuple[SeqId, np.ndarray]], drafts: Mapping[SeqId, list[int]],
                result: StepResult) -> StepResult:
        """After the model: each row's token from its logits (under its grammar's mask), and the
        drafted rows' tokens position by position."""
        masks = plan.masks() if plan.masks is not None and to_choose else {}
        picks = self._pick_all(to_choose, masks)
        for (seq, row), pick in zip(to_choose, picks):
            self._record(seq, row, pick, result)
        for seq, logits in verifying:
            self._verify_row(seq, drafts[seq], logits, result)
        return result

    def warm_up(self) -> None:
        """One throw-away prefill and decode step: onnxruntime's first runs cost more than the next."""
        self.prefill("warm-up", [0, 1, 2, 3])
        self.join("warm-up")
        self.step({"warm-up": 4})
        self.remove("warm-up")

    # -- helpers -----------------------------------------------------------------------------------------
    def _start(self, start: SeqStart) -> None:
        self._choosers[start.seq] = TokenChooser(start.params, start.seed, start.prompt_ids, start.generated)
        if start.generated:
            self._forced[start.seq] = deque(start.generated[-1:] if start.prefill_generated else start.generated)
        if not start.prefill_generated:  # else its last chunk's logits are not the prompt's: nothing to cache
            self._prompts[start.seq] = start.prompt_ids
        if start.restore:
            stored = self.restore_prefix(start.seq, start.prompt_ids, start.restore)
            if stored is not None:
                self._stored[start.seq] = stored

    def _first_chunk_group(self, chunks: list[Chunk]) -> list[Chunk]:
        """The leading chunks that start new sequences with nothing cached and want only the last
        position's logits: one ``prefill_first`` call computes them together."""
        group: list[Chunk] = []
        for chunk in chunks:
            if chunk.start or not chunk.token_ids or chunk.keep_logits or chunk.targets is not None or chunk.seq in self:
                break
            group.append(chunk)
        return group

    def _chunk_done(self, chunk: Chunk, last_logits: np.ndarray, to_choose: list) -> None:
        if not chunk.last:
            return
        self._stored.pop(chunk.seq, None)  # a resumed sequence's chunks may go on after a whole restored prompt
        prompt = self._prompts.pop(chunk.seq, None)
        if prompt is not None and chunk.token_ids:
            self.remember_prefix(chunk.seq, prompt, last_logits)
        self.join(chunk.seq)
        to_choose.append((chunk.seq, last_logits))

    def _prompt_outputs(self, chunk: Chunk, logits: np.ndarray, result: StepResult) -> None:
        if chunk.keep_logits:
            result.prompt_logits[chunk.seq] = logits.copy()
        if chunk.targets is not None:
            top = self._choosers[chunk.seq].params.prompt_logprobs or 0
            result.prompt_logprobs[chunk.seq] = [token_logprobs(row, target, top)
                                                 for row, target in zip(logits, chunk.targets)]

    def _draws(self, seqs: list[SeqId]) -> dict[SeqId, float]:
        """The uniforms of the step's sampled rows, drawn in one call (``sampling.uniforms``); a row
        whose seed numpy would refuse draws its own, and fails alone."""
        sampling = [seq for seq in seqs if seq not in self._forced and not self._choosers[seq].params.greedy
                    and 0 <= self._choosers[seq].seed < 2**64]
        if not sampling:
            return {}
        choosers = [self._choosers[seq] for seq in sampling]
        return dict(zip(sampling, uniforms([c.seed for c in choosers], [c.position for c in choosers]).tolist()))

    def _pick_all(self, to_choose: list[tuple[SeqId, np.ndarray]],
                  masks: Mapping[SeqId, np.ndarray]) -> list[int | Exception | None]:
        """Each row's token (or the error of its own settings; None for a resumed row's forced token),
        with the step's uniforms drawn in one call, and the sampled rows whose logits need nothing
        first drawn in one more. One thread: splitting the rows over a second one was measured
        no faster, because onnxruntime's worker spins on the other core after a run (64 real rows, the
        bounded draw's first, float64 form: 57 us a row on one thread, 62 on two; 39 on two only with
        the session's ``session.force_spinning_stop``, which cost greedy decoding 1-4% at 16 streams)."""
        draws = self._draws([seq for seq, _ in to_choose])
        together = [i for i, (seq, row) in enumerate(to_choose) if self._drawn_together(seq, row, masks, draws)]
        tokens = bounded_draws([to_choose[i][1] for i in together], [self._choosers[to_choose[i][0]].params
                                                                       for i in together],
                               [draws[to_choose[i][0]] for i in together]) if together else None
        drawn = dict(zip(together, tokens.tolist())) if tokens is not None else {}
        picks: list[int | Exception | None] = []
        for i, (seq, row) in enumerate(to_choose):
            if seq in self._forced:
                picks.append(None)
                continue
            token = drawn.get(i, -1)
            if token >= 0:
                self._choosers[seq].accept(token)
                picks.append(token)
                continue
            try:  # one at a time: a grammar's mask, a bias or penalty, or a row the bounded draw declined
                picks.append(self._choosers[seq].choose(row, masks.get(seq), draws.get(seq)))
            except Exception as exc:  # noqa: BLE001 - its own settings (NaN temperature, a grammar allowing nothing): it alone ends
                picks.append(exc)
        return picks

    def _drawn_together(self, seq: SeqId, row: np.ndarray, masks: Mapping[SeqId, np.ndarray],
                        draws: Mapping[SeqId, float]) -> bool:
        """Whether the row's token can come from the step's one call (``bounded_draws``): its logits
        go to the draw as they are, and it is sampled (with its uniform). Greedy rows keep numpy's
        argmax, a vectorised pass faster than the call's (measured 11.5 against 14 us a row)."""
        chooser = self._choosers[seq]
        return (seq not in self._forced and seq not in masks and chooser.plain and row.dtype == np.float32
                and row.flags.c_contiguous and seq in draws)

    def _verify_row(self, seq: SeqId, draft: list[int], logits: np.ndarray, result: StepResult) -> None:
        """Choose a drafted row's tokens position by position, as its decode steps would have (its
        chooser: the penalties so far, the draw of that token's index), while each drafted token
        equals the one chosen before it; keep those in the cache. The chooser has then seen exactly
        the tokens returned. A row that fails (its own settings) returns none of them."""
        chooser, chosen = self._choosers[seq], []
        try:
            for j, row in enumerate(logits):
                chosen.append(chooser.choose(row))
                if j == len(draft) or chosen[-1] != draft[j]:
                    break
        except Exception as exc:  # noqa: BLE001 - its own settings: it alone ends
            result.errors[seq] = exc
            return
        self.advance(seq, len(chosen) - 1)  # drafted tokens accepted: every chosen one but the last
        for token, row in zip(chosen, logits):
            self._report(seq, row, token, result)

    def _record(self, seq: SeqId, logits: np.ndarray, pick: int | Exception | None, result: StepResult) -> None:
        forced = self._forced.get(seq)
        if forced:  # a resumed token, already sent: the next step's input, and nothing to report
            self._next[seq] = forced.popleft()
            if not forced:
                del self._forced[seq]
            return
        if isinstance(pick, Exception):
            result.errors[seq] = pick
            return
        assert pick is not None  # only a forced row has no pick, and it was fed above
        self._report(seq, logits, pick, result)

    def _report(self, seq: SeqId, logits: np.ndarray, token: int, result: StepResult) -> None:
        """A chosen token: the next step's input, and what the core gets."""
        params = self._choosers[seq].params
        sampled = Sampled(seq, token, logits=logits.copy() if self.keep_logits else None)
        if params.logprobs is not None:
            sampled.logprob, sampled.top_logprobs = token_logprobs(logits, token, params.logprobs)
        self._next[seq] = token
        result.sampled.append(sampled)

    def _forget(self, seq: SeqId) -> None:
        self._choosers.pop(seq, None)
        self._prompts.pop(seq, None)
        self._next.pop(seq, None)
        self._forced.pop(seq, None)
        self._stored.pop(seq, None)
        if seq in self:
            self.remove(seq)
