"""The seam between the engine core and an engine: the core's scheduler decides each step as a
``StepPlan`` (which sequences start, which prompt tokens to compute, which sequences decode, which
leave), an engine executes it and returns the tokens it chose (``StepResult``). Sampling happens
inside the engine, on its device; logits leave it only when asked (the gate's comparisons).

vLLM v1's shape: ``EngineCore.step()`` = ``schedule()`` → ``execute_model(plan)`` →
``update_from_output()``. Everything here is plain data, so an engine needs nothing of the core
and the core nothing of an engine's device."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from .sampling import SamplingParams

SeqId = Hashable
DEFAULT_MAX_RUNNING = 32  # sequences an engine runs together, unless told otherwise


@dataclass
class SeqStart:
    """A sequence new to the engine. ``restore``: prompt tokens the engine takes from its own
    prefix cache (``cached_prefix`` said how many); when that is the whole prompt, the engine
    chooses the first token from the logits it stored with it. ``generated``: answer tokens a
    resumed request had already produced: after the prompt, the engine feeds them through decode
    steps instead of choosing (reporting nothing for them), as the first run computed them, and
    chooses from the step after the last; the sampling counters (penalties, the random draw's
    position) start after them. ``prefill_generated`` (only for an engine whose capabilities say
    ``prefill_is_decode``): the core's chunks carry the prompt and every generated token but the
    last, so the engine feeds only the last one, as the next decode step's input."""

    seq: SeqId
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    restore: int = 0
    generated: list[int] = field(default_factory=list)
    prefill_generated: bool = False


@dataclass
class Chunk:
    """Prompt tokens ``start`` .. ``start + len(token_ids)`` of a sequence, to run through the
    model after the ``start`` tokens already in its cache. ``last``: the prompt ends here, so the
    engine chooses the first token from the last position and the sequence decodes from the next
    step on. ``targets``: for prompt log-probabilities, the token that follows each position (the
    last one's is unknown when ``last``). ``keep_logits``: return every position's logits."""

    seq: SeqId
    start: int
    token_ids: list[int]
    last: bool
    targets: list[int] | None = None
    keep_logits: bool = False


@dataclass
class StepPlan:
    """One engine call's work, in order: ``finished`` sequences leave first (their memory is free
    for what follows), ``starts`` are set up, ``chunks`` run, ``decode`` sequences each take one
    token (the one the engine chose for them last). ``masks()``, when set, returns the grammar
    bitmask of each sequence that chooses a token in this call (int32 words, bit set = allowed);
    the core computes them while the model runs, so the engine asks only after its forward pass.
    ``drafts`` (engines that say ``verifies_drafts``): tokens proposed to follow a decode row's
    token; the engine runs them in the same call at the positions that follow, chooses the token
    at each position as a decode step would (the row's chooser, token by token), keeps the drafted
    tokens while each equals the token chosen before it, and returns every token it chose: the
    accepted ones and the one after them, in order. Rows with drafts take no grammar mask."""

    finished: list[SeqId] = field(default_factory=list)
    starts: list[SeqStart] = field(default_factory=list)
    chunks: list[Chunk] = field(default_factory=list)
    decode: list[SeqId] = field(default_factory=list)
    drafts: dict[SeqId, list[int]] = field(default_factory=dict)
    masks: Callable[[], dict[SeqId, np.ndarray]] | None = None

    @property
    def empty(self) -> bool:
        return not (self.finished or self.starts or self.chunks or self.decode)


@dataclass
class Sampled:
    """A token the engine chose: for a chunk that ended its prompt, or a decode step (several for
    one sequence, in order, where its drafted tokens were accepted). ``logprob``
    and ``top_logprobs`` are the model's own (before temperature, penalties and masks), present
    when the request asked for them; ``logits`` when the engine was asked to keep them."""

    seq: SeqId
    token: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    logits: np.ndarray | None = None


@dataclass
class StepResult:
    sampled: list[Sampled] = field(default_factory=list)
    # per sequence whose chunk had ``targets``: (logprob of the target, its top alternatives) per position
    prompt_logprobs: dict[SeqId, list[tuple[float, list[tuple[int, float]]]]] = field(default_factory=dict)
    prompt_logits: dict[SeqId, np.ndarray] = field(default_factory=dict)  # chunks with ``keep_logits``
    errors: dict[SeqId, Exception] = field(default_factory=dict)  # a sequence whose own settings failed: it alone ends


