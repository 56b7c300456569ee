"""The torch engine: a Llama-family decoder (``engines/torch/decoder.py``) on the CPU or a CUDA device, its
KV cache preallocated there, tokens chosen there (``sampling/device.py``), behind the engine seam
(``plan.Engine``).

- **One call per step** (``mixed_steps``): the decode rows and the prompt chunks of a plan are packed
  into one sequence of tokens, so each layer's kernels run once for all of them; attention reads each
  token's own sequence's cache in place.
- **The KV cache** is one tensor [layers, 2, slots, kv_heads, max_length, head_dim]. A sequence takes
  a free slot when it starts and gives it back when it leaves: no other row is copied. On the CPU the
  tensor lies in reserved, lazily committed memory (a slot holds in RAM what its sequence wrote, and
  gives its pages back when freed), so the KV budget is the sum of the sequences' lengths, as for
  the serving graph's engine; on CUDA it is allocated at load from the device's free memory, and the
  budget is slots × ``max_length``.
- **CUDA graphs** (CUDA only): a decode-only step replays a graph captured at ``warm_up`` for its
  batch size rounded up to a bucket (1, 2, 4, ... ``max_rows``), whatever its rows' lengths (attention
  reads each row's positions from the device); padding rows write into a spare slot. The graph also
  chooses its rows' tokens (``DeviceSampler.graph_choice``: the slots' settings live on the device,
  the rows' uniforms come in the step's one input copy; a bucket has a graph for all-greedy steps,
  without the draw, and one for steps with sampled rows), so the host waits once, for the tokens; a
  step with a grammar mask chooses after the replay (``DeviceSampler.choose``). A step with
  prompt chunks replays one captured for its tokens rounded up to a bucket (64, 128, ... up to the
  prompt chunk and ``max_rows`` more), its padding tokens without a slot (they write and read
  nothing); only a step larger than that, or one whose every prompt position is scored, runs eagerly.
- **Batch invariance** (``EngineOptions.batch_invariant``, on by default): the matrix products of
  ``engines/torch/ops.py`` and the kernels of ``engines/torch/kernels/`` give a row the same bits
  whatever else is in the step, so an answer does not depend on the load. With it off, PyTorch's
  matrix products run as they come (faster on the CPU).

- **The prefix cache** (``prefix_cache.PrefixCache``, as the serving graph's engine keeps it): prompt
  prefixes' KV in blocks copied out of a slot on the device, copied into a new sequence's slot when its
  prompt starts with them; a prompt seen whole keeps its last position's logits on the device, so its
  first token costs no forward pass. Attention and the products give a position the same bits
  however its prompt was computed, so a restored prefix changes no answer."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ....errors import InvalidInputError, KilnError
from ..memory import give_back, host_kv_capacity, reserve
from ...prefix_cache import PrefixCache
from ...plan import (Chunk, EngineCapabilities, EngineOptions, ModelShape, Sampled, SeqId, SeqStart, StepPlan, StepResult,
                     begin_step)
from ...sampling import SamplingParams
from .decoder import StepTokens, TorchDecoder, load_config
from .ops import Kernels
from .transfers import HostCopy, to_device, to_host
from ...sampling.device import DeviceSampler, token_logprobs

log = logging.getLogger(__name__)

GPU_MEMORY_SHARE = 0.85  # of the free memory after the weights, for the KV cache
GPU_HEADROOM = 2 << 30  # bytes kept free for activations, graphs and sampling
# Prompt tokens per step on CUDA. An eager prompt step's cost is the host's (Python, launching dozens
# of kernels a layer), not its tokens': a 128-token step (the CPU's chunk) took about 50 ms on an H200,
# whose arithmetic for it is well under a millisecond (docs/gpu.md). vLLM takes 2048-8192 prompt
# tokens a step. Prompt steps now replay graphs of token buckets up to this many tokens and max_rows more.
GPU_PREFILL_CHUNK = 2048
PROMPT_BUCKET = 64  # the smallest token bucket of a step with prompt chunks
LENGTH_STEP = 128  # a slot's positions are a multiple of this


class KVCache:
    """[layers, 2 (key, value), slots, kv_heads, max_length, head_dim] on one device."""

    def __init__(self, layers: int, slots: int, kv_heads: int, max_length: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device):
        self.shape = (layers, 2, slots, kv_heads, max_length, head_dim)
        size = int(np.prod(self.shape))
        self._memory = None
        if device.type == "cpu":  # reserved, committed page by page as written (memory.reserve)
            self._memory = reserve(size * dtype.itemsize)
            self.data = torch.frombuffer(self._memory, dtype=dtype, count=size).view(self.shape)
        else:
            self.data = torch.zeros(self.shape, dtype=dtype, device=device)
        self._slot_bytes = kv_heads * max_length * head_dim * dtype.itemsize

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i, 0], self.data[i, 1]

    def read(self, slot: int, start: int, stop: int) -> torch.Tensor:
        """A copy of a slot's positions [start, stop): [layers · 2, kv_heads, stop - start, head_dim]
        (the prefix cache's block layout: positions on axis 2)."""
        layers, two, _, kv_heads, _, head_dim = self.shape
        return self.data[:, :, slot, :, start:stop].reshape(layers * two, kv_heads, stop - start, head_dim).clone()

    def write(self, slot: int, start: int, kv: torch.Tensor) -> None:
        """``read``'s copy back, into a slot from position ``start``."""
        layers, two, _, kv_heads, _, head_dim = self.shape
        self.data[:, :, slot, :, start:start + kv.shape[2]] = kv.view(layers, two, kv_heads, kv.shape[2], head_dim)

    def release(self, slot: int) -> None:
        """Give a slot's pages back (CPU); on CUDA the memory stays the cache's."""
        if self._memory is None:
            return
        layers, _, slots = self.shape[:3]
        for block in range(2 * layers):
            give_back(self._memory, (block * slots + slot) * self._slot_bytes, self._slot_bytes)


@dataclass
class _Sequence:
    slot: int
    length: int = 0  # tokens in its cache
    decoding: bool = False  # its prompt is in: its next input is its slot's in ``next_ids``
    forced: list[int] = field(default_factory=list)  # a resumed answer's tokens, fed instead of chosen
    prompt: list[int] | None = None  # until its prompt is in the cache: the prefix cache keeps it
    stored_logits: torch.Tensor | None = None  # a whole prompt restored from the prefix cache: its last logits


class TorchEngine:
    def __init__(self, decoder: TorchDecoder, cache: KVCache, max_rows: int, max_context: int | None,
                 keep_logits: bool = False, step_graphs: bool | None = None):
        self.decoder, self.cache = decoder, cache
        self.device = decoder.device
        self.max_rows = max_rows
        self.max_length = cache.shape[4]
        self.max_context = min(max_context or self.max_length, self.max_length)
        self.keep_logits = keep_logits
        self.capabilities = EngineCapabilities(self.device.type, max_rows, mixed_steps=True, prefix_cache=False,
                                               prefill_chunk=GPU_PREFILL_CHUNK if self.device.type == "cuda" else None,
                                               overlaps=True)
        self.spare_slot = max_rows  # padding rows of a graph write here
        self._free = list(range(max_rows))
        self._sequences: dict[SeqId, _Sequence] = {}
        self.sampler = DeviceSampler(max_rows + 1, decoder.config.vocab, self.device)  # and the spare slot
        # each slot's next input token, written where it is chosen: a decode step reads it on the device
        self.next_ids = torch.zeros(max_rows + 1, dtype=torch.long, device=self.device)
        # step graphs: on CUDA by default; on the CPU only when asked (eager replays of the same buckets)
        use_graphs = self.device.type == "cuda" if step_graphs is None else step_graphs
        self.graphs = StepGraphs(self, GPU_PREFILL_CHUNK) if use_graphs else None
        self.prefixes: PrefixCache | None = None

    # -- queries -----------------------------------------------------------------------------------
    def __contains__(self, seq: SeqId) -> bool:
        return seq in self._sequences

    @property
    def cache_tokens(self) -> int:
        return sum(s.length for s in self._sequences.values())

    @property
    def prefix_tokens(self) -> int:
        return self.prefixes.tokens if self.prefixes else 0

    def kv_tokens_needed(self, reserves: Sequence[int]) -> int:
        """On the CPU each sequence holds its own length; on CUDA each holds a whole slot (a
        sequence's reserve never exceeds a slot: the core caps it at ``max_context``)."""
        if self.device.type == "cpu":
            return sum(reserves)
        return len(reserves) * self.max_length

    def kv_capacity(self) -> int:
        if self.device.type == "cpu":
            return host_kv_capacity(self.decoder.config.kv_bytes_per_token * self.decoder.dtype.itemsize,
                                    self.max_rows * self.max_length)
        return self.max_rows * self.max_length

    # -- the prefix cache --------------------------------------------------------------------------------
    def cached_prefix(self, prompt_ids: Sequence[int]) -> int:
        """How many of the prompt's tokens the prefix cache holds (counted in its hit statistics)."""
        return self.prefixes.cached_tokens(prompt_ids) if self.prefixes else 0

    def use_prefix_cache(self, tokens: int) -> None:
        """Keep at most ``tokens`` tokens of prompt prefixes (0: none); what was cached is dropped."""
        self.prefixes = PrefixCache(tokens) if tokens > 0 else None
        self.capabilities = replace(self.capabilities, prefix_cache=tokens > 0)

    def evict_prefixes(self, tokens: int) -> int:
        return self.prefixes.evict(tokens) if self.prefixes else 0

    def _restore(self, state: _Sequence, prompt_ids: Sequence[int], tokens: int) -> None:
        """A new sequence's first ``tokens`` prompt positions copied from the prefix cache into its
        slot (what ``cached_prefix`` said), with the stored last logits when that is the whole prompt."""
        if self.prefixes is None:
            raise KilnError("this engine keeps no prefix cache")
        blocks, whole = self.prefixes.restore(prompt_ids, tokens)
        size = self.prefixes.block_tokens
        for b, block in enumerate(blocks):
            self.cache.write(state.slot, b * size, block.kv)
        if whole is not None:
            self.cache.write(state.slot, len(blocks) * size, whole.tail_kv)
            state.stored_logits = whole.logits
        state.length = tokens

    def _remember(self, state: _Sequence, last_logits: torch.Tensor) -> None:
        """A prompt now all in its slot: its prefix kept for the prompts that follow."""
        prompt, state.prompt = state.prompt, None
        if self.prefixes is not None and prompt is not None and state.length >= len(prompt):
            slot = state.slot
            # the last logits are the prompt's only where nothing was prefilled after it (a resumed answer's tokens)
            whole = last_logits if state.length == len(prompt) else None
            self.prefixes.insert(prompt, lambda start, stop: self.cache.read(slot, start, stop), whole)

    # -- the seam ------------------------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult:
        return self.collect(self.launch(plan))

    def launch(self, plan: StepPlan) -> Launched:
        """Queue a plan's work on the device: the forward pass, the choice of tokens, and what the next
        step reads of it (each chosen token as its sequence's next input, the penalties' counts, the
        draws' positions), then the copy of the tokens to the host; wait for none of it (a scored
        chunk's logits or log-probabilities excepted: they come to the host here). The next plan may
        be launched before this one is collected (overlapped scheduling): its decode rows feed the
        tokens this one chooses, from the device. Its sequences must not leave before it is collected."""
        result = begin_step(plan, self._leave, self._start)
        chunks: list[Chunk] = []
        restored: list[Chunk] = []  # whole prompts from the prefix cache: their first token to choose
        for chunk in plan.chunks:
            if chunk.seq in result.errors:
                continue
            try:
                self._check_chunk(chunk)
                (chunks if chunk.token_ids else restored).append(chunk)
            except KilnError as exc:
                result.errors[chunk.seq] = exc
        decode = list(plan.decode)
        for seq in decode:
            state = self._sequences.get(seq)
            if state is None or not state.decoding:
                raise KilnError(f"the plan decodes {seq!r}, which is not running in the engine")
            if state.length + 1 > self.max_length:
                raise InvalidInputError(f"{state.length + 1} tokens exceed the engine's {self.max_length}-token rows")
        launched = Launched(result)
        if not decode and not chunks and not restored:
            return launched
        graph_choice = None  # a decode step graph's choice of its rows' tokens
        if decode or chunks:
            logits, rows, graph_choice = self._run(decode, chunks)
        else:
            logits, rows = torch.empty(0, self.decoder.config.vocab, device=self.device), {}
        choosing: list[tuple[SeqId, int]] = [(seq, rows[seq][0]) for seq in decode]
        for chunk in chunks:
            first, count = rows[chunk.seq]
            if chunk.targets is not None or chunk.keep_logits:
                self._prompt_outputs(chunk, logits[first:first + count], result)
            state = self._sequences[chunk.seq]
            state.length = chunk.start + len(chunk.token_ids)
            if chunk.last:
                choosing.append((chunk.seq, first + count - 1))
                self._remember(state, logits[first + count - 1])
        if restored:  # their stored logits as rows after the forward pass's
            graph_choice = None  # the step graph chose none of them: the sampler chooses every row
            stored: list[torch.Tensor] = []
            for chunk in restored:
                state = self._sequences[chunk.seq]
                assert state.stored_logits is not None  # _check_chunk let it in for them
                stored.append(state.stored_logits)
                state.stored_logits = None
                choosing.append((chunk.seq, logits.shape[0] + len(stored) - 1))
            logits = torch.cat([logits, torch.stack(stored)])
        for seq in decode:
            self._sequences[seq].length += 1
        if choosing:
            masks = plan.masks() if plan.masks is not None else {}
            self._choose(choosing, logits, graph_choice, masks, launched)
        return launched

    def collect(self, launched: Launched) -> StepResult:
        """A launched plan's result: waits for its tokens (the step's one wait on the device)."""
        result = launched.result
        if launched.tokens is None:
            return result
        assert launched.logits is not None
        choice = self.sampler.settle(launched.slots, launched.logits, launched.tokens.result())
        kept_logits = to_host(launched.logits) if self.keep_logits else None  # the gate's: a wait of its own
        for r, seq in enumerate(launched.choosing):
            if r in choice.errors:
                result.errors[seq] = choice.errors[r]
                continue
            sampled = Sampled(seq, choice.tokens[r], logits=kept_logits[r].copy() if kept_logits is not None else None)
            if r in choice.logprobs:
                sampled.logprob, sampled.top_logprobs = choice.logprobs[r]
            result.sampled.append(sampled)
        return result

    def warm_up(self) -> None:
        """A short prompt and a few decode steps (the first runs allocate); on CUDA, the step graphs."""
        seq = ("warm-up",)
        start = SeqStart(seq, [0, 1, 2, 3], SamplingParams(max_new_tokens=4, ignore_eos=True), seed=0)
        self.execute(StepPlan(starts=[start], chunks=[Chunk(seq, 0, [0, 1, 2, 3], last=True)]))
        for _ in range(2):
            self.execute(StepPlan(decode=[seq]))
        self.execute(StepPlan(finished=[seq]))
        if self.graphs is not None:
            self.graphs.capture()

    # -- steps -----------------------------------------------------------------------------------------------
    def _start(self, start: SeqStart) -> None:
        if start.seq in self._sequences:
            raise InvalidInputError(f"sequence {start.seq!r} is already in the engine")
        if len(start.prompt_ids) > self.max_context:
            raise InvalidInputError(f"{len(start.prompt_ids)} prompt tokens exceed the engine's context of "
                                    f"{self.max_context} tokens")
        if not self._free:
            raise KilnError(f"no free slot: the engine runs {self.max_rows} sequences at most")
        slot = self._free.pop(0)
        try:
            self.sampler.start(slot, start.params, start.seed, start.prompt_ids, start.generated)
        except Exception:
            self._free.insert(0, slot)
            raise
        state = _Sequence(slot, forced=list(reversed(start.generated)), prompt=list(start.prompt_ids))
        if start.restore:
            try:
                self._restore(state, start.prompt_ids, start.restore)
            except Exception:
                self.sampler.leave(slot)
                self._free.insert(0, slot)
                raise
        self._sequences[start.seq] = state

    def _check_chunk(self, chunk: Chunk) -> None:
        state = self._sequences.get(chunk.seq)
        if state is None:
            raise KilnError(f"a prompt chunk for {chunk.seq!r}, which the engine was not told about")
        whole = not chunk.token_ids and chunk.last and state.stored_logits is not None  # restored from the prefix cache
        if chunk.start != state.length or not (chunk.token_ids or whole):
            raise KilnError(f"a prompt chunk of {chunk.seq!r} at {chunk.start} with {len(chunk.token_ids)} tokens; "
                            f"its cache holds {state.length}")
        if chunk.start + len(chunk.token_ids) > self.max_length:
            raise InvalidInputError(f"{chunk.start + len(chunk.token_ids)} tokens exceed the engine's "
                                    f"{self.max_length}-token rows")

    def _leave(self, seq: SeqId) -> None:
        state = self._sequences.pop(seq, None)
        if state is None:
            return
        self.sampler.leave(state.slot)
        self.cache.release(state.slot)
        self._free.append(state.slot)
        self._free.sort()

    def _run(self, decode: list[SeqId],
             chunks: list[Chunk]) -> tuple[torch.Tensor, dict[SeqId, tuple[int, int]], torch.Tensor | None]:
        """The forward pass: logits of the positions wanted, each sequence's (first row, rows) in them
        (a decode row's one, a chunk's every position (scored) or its last (ending its prompt)), and,
        for a decode-only step replayed from a step graph, the tokens it chose for its rows. A decode
        row's input is its sequence's next token on the device (``next_ids``)."""
        states = [self._sequences[seq] for seq in decode]
        positions = [s.length for s in states]
        slots = [s.slot for s in states]
        rows = {seq: (i, 1) for i, seq in enumerate(decode)}
        if not chunks and self.graphs is not None and self.graphs.covers(len(decode)):
            logits, choice = self.graphs.run(positions, slots, self.sampler.draws(slots))
            return logits, rows, choice
        ids = [0] * len(decode)  # from_slot: read from next_ids
        select = list(range(len(decode)))
        for chunk in chunks:
            offset, count = len(ids), len(chunk.token_ids)
            ids += chunk.token_ids
            positions += range(chunk.start, chunk.start + count)
            slots += [self._sequences[chunk.seq].slot] * count
            if chunk.targets is not None or chunk.keep_logits:
                rows[chunk.seq] = (len(select), count)
                select += range(offset, offset + count)
            elif chunk.last:
                rows[chunk.seq] = (len(select), 1)
                select.append(offset + count - 1)
            else:
                rows[chunk.seq] = (len(select), 0)
        from_slot = [1] * len(decode) + [0] * (len(ids) - len(decode))
        if self.graphs is not None and self.graphs.covers_step(len(ids), len(select)):
            return self.graphs.run_step(ids, positions, slots, select, from_slot), rows, None
        tokens = to_device(np.array([ids, positions, slots, from_slot], dtype=np.int64), torch.long, self.device)
        step = StepTokens(self.input_ids(tokens[0], tokens[2], tokens[3]), tokens[1], tokens[2],
                          select=to_device(select, torch.long, self.device))
        with torch.inference_mode():
            logits = self.decoder.forward(step, self.cache)
        return logits, rows, None

    def input_ids(self, ids: torch.Tensor, slots: torch.Tensor, from_slot: torch.Tensor) -> torch.Tensor:
        """A step's token ids: a decode row's (``from_slot``) is its sequence's next token, chosen by
        the step before on the device, the others' are ``ids``."""
        return torch.where(from_slot != 0, self.next_ids.index_select(0, slots.clamp(min=0)), ids)

    def _prompt_outputs(self, chunk: Chunk, logits: torch.Tensor, result: StepResult) -> None:
        """A scored chunk's logits or log-probabilities: each a wait on the device of its own."""
        if chunk.keep_logits:
            result.prompt_logits[chunk.seq] = to_host(logits)
        if chunk.targets is not None:
            top = self.sampler.params(self._sequences[chunk.seq].slot).prompt_logprobs or 0
            targets = list(chunk.targets) + [0] * (len(chunk.token_ids) - len(chunk.targets))
            scored = token_logprobs(logits, targets, [top] * len(targets))
            result.prompt_logprobs[chunk.seq] = scored[:len(chunk.targets)]

    def _choose(self, choosing: list[tuple[SeqId, int]], logits: torch.Tensor, graph_choice: torch.Tensor | None,
                masks: dict, launched: Launched) -> None:
        """The rows' tokens, chosen and committed on the device (each one its sequence's next input),
        their copy to the host queued: ``collect`` reads them."""
        fed = []
        for seq, _ in choosing:  # a resumed token, already sent: the next step's input, nothing to report
            state = self._sequences[seq]
            state.decoding = True
            if state.forced:
                fed.append((state.slot, state.forced.pop()))
        fed_slots = {slot for slot, _ in fed}
        choosing = [(seq, row) for seq, row in choosing if self._sequences[seq].slot not in fed_slots]
        if choosing:
            every = len(choosing) == logits.shape[0]  # every row, in order (a decode step without a resumed token)
            rows = None if every else to_device([row for _, row in choosing], torch.long, self.device)
            chosen_logits = logits if rows is None else logits.index_select(0, rows)
            slots = [self._sequences[seq].slot for seq, _ in choosing]
            if graph_choice is not None and not masks:  # the step graph chose them (decode rows only)
                assert self.graphs is not None  # a graph's choice comes from one
                step_slots = self.graphs.inputs[2, :logits.shape[0]]  # on the device already: the step's input copy
                index = step_slots if rows is None else step_slots.index_select(0, rows)
                chosen = graph_choice if rows is None else graph_choice.index_select(1, rows)
            else:
                index = to_device(slots, torch.long, self.device)
                chosen = self.sampler.choice(slots, chosen_logits, [masks.get(seq) for seq, _ in choosing])
            self.sampler.commit(slots, index, chosen)
            self.next_ids.index_copy_(0, index, chosen[0])
            launched.choosing, launched.slots, launched.logits = [seq for seq, _ in choosing], slots, chosen_logits
            launched.tokens = HostCopy(chosen)
        for slot, token in fed:  # after the choice's write: the resumed token is the next input
            self.next_ids[slot] = token


@dataclass
class Launched:
    """A plan on its way (``TorchEngine.launch``): its result so far (starts' and chunks' errors,
    prompt outputs), and the rows that chose a token, their slots and logits, and the tokens' copy
    to the host (None: no row chose). ``logits`` stay valid until the next launch (a step graph's
    replay writes the same buffers): a row that reads them on the host (log-probabilities, kept
    logits) is collected before the next plan is launched."""

    result: StepResult
    choosing: list[SeqId] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    logits: torch.Tensor | None = None
    tokens: HostCopy | None = None


class StepGraphs:
    """The forward pass per bucket, captured by ``capture``: decode-only steps per batch bucket
    (``batches``: 1, 2, 4, ... ``max_rows``), and steps with prompt chunks per token bucket
    (``token_buckets``: 64, 128, ... up to ``prompt_tokens`` + ``max_rows``), whose logits are those of
    the first ``selects(bucket)`` entries of a select buffer. On CUDA a CUDA graph each, all in one
    memory pool; on the CPU the same forward on the same static buffers, run eagerly (what the tests
    exercise: the bucketing and the padding). Inputs are copied into the static buffers, in one copy,
    before a replay. Decode rows past the real ones are token 0 at position 0 of the spare slot;
    padding tokens of a prompt step have no slot (-1: they write and read nothing), and padding
    selections pick token 0. A batch-invariant forward keeps both out of the real tokens' bits."""

    def __init__(self, engine: TorchEngine, prompt_tokens: int):
        self.engine = engine
        self.batches = _buckets(1, engine.max_rows)
        self.token_buckets = _buckets(min(PROMPT_BUCKET, prompt_tokens), prompt_tokens + engine.max_rows)
        self.most_selected = 2 * engine.max_rows  # each decode row, and the last token of each chunk ending a prompt
        width = max(self.batches[-1], self.token_buckets[-1])
        # ids, positions, slots, select, and the decode rows' draws (float64 bits): one copy in a step
        self.inputs = torch.zeros(5, width, dtype=torch.long, device=engine.device)
        self.draws = self.inputs[4].view(torch.float64)
        # per batch bucket: steps whose rows are all greedy (no draw), and steps with sampled rows
        self.replays: dict[int, Callable[[], tuple[torch.Tensor, torch.Tensor]]] = {}
        self.sampled_replays: dict[int, Callable[[], tuple[torch.Tensor, torch.Tensor]]] = {}
        self.step_replays: dict[int, Callable[[], torch.Tensor]] = {}

    def covers(self, rows: int) -> bool:
        return bool(self.replays) and rows <= self.batches[-1]

    def covers_step(self, tokens: int, selected: int) -> bool:
        """Whether a step with prompt chunks of ``tokens`` tokens, ``selected`` of whose logits are
        wanted, has a graph."""
        if not self.step_replays or tokens > self.token_buckets[-1]:
            return False
        return selected <= self.selects(self._bucket(tokens))

    def selects(self, bucket: int) -> int:
        return min(bucket, self.most_selected)

    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle() if self.engine.device.type == "cuda" else None
        # the largest first: the pool is sized by it
        self.inputs[2].fill_(-1)
        for tokens in reversed(self.token_buckets):
            step = StepTokens(self.inputs[0, :tokens], self.inputs[1, :tokens], self.inputs[2, :tokens],
                              select=self.inputs[3, :self.selects(tokens)])
            forward = self._forward(step, from_slot=self.inputs[4, :tokens])
            self.step_replays[tokens] = self._cuda_graph(forward, pool) if pool is not None else self._eager(forward)
        self.inputs[2].fill_(self.engine.spare_slot)
        for rows in reversed(self.batches):
            step = StepTokens(self.inputs[0, :rows], self.inputs[1, :rows], self.inputs[2, :rows])
            for replays, draws in ((self.replays, None), (self.sampled_replays, self.draws[:rows])):
                choosing = self._forward_and_choice(step, draws)
                replays[rows] = self._cuda_graph(choosing, pool) if pool is not None else self._eager(choosing)
        log.info("captured %d decode steps (batch %s) and %d prompt steps (tokens %s)", len(self.replays),
                 self.batches, len(self.step_replays), self.token_buckets)

    def run(self, positions: list[int], slots: list[int], draws: np.ndarray | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode-only step (each row's input is its slot's next token, on the device): its rows'
        logits and the tokens and status words the graph chose for them ([2, rows],
        ``DeviceSampler.graph_choice``, with ``draws``: the rows' uniforms, None when every row is greedy)."""
        rows = len(slots)
        bucket = next(b for b in self.batches if b >= rows)
        packed = np.empty((5, bucket), dtype=np.int64)
        packed[[0, 3]] = 0
        packed[1, :rows], packed[2, :rows] = positions, slots
        packed[1:3, rows:] = [[0], [self.engine.spare_slot]]
        if draws is not None:
            packed[4, :rows], packed[4, rows:] = draws.view(np.int64), np.float64(0.5).view(np.int64)
        self._copy_in(packed if draws is not None else packed[:4])
        logits, chosen = (self.replays if draws is None else self.sampled_replays)[bucket]()
        return logits[:rows], chosen[:, :rows]

    def run_step(self, ids: list[int], positions: list[int], slots: list[int], select: list[int],
                 from_slot: list[int]) -> torch.Tensor:
        """A step with prompt chunks (``covers_step``): the logits of the ``select`` tokens; the tokens
        marked ``from_slot`` (decode rows) read their slot's next token on the device."""
        bucket = self._bucket(len(ids))
        pad = bucket - len(ids)
        self._copy_in([ids + [0] * pad, positions + [0] * pad, slots + [-1] * pad,
                       select + [0] * (bucket - len(select)), from_slot + [0] * pad])
        return self.step_replays[bucket]()[:len(select)]

    def _bucket(self, tokens: int) -> int:
        return next(b for b in self.token_buckets if b >= tokens)

    def _copy_in(self, rows: list[list[int]] | np.ndarray) -> None:
        host = torch.from_numpy(rows) if isinstance(rows, np.ndarray) else torch.tensor(rows, dtype=torch.long)
        if self.engine.device.type == "cuda":  # pragma: no cover - CUDA
            host = host.pin_memory()
        self.inputs[:len(rows), :host.shape[1]].copy_(host, non_blocking=True)

    def _forward(self, step: StepTokens, from_slot: torch.Tensor) -> Callable[[], torch.Tensor]:
        engine = self.engine

        def run() -> torch.Tensor:
            ids = engine.input_ids(step.ids, step.slots, from_slot)
            return engine.decoder.forward(replace(step, ids=ids), engine.cache)
        return run

    def _forward_and_choice(self, step: StepTokens,
                            draws: torch.Tensor | None) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        """A decode step's forward pass, each row's input its slot's next token, and its rows' choice
        of tokens, one graph: the host then waits once, for the tokens."""
        engine = self.engine

        def run() -> tuple[torch.Tensor, torch.Tensor]:
            ids = engine.next_ids.index_select(0, step.slots)
            logits = engine.decoder.forward(replace(step, ids=ids), engine.cache)
            return logits, engine.sampler.graph_choice(step.slots, logits, draws)
        return run

    @staticmethod
    def _eager(run: Callable[[], Any]) -> Callable[[], Any]:
        def replay() -> Any:
            with torch.inference_mode():
                return run()
        return replay

    @staticmethod
    def _cuda_graph(run: Callable[[], Any], pool: Any) -> Callable[[], Any]:  # pragma: no cover - CUDA
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.inference_mode():  # the first runs allocate outside the graph
            for _ in range(2):
                run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool), torch.inference_mode():
            outputs = run()

        def replay() -> Any:
            graph.replay()
            return outputs
        return replay


def _buckets(first: int, last: int) -> list[int]:
    """first, 2·first, 4·first, ... below ``last``, then ``last``."""
    sizes, size = [], first
    while size < last:
        sizes.append(size)
        size *= 2
    return sizes + [last]


# --- opening ---------------------------------------------------------------------------------------------------


def open_torch_engine(path: Path, shape: ModelShape, options: EngineOptions) -> TorchEngine:
    """The torch engine on a torch variant's weights file (the artifact's config.json beside it)."""
    device = _device(options.device)
    if device.type == "cpu" and options.threads:
        torch.set_num_threads(options.threads)
    config = load_config(path.parent)
    context = shape.max_context or int(getattr(config, "max_position_embeddings", 0) or 4096)
    kernels = Kernels(device, invariant=options.batch_invariant)
    length = -(-context // LENGTH_STEP) * LENGTH_STEP  # CPU: address space only
    decoder = TorchDecoder(path, config, device, kernels, length)
    c = decoder.config
    if device.type == "cuda":  # pragma: no cover - needs a CUDA device
        length = min(length, _gpu_length(device, options.max_rows + 1, c.kv_bytes_per_token * decoder.dtype.itemsize))
        if options.kv_tokens:  # the budget is slots × length here: allocate no more than it
            length = min(length, max(LENGTH_STEP, -(-options.kv_tokens // options.max_rows // LENGTH_STEP) * LENGTH_STEP))
        decoder.cos, decoder.sin = decoder.cos[:length], decoder.sin[:length]
    cache = KVCache(c.layers, options.max_rows + 1, c.kv_heads, length, c.head_dim, decoder.dtype, device)
    return TorchEngine(decoder, cache, options.max_rows, min(context, length), keep_logits=options.keep_logits)


def _device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type not in ("cpu", "cuda"):
        raise KilnError(f"the torch engine runs on cpu or cuda, not {name!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise KilnError("--device cuda: torch sees no CUDA device here")
    return device


def _gpu_length(device: torch.device, slots: int, bytes_per_token: int) -> int:  # pragma: no cover - CUDA
    """Positions per slot that the device's free memory holds, after the weights and a headroom."""
    free, _ = torch.cuda.mem_get_info(device)
    budget = max(0, free - GPU_HEADROOM) * GPU_MEMORY_SHARE
    length = int(budget // (slots * bytes_per_token)) // LENGTH_STEP * LENGTH_STEP
    if length < LENGTH_STEP:
        raise KilnError(f"the GPU's free memory ({free / 2**30:.1f} GiB) holds less than {LENGTH_STEP} tokens for each of "
                        f"{slots - 1} sequences: ask for fewer rows (--max-batch-size)")
    return length

