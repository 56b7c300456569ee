"""The engine over the serving graph (convert/generation/serving_graph.py): prefill into a staging row, join
the decode batch, decode steps, leave. ``execute`` (engines/onnx/base.py, shared with the export graph's
engine) runs the core's plans with these primitives and chooses tokens on the host.

Why a sequence's answer does not depend on its batch
    GroupQueryAttention computes each (row, head) over that row's own length, single-threaded per
    unit, whatever else is in the call (checked bit for bit: docs/generation-internals.md); every
    other node works row by row. The one exception is a kernel's shape-dependent path: some
    machines' int4/int8 MatMulNBits round a tile of one row (M = 1, or the last row when
    M % 128 == 1) differently from the same row among others. ``load`` asks the decode graph
    itself whether a lone row decodes bit-identically to the same row among others on this
    machine; where it does not, the step gets a ghost row (a throw-away row with no past) whenever
    the batch would make such a tile.

    A graph built with KilnAttention (``io.POSITIONS`` among its inputs: GGUF variants with kiln's
    native operators) goes further, and has an engine of its own (``kiln_attention.py``): one call a
    step, one cache region of slots."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from ....errors import InvalidInputError, KilnError
from . import graph_io as io
from .base import HostEngine
from ..memory import host_kv_capacity
from .kv_cache import CacheShape, RowRegion, whole_blocks
from ...plan import EngineCapabilities, SeqId
from ...prefix_cache import PrefixCache

TILE_ROWS = 128  # MatMulNBits' row tile: a tile holding one row takes its lone-row path


@dataclass
class _Staged:
    row: int  # staging row
    length: int  # tokens in its cache


class ServingEngine(HostEngine):
    kiln_attention = False  # the graph's attention: GroupQueryAttention here, KilnAttention in the subclass

    def __init__(self, session: ort.InferenceSession, heads: int, threads: int, max_context: int | None,
                 max_rows: int = 32, staging_rows: int | None = None, max_length: int | None = None,
                 prefix_cache_tokens: int = 0, keep_logits: bool = False):
        super().__init__()
        inputs = {i.name: i for i in session.get_inputs()}
        # KilnAttention's graph takes each token's row and position; GroupQueryAttention's per-row lengths
        places = (io.CACHE_ROWS, io.POSITIONS) if self.kiln_attention else (io.SEQLENS_K, io.TOTAL_SEQUENCE_LENGTH)
        for required in (io.INPUT_IDS, *places, io.LOGIT_POSITIONS, io.past_key_name(0)):
            if required not in inputs:
                raise KilnError(f"not a serving decoder graph (no input '{required}')")
        self.session = session
        self.layers = sum(1 for n in inputs if n.startswith("past_key_values.") and n.endswith(".key"))
        _, kv_heads, _, head_dim = inputs[io.past_key_name(0)].shape
        self.max_context = max_context
        length = int(max_length or max_context or 4096)
        # a KilnAttention graph written with key_blocks reads its keys in blocks of 16 positions
        metadata = session.get_modelmeta().custom_metadata_map
        key_blocks = self.kiln_attention and metadata.get(io.KEY_CACHE_KEY) == io.KEY_BLOCKS
        if key_blocks:  # whole blocks (the model's context still bounds a sequence: _check_length)
            length = whole_blocks(length)
        halves = inputs[io.past_key_name(0)].type == "tensor(float16)"  # KilnAttentionF16's caches
        self.shape = CacheShape(self.layers, int(kv_heads), int(head_dim), length, key_blocks, halves)
        # rows × heads units share the threads of GroupQueryAttention; with fewer units than threads a
        # newer onnxruntime splits one row's keys across threads (another summation order): keep enough
        # rows. KilnAttention never splits a query's keys.
        self.min_rows = 1 if self.kiln_attention else -(-threads // heads)
        self.max_rows = max_rows
        # as many staging rows as decode rows: a burst of new prompts prefills in one call (address space only)
        self._allocate(staging_rows or max_rows)
        self.rows: list[SeqId] = []
        self._lengths = np.zeros(0, dtype=np.int32)
        self._staged: dict[SeqId, _Staged] = {}
        self._binding: tuple[int, ort.IOBinding] | None = None  # (rows bound, binding)
        self._past_names = [n for i in range(self.layers) for n in (io.past_key_name(i), io.past_value_name(i))]
        self._present_names = [n for i in range(self.layers) for n in (io.present_key_name(i), io.present_value_name(i))]
        self._row_positions = np.arange(self.running.rows, dtype=np.int64)  # a decode step: each row's one token
        self.keep_logits = keep_logits
        self.use_prefix_cache(prefix_cache_tokens)
        self.ghost_rows = False
        self.ghost_rows = self._lone_row_differs()

    def _allocate(self, staging_rows: int) -> None:
        self.running = RowRegion(self.shape, self.max_rows + self.min_rows + 1)  # room for ghost rows
        self.staging = RowRegion(self.shape, staging_rows)
        self._free_staging = list(range(staging_rows))

    def _capabilities(self, prefix_cache: bool) -> EngineCapabilities:
        return EngineCapabilities("cpu", self.max_rows, mixed_steps=False, prefix_cache=prefix_cache)

    # -- queries ---------------------------------------------------------------------------
    @property
    def cache_tokens(self) -> int:
        """Tokens the caches hold now (running, staged and the prefix cache): what RAM they take, in tokens."""
        return int(self._lengths.sum()) + sum(s.length for s in self._staged.values()) + self.prefix_tokens

    @property
    def prefix_tokens(self) -> int:
        return self.prefixes.tokens if self.prefixes else 0

    @staticmethod
    def kv_tokens_needed(reserves: Sequence[int]) -> int:
        """Cache tokens (RAM) for sequences that may reach ``reserves`` tokens: each its own."""
        return sum(reserves)

    def kv_capacity(self) -> int:
        """Tokens of KV the host's memory holds by the default share, at most every row full."""
        return host_kv_capacity(self.shape.bytes_per_token, self.max_rows * self.shape.max_length)

    def _joining(self) -> dict[SeqId, _Staged]:
        return self._staged

    def _row_lengths(self) -> np.ndarray:
        return self._lengths

    # -- the prefix cache ---------------------------------------------------------------------
    def use_prefix_cache(self, tokens: int) -> None:
        """Keep at most ``tokens`` tokens of prompt prefixes (0: none); what was cached is dropped."""
        self.prefixes = PrefixCache(tokens) if tokens > 0 else None
        self.capabilities = self._capabilities(tokens > 0)

    def cached_prefix(self, prompt_ids: Sequence[int]) -> int:
        """How many of the prompt's tokens the prefix cache holds (counted in its hit statistics)."""
        return self.prefixes.cached_tokens(prompt_ids) if self.prefixes else 0

    def restore_prefix(self, seq_id: SeqId, prompt_ids: Sequence[int], tokens: int) -> np.ndarray | None:
        """Start a new sequence with its prompt's first ``tokens`` from the prefix cache (what
        ``cached_prefix`` said); the stored first-token logits when that is the whole prompt."""
        if self.prefixes is None:
            raise KilnError("this engine has no prefix cache")
        blocks, whole = self.prefixes.restore(prompt_ids, tokens)
        size = self.prefixes.block_tokens
        staged = self._stage(seq_id)
        for b, block in enumerate(blocks):
            self.staging.write(staged.row, b * size, block.kv)
        if whole is not None:
            self.staging.write(staged.row, len(blocks) * size, whole.tail_kv)
        staged.length = tokens
        return whole.logits if whole is not None else None

    def remember_prefix(self, seq_id: SeqId, prompt_ids: Sequence[int], last_logits: np.ndarray) -> None:
        """Cache a prefilled prompt (its staged KV, and its last logits) for the prompts that follow."""
        staged = self._staged.get(seq_id)
        if self.prefixes is None or staged is None or staged.length < len(prompt_ids):
            return
        row = staged.row
        self.prefixes.insert(prompt_ids, lambda start, stop: self.staging.read(row, start, stop), last_logits)

    # -- prefill ---------------------------------------------------------------------------

    def evict_prefixes(self, tokens: int) -> int:
        return self.prefixes.evict(tokens) if self.prefixes else 0

    def prefill(self, seq_id: SeqId, token_ids: Sequence[int], all_logits: bool = False) -> np.ndarray:
        self._check_prefill(seq_id, token_ids)
        staged = self._stage(seq_id)
        n = len(token_ids)
        total = staged.length + n
        self._check_length(total)
        ids = list(token_ids)
        lone_tile = self.ghost_rows and n % TILE_ROWS == 1
        gqa_one_query = n == 1 and staged.length > 0
        if (lone_tile or gqa_one_query) and total < self.shape.max_length:
            # One more token after the chunk (causal: it changes nothing before it; its key and value
            # are overwritten by the next real token) where the chunk alone would take another
            # kernel path than the same tokens inside a longer chunk: a lone row in a 128-row
            # MatMulNBits tile (some machines), or GroupQueryAttention's one-query path, which sums
            # in another order than its prompt path (measured: a prompt's last token prefilled
            # alone after the rest moved SmolLM2's fp32 logits by 2e-5, int4's by 0.5).
            ids.append(ids[-1])
        binding = self._binding_of(self.staging.views(staged.row, staged.row + 1))
        positions = np.arange(n, dtype=np.int64) if all_logits else np.asarray([n - 1], dtype=np.int64)
        logits = self._run(binding, np.asarray([ids], dtype=np.int64), np.asarray([staged.length]),
                           np.asarray([len(ids)]), positions)
        staged.length = total
        return logits if all_logits else logits[-1]

    def prefill_first(self, prompts: Sequence[tuple[SeqId, Sequence[int]]]) -> list[np.ndarray]:
        """The first chunk of several new sequences in one call (right-padded to the longest: each
        row attends over its own length, so a row gets what it would alone, bit for bit). Returns
        each one's last-position logits. GroupQueryAttention takes several rows of more than one
        token only when none has a past: later chunks go one sequence at a time (``prefill``)."""
        if len(prompts) == 1:
            seq_id, token_ids = prompts[0]
            return [self.prefill(seq_id, token_ids)]
        if any(seq_id in self for seq_id, _ in prompts) or any(not ids for _, ids in prompts):
            raise InvalidInputError("prefill_first takes new sequences with at least one token each")
        lengths = [len(ids) for _, ids in prompts]
        width = max(lengths)
        for length in lengths:
            self._check_length(length)
        if self.ghost_rows and (len(prompts) * width) % TILE_ROWS == 1:
            width += 1  # no lone row in the last tile (see ``prefill``)
        first = self._take_staging_rows(len(prompts))
        ids = np.zeros((len(prompts), width), dtype=np.int64)
        for row, (_, tokens) in enumerate(prompts):
            ids[row, :len(tokens)] = tokens
        positions = np.asarray([row * width + length - 1 for row, length in enumerate(lengths)], dtype=np.int64)
        binding = self._binding_of(self.staging.views(first, first + len(prompts)))
        logits = self._run(binding, ids, np.zeros(len(prompts), dtype=np.int64), np.asarray(lengths), positions)
        for row, ((seq_id, _), length) in enumerate(zip(prompts, lengths)):
            self._staged[seq_id] = _Staged(first + row, length)
        return list(logits)

    def truncate(self, seq_id: SeqId, tokens: int) -> None:
        """Keep the first ``tokens`` positions of a sequence being prefilled (a draft model's slot,
        whose refused drafts are rolled back): the keys and values after them are never read (both
        attentions read a row up to its length) and the next chunk writes over them."""
        staged = self._staged.get(seq_id)
        if staged is None:
            raise InvalidInputError(f"sequence {seq_id!r} is not being prefilled")
        if not 0 <= tokens <= staged.length:
            raise InvalidInputError(f"cannot keep {tokens} of sequence {seq_id!r}'s {staged.length} tokens")
        staged.length = tokens

    def _stage(self, seq_id: SeqId) -> _Staged:
        staged = self._staged.get(seq_id)
        if staged is None:
            staged = _Staged(self._take_staging_rows(1), 0)
            self._staged[seq_id] = staged
        return staged

    def _take_staging_rows(self, count: int) -> int:
        """``count`` free staging rows side by side (one binding covers them); the first one's index."""
        free = sorted(self._free_staging)
        for i in range(len(free) - count + 1):
            if free[i + count - 1] - free[i] == count - 1:
                for row in free[i:i + count]:
                    self._free_staging.remove(row)
                return free[i]
        raise KilnError(f"no {count} free staging rows side by side ({len(free)} of {self.staging.rows} free)")

    def join(self, seq_id: SeqId) -> None:
        """Move a prefilled sequence into the decode batch (it takes part in the next step)."""
        staged = self._staged.pop(seq_id)
        if len(self.rows) >= self.max_rows:
            self._staged[seq_id] = staged
            raise KilnError(f"the decode batch is full ({self.max_rows} rows)")
        row = len(self.rows)
        self.running.copy_row(self.staging, staged.row, row, staged.length)
        self._free_staging_row(staged.row)
        self.rows.append(seq_id)
        self._lengths = np.append(self._lengths, np.int32(staged.length))

    def add(self, seq_id: SeqId, prompt_ids: Sequence[int]) -> np.ndarray:
        """Prefill a whole prompt and join: returns the logits for the first new token (tests)."""
        logits = self.prefill(seq_id, prompt_ids)
        self.join(seq_id)
        return logits

    # -- decode ----------------------------------------------------------------------------
    def step(self, next_tokens: Mapping[SeqId, int]) -> np.ndarray:
        """Feed each running sequence its next token; return logits [rows, vocab] in ``rows`` order."""
        if len(next_tokens) != len(self.rows) or any(s not in next_tokens for s in self.rows):
            raise InvalidInputError(f"step needs one token for each running sequence {self.rows}, got {list(next_tokens)}")
        n = len(self.rows)
        if not n:
            return np.zeros((0, 0), dtype=np.float32)
        self._check_length(int(self._lengths.max()) + 1)
        bound = self._rows_to_bind(n)
        ids = np.empty((bound, 1), dtype=np.int64)
        ids[:n, 0] = [next_tokens[s] for s in self.rows]
        past = np.zeros(bound, dtype=np.int64)  # ghost rows: no past, their one token at position 0
        past[:n] = self._lengths
        ids[n:, 0] = ids[0, 0]
        logits = self._run(self._decode_binding(bound), ids, past, np.ones(bound, dtype=np.int64),
                           self._row_positions[:bound])
        self._lengths += 1
        return logits[:n]

    def _rows_to_bind(self, n: int) -> int:
        bound = max(n, self.min_rows)
        if self.ghost_rows and bound % TILE_ROWS == 1:
            bound += 1
        return bound

    # -- leaving ---------------------------------------------------------------------------
    def remove(self, seq_id: SeqId) -> None:
        """Drop a sequence (running or staged) and give its cache's memory back."""
        staged = self._staged.pop(seq_id, None)
        if staged is not None:
            self._free_staging_row(staged.row)
            return
        row, last = self.rows.index(seq_id), len(self.rows) - 1
        if row != last:  # the batch stays rows 0..n-1: the last row fills the hole
            self.running.copy_row(self.running, last, row, int(self._lengths[last]))
            self.rows[row] = self.rows[last]
            self._lengths[row] = self._lengths[last]
        self.rows.pop()
        self._lengths = self._lengths[:-1].copy()
        self.running.release(last)

    # -- helpers ---------------------------------------------------------------------------
    def _free_staging_row(self, row: int) -> None:
        self.staging.release(row)
        self._free_staging.append(row)

    def _check_length(self, tokens: int) -> None:
        if self.max_context is not None and tokens > self.max_context:
            raise InvalidInputError(f"{tokens} tokens exceed the model's context of {self.max_context}")
        if tokens > self.shape.max_length:
            raise InvalidInputError(f"{tokens} tokens exceed the engine's {self.shape.max_length}-token rows")

    def _decode_binding(self, rows: int) -> ort.IOBinding:
        """The binding of running rows 0..rows-1, made again only when the batch size changes."""
        if self._binding is None or self._binding[0] != rows:
            self._binding = (rows, self._binding_of(self.running.views(0, rows)))
        return self._binding[1]

    def _binding_of(self, views: list[np.ndarray]) -> ort.IOBinding:
        """Each cache view bound as both past and present (GroupQueryAttention then writes in place);
        logits bound first, so they are output 0."""
        binding = self.session.io_binding()
        binding.bind_output(io.LOGITS)
        for name, present, view in zip(self._past_names, self._present_names, views):
            value = ort.OrtValue.ortvalue_from_numpy(view)
            binding.bind_ortvalue_input(name, value)
            binding.bind_ortvalue_output(present, value)
        return binding

    def _run(self, binding: ort.IOBinding, ids: np.ndarray, past: np.ndarray, new: np.ndarray,
             positions: np.ndarray) -> np.ndarray:
        """Run ``ids`` [rows, width]: row r of the bound cache holds ``past[r]`` tokens and gets
        ``new[r]`` more (the rest of its width is padding); logits at ``positions``."""
        # bind_cpu_input keeps a pointer, not the array: every array bound must outlive the run
        binding.bind_cpu_input(io.INPUT_IDS, ids)
        # GroupQueryAttention: each row's length after the call, less one, and the longest
        seqlens = (past + new - 1).astype(np.int32)
        total_length = np.asarray(int(past.max()) + ids.shape[1], dtype=np.int32)
        binding.bind_cpu_input(io.SEQLENS_K, seqlens)
        binding.bind_cpu_input(io.TOTAL_SEQUENCE_LENGTH, total_length)
        binding.bind_cpu_input(io.LOGIT_POSITIONS, positions)
        self.session.run_with_iobinding(binding)
        return binding.get_outputs()[0].numpy()

    def _lone_row_differs(self) -> bool:
        """Whether a row decoded alone (and, where the batch can reach it, last of 129) gets other
        logits than the same row among others, on this machine. Every row holds the same token with
        no past, so only the kernels' shape-dependent paths can tell the rows apart."""
        probes = [(1, 2)] + ([(TILE_ROWS + 1, TILE_ROWS + 2)] if self.max_rows > TILE_ROWS else [])
        for alone, among in probes:
            tokens = np.full(among, 1, dtype=np.int64)
            if not np.array_equal(self._probe(tokens[:alone])[alone - 1], self._probe(tokens)[alone - 1]):
                return True
        return False

    def _probe(self, tokens: np.ndarray) -> np.ndarray:
        rows = len(tokens)
        binding = self._decode_binding(rows)
        logits = self._run(binding, tokens[:, None], np.zeros(rows, dtype=np.int64), np.ones(rows, dtype=np.int64),
                           self._row_positions[:rows])
        for row in range(rows):
            self.running.release(row)
        return logits.copy()