@dataclass(frozen=True)
class EngineCapabilities:
    """What the core and the server may count on. ``mixed_steps``: prompt chunks and decode rows
    can share one call (else the core plans them as two calls, and hands out first tokens between);
    ``prefix_cache``: ``cached_prefix`` can answer more than 0; ``max_rows``: sequences decoding
    together at most; ``device``: where it computes ("cpu", "cuda"); ``prefill_chunk``: the prompt
    tokens per step it is built for, when not the core's default (a GPU step costs about the same
    for 128 tokens as for thousands); ``prefill_is_decode``: a position's logits are the same bits
    whether it is computed in a decode step or in a prompt chunk of any length (the serving graph
    with KilnAttention), so a resumed request's sent tokens may be prefilled in chunks
    (``SeqStart.prefill_generated``); ``verifies_drafts``: a decode row may carry drafted tokens
    (``StepPlan.drafts``); ``overlaps``: it is an ``OverlappingEngine`` (a plan may be launched before
    the one before it is collected)."""

    device: str = "cpu"
    max_rows: int = DEFAULT_MAX_RUNNING
    mixed_steps: bool = False
    prefix_cache: bool = False
    prefill_chunk: int | None = None
    prefill_is_decode: bool = False
    verifies_drafts: bool = False
    overlaps: bool = False


@dataclass(frozen=True)
class EngineOptions:
    """How to run an engine. ``prefix_cache_tokens``: the most prompt-prefix KV kept for the prompts
    that follow (0: none); ``keep_logits``: every chosen token comes with its row of logits;
    ``batch_invariant``: the torch engine's kernels give a row the same bits whatever else runs
    (engines/torch/ops.py; the ONNX engines are batch-invariant by construction); ``kv_tokens``: the KV
    budget the core will keep to (an engine that allocates its cache up front allocates no more;
    None: what the device holds)."""

    threads: int | None = None
    device: str = "cpu"
    max_rows: int = DEFAULT_MAX_RUNNING
    prefix_cache_tokens: int = 0
    keep_logits: bool = False
    memory_arena: bool = True
    batch_invariant: bool = True
    kv_tokens: int | None = None


@dataclass(frozen=True)
class ModelShape:
    """What an engine needs of the model beyond its files (kiln.json's generation section)."""

    heads: int
    max_context: int | None


class Engine(Protocol):
    """A decoder engine behind the core (``engines/onnx/serving.py``, ``engines/onnx/padded.py``,
    ``engines/torch/engine.py``)."""

    capabilities: EngineCapabilities

    @property
    def max_context(self) -> int | None: ...  # the longest sequence it runs (None: no limit known)
    def execute(self, plan: StepPlan) -> StepResult: ...
    def cached_prefix(self, prompt_ids: Sequence[int]) -> int: ...  # prompt tokens its prefix cache can restore
    def use_prefix_cache(self, tokens: int) -> None: ...  # keep at most this many tokens of prefixes (0: none)
    def evict_prefixes(self, tokens: int) -> int: ...
    @property
    def prefix_tokens(self) -> int: ...  # tokens its prefix cache holds (they count in the KV budget)
    @property
    def cache_tokens(self) -> int: ...  # tokens its caches hold now (for the KV-usage metric)
    def kv_tokens_needed(self, reserves: Sequence[int]) -> int: ...  # cache tokens for sequences reaching ``reserves``
    def kv_capacity(self) -> int: ...  # tokens of KV its device can hold
    def warm_up(self) -> None: ...  # the first requests should not pay for the first runs
    def __contains__(self, seq: SeqId) -> bool: ...


class Launched(Protocol):
    """A plan an ``OverlappingEngine`` has queued on its device."""


class OverlappingEngine(Engine, Protocol):
    """An engine that queues a plan's work on its device and returns (``launch``), and waits for its
    result when asked (``collect``), so the core plans and launches the next step while the device
    runs this one. A decode row of a plan launched before the last one was collected feeds the token
    the last one chose, which the engine keeps on its device; a sequence leaves only after every
    plan with it was collected. ``execute`` is ``collect(launch(plan))``."""

    def launch(self, plan: StepPlan) -> Launched: ...
    def collect(self, launched: Launched) -> StepResult: ...


def begin_step(plan: StepPlan, leave: Callable[[SeqId], None], start: Callable[[SeqStart], None]) -> StepResult:
    """What every engine's ``execute`` does first: the finished sequences leave, then the new ones start;
    one that cannot start (its own request: too long, no free slot, a seed numpy refuses) ends alone,
    its error in the step's result."""
    for seq in plan.finished:
        leave(seq)
    result = StepResult()
    for new in plan.starts:
        try:
            start(new)
        except Exception as exc:  # noqa: BLE001 - the request's own fault: it alone ends
            result.errors[new.seq] = exc
    return result
