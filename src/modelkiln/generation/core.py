"""The engine core: one object that owns a decoder engine and every request on it, and advances
them all by one ``step()``. It has no threads and no asyncio; ``kiln generate``, ``kiln eval``,
the gate, ``kiln bench`` (``run_to_completion``), ``kiln serve`` and the Triton model (each
through ``driver.CoreDriver``) drive the same core, so they schedule alike.

One ``step()`` schedules, executes and updates (vLLM v1's ``schedule()`` → ``execute_model()`` →
``update_from_output()``):
1. take what arrived (``add_request``, ``abort``: safe from any thread, under a lock);
2. drop what was aborted (a client left) or ran out of time: the next plan tells the engine to free
   its cache before anything runs, so a disconnect costs at most the call already running;
3. admit waiting requests, oldest first, while a row is free (``max_running``) and the KV cache
   holds every admitted sequence up to its last possible token (``kv_budget``, counted the way the
   engine lays its cache out: ``engine.kv_tokens_needed``); ask the engine's prefix cache how much
   of each new prompt it holds;
4. plan prompt chunks of at most ``prefill_chunk`` tokens, at most ``prefill_chunk`` tokens per
   step in all (at least one chunk), one chunk per prompt per step, so a long prompt costs running
   streams one chunk's time per step instead of its whole prefill; a prompt's last chunk gives its
   first token and the sequence decodes from the next step on;
5. one decode step for every running sequence; with speculation (``speculation/``), a sequence may
   carry drafted tokens the engine verifies in the same call, and get several tokens from it.
The engine (``plan.Engine``) executes each plan and returns the tokens it chose; the core turns them
into text (``sequence.SequenceState``), applies stop rules and grammars, and reports.

**Overlapped steps** (``overlap``, engines that say ``overlaps``: the torch engine on a GPU; vLLM v1's
async scheduling, SGLang's overlap scheduler): the core launches step N+1 before it collects step N,
so the host's planning, detokenizing and delivering run while the device computes. Step N+1 is planned
from what was known before N's tokens: a sequence whose prompt ends in N decodes in N+1 (its first
token is its input there, on the device); a sequence that N ends (a stop, an end of sequence, an
error) already has a row in N+1, whose token is dropped, and it leaves the engine with the first plan
launched after N+1 is collected, N+3 (its row and KV count as taken until then); no sequence is planned past
its ``max_new_tokens``. A sequence whose next step needs the host's view of the last one (a
grammar's mask, log-probabilities, prompt scores) makes the steps around it synchronous. Nothing a
sequence computes depends on this: its tokens are the same either way.

Chunk boundaries are fixed (tokens 0-127, 128-255, ...) whatever the load, so a prompt's cache is
computed the same way alone and under load: an answer does not depend on what else runs (with the
serving graph, bit for bit; the gate checks it through this same code)."""

from __future__ import annotations

import secrets
import threading
import time
from collections import deque
from collections.abc import Hashable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from ..errors import InvalidInputError, KilnError, OverloadedError, RequestTimeoutError
from .plan import DEFAULT_MAX_RUNNING, Chunk, Engine, Launched, OverlappingEngine, Sampled, SeqStart, StepPlan, StepResult
from .sampling import SamplingParams
from .sequence import Delta, SequenceState
from .speculation import MAX_ROWS as SPECULATE_MAX_ROWS, DRAFT_MODEL, CallCosts, DraftModel, SpeculationOptions, Speculator

DEFAULT_PREFILL_CHUNK = 128  # prompt tokens per step: a running stream's gap grows by one chunk's time
DEFAULT_MAX_WAITING = 1024  # requests waiting for a row before new ones are refused at once
DEFAULT_TIMEOUT_S = 600.0  # a request's time, waiting and generating
OVERLAP_MASKS_S = 0.001  # grammar masks costlier than this (a step's, all rows) are computed while the model runs


@dataclass(eq=False)
class Request:
    """One generation request. ``reserve``: the KV tokens it may reach (prompt + max new tokens,
    within the context); ``deadline``: ``time.monotonic()`` after which it ends with a timeout.
    ``resume_ids``: answer tokens an earlier run of this request already sent (a stream moved to
    another replica). Where the engine computes a position the same bits in a prompt chunk as in a
    decode step (``prefill_is_decode``: KilnAttention's serving graph), they are prefilled in chunks
    after the prompt, all but the last, which is the next decode step's input; elsewhere the engine
    feeds them through decode steps, one a step, instead of choosing (the earlier run computed them
    so; GroupQueryAttention's prefill of them gives other numbers, on SmolLM2's int4 variant 0.5 to
    0.9 in the logits: other tokens). Either way they count toward ``max_new_tokens`` and the
    penalties, and the random draws go on from their positions, so the rest of the answer is what
    the earlier run would have produced, bit for bit. ``seed``: the one the draws use (the
    request's, or one chosen at ``add_request``: reported, so a client can resume a sampled answer
    too).
    ``score``: keep every prompt position's logits (``Output.request.prompt_logits``)."""

    request_id: Hashable
    prompt_ids: list[int]
    params: SamplingParams
    deadline: float = float("inf")
    arrived: float = field(default_factory=time.monotonic)
    reserve: int = 0
    resume_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    score: bool = False
    # the core's bookkeeping
    state: SequenceState | None = None
    prefilled: int = 0  # tokens of ``prefill_ids`` in the engine's cache so far
    prefill_ids: list[int] = field(default_factory=list)  # the prompt, and the resumed tokens prefilled after it
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    prompt_logprobs: list = field(default_factory=list)
    prompt_logits: list = field(default_factory=list)
    speculator: Speculator | None = None  # with speculation, where its answers may be drafted for


@dataclass(slots=True)
class Output:
    """What one step produced for one request: a token (``delta``; the last one has a
    ``finish_reason``) or an ``error`` that ends it. ``logits``: the row the token was chosen
    from, kept only when the engine was made with ``keep_logits`` (the gate compares them)."""

    request: Request
    delta: Delta | None = None
    error: KilnError | None = None
    logits: np.ndarray | None = None

    @property
    def request_id(self) -> Hashable:
        return self.request.request_id

    @property
    def finished(self) -> bool:
        return self.error is not None or (self.delta is not None and self.delta.finish_reason is not None)


class CoreHooks:
    """What the core reports as it goes (serve's metrics); the default reports nothing."""

    def token(self, request: Request, now: float) -> None: ...  # a token chosen (first: TTFT, else ITL)
    def prefix(self, request: Request, cached_tokens: int) -> None: ...  # its prefill starts after this many cached tokens
    def finished(self, request: Request, now: float) -> None: ...  # ended normally
    def iteration(self, running: int, waiting: int, cache_tokens: int) -> None: ...
    def speculated(self, request: Request, drafted: int, accepted: int) -> None: ...  # a verify call's drafts


class EngineCore:
    def __init__(self, engine: Engine, tokenizer: Tokenizer, eos_ids: Iterable[int] = (), *,
                 max_running: int = DEFAULT_MAX_RUNNING, max_waiting: int | None = None,
                 kv_budget: int | None = None, prefill_chunk: int | None = None,
                 hooks: CoreHooks | None = None, speculation: SpeculationOptions = SpeculationOptions(),
                 draft_model: DraftModel | None = None, overlap: bool = False):
        self.engine = engine
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(eos_ids)
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.kv_budget = kv_budget
        # None: what the engine is built for, else the CPU's default
        self.prefill_chunk = prefill_chunk or engine.capabilities.prefill_chunk or DEFAULT_PREFILL_CHUNK
        self.hooks = hooks or CoreHooks()
        # speculation where the engine verifies drafts (else plain decoding: answers are the same)
        self.speculation = speculation if engine.capabilities.verifies_drafts else SpeculationOptions()
        self.draft_model = draft_model  # the draft model's engine (speculation's method draft-model)
        if self.speculation.method == DRAFT_MODEL and draft_model is None:
            raise ValueError("--speculate draft-model needs the draft model's engine (TextGenerationModel.core opens it)")
        self._call_costs = CallCosts()  # decode calls' seconds by the tokens they feed, while speculating
        self._lock = threading.Lock()  # guards the inbox: add_request and abort come from other threads
        self._arrived: deque[Request] = deque()
        self._aborted: set[Hashable] = set()
        self._waiting: deque[Request] = deque()
        self._prefilling: list[Request] = []  # admitted, prompt not all in the cache yet
        self._running: dict[Hashable, Request] = {}  # decoding
        self._leaving: list[Hashable] = []  # sequences the engine still holds and must free at its next call
        self._masker: ThreadPoolExecutor | None = None  # grammar masks, computed while the model runs
        self._mask_seconds = 0.0  # what the last step's masks took
        # overlapped steps: where the engine can, and not while speculating (drafts need the last tokens)
        self.overlap = overlap and engine.capabilities.overlaps and not self.speculation.on
        self._in_flight: _InFlight | None = None  # the step launched and not yet collected
        self._host_bound: set[Hashable] = set()  # active requests whose steps are synchronous (_needs_host)
        self._last_token: set[Hashable] = set()  # active requests with one token left at most

    # -- from any thread ---------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request; refused at once when it could never fit or the queue is full."""
        if not request.reserve:
            request.reserve = len(request.prompt_ids) + request.params.max_new_tokens
            if self.engine.max_context:
                request.reserve = min(request.reserve, self.engine.max_context)
        if self.kv_budget is not None and self.engine.kv_tokens_needed([request.reserve]) > self.kv_budget:
            raise InvalidInputError(f"prompt + max_tokens = {request.reserve} tokens exceed the server's KV cache of "
                                    f"{self.kv_budget} tokens (--max-kv-tokens): ask for fewer tokens")
        if request.seed is None:
            request.seed = request.params.seed if request.params.seed is not None else secrets.randbits(63)
        with self._lock:
            if self.max_waiting is not None and len(self._arrived) + len(self._waiting) >= self.max_waiting:
                raise OverloadedError(f"{len(self._arrived) + len(self._waiting)} generation requests waiting; retry later")
            self._arrived.append(request)

    def abort(self, request_id: Hashable) -> None:
        """The request's client is gone: free its sequence before the next engine call."""
        with self._lock:
            self._aborted.add(request_id)

    def has_work(self) -> bool:
        return bool(self._arrived or self._aborted or self._waiting or self._prefilling or self._running
                    or self._in_flight)

    @property
    def waiting(self) -> int:
        return len(self._arrived) + len(self._waiting)

    @property
    def running(self) -> int:
        """Admitted requests: decoding, or with their prompt being prefilled."""
        return len(self._running) + len(self._prefilling)

    @property
    def decoding(self) -> int:
        """Requests in the engine's decode batch."""
        return len(self._running)

    # -- the step -------------------------------------------------------------------------------------
    def step(self) -> list[Output]:
        """One iteration: drop, admit, prefill, decode; every output it produced."""
        return [output for part in self.step_parts() for output in part]

    def step_parts(self) -> Iterator[list[Output]]:
        """One iteration in two parts: the outputs of dropping, admitting and prefilling (first tokens),
        then those of the decode step. A caller that delivers the first part before asking for the
        second sends a new request its first token a decode step earlier (a whole step of every running
        sequence: 9 ms alone, 45 ms among 16 on SmolLM2). Ask for both parts: the decode runs only then.
        An engine that runs chunks and decode rows in one call (``mixed_steps``) gets one plan, and both
        parts come after it. Overlapped (``overlap``): one part, after the next step is launched."""
        if self.overlap:
            yield self._overlapped_step()
            return
        outputs: list[Output] = []
        with self._lock:
            self._waiting.extend(self._arrived)
            self._arrived.clear()
            aborted, self._aborted = self._aborted, set()
        mixed = self.engine.capabilities.mixed_steps
        try:
            self._drop(aborted, outputs)
            plan = self._plan_prompts(outputs)
            chunked = [r for r in self._prefilling if r.request_id in _chunked(plan)]
            if mixed:  # the rows running before this step decode in the same call, with their drafts
                decoding = list(self._running.values())
                plan.decode = [r.request_id for r in decoding]
                plan.drafts = self._drafts(decoding)
                self._execute(plan, chunked + decoding, outputs)
            elif not plan.empty:
                self._execute(plan, chunked, outputs)
        except Exception as exc:  # a bug or an engine failure: fail what is active, keep going
            self._fail_active(exc, outputs)
        yield outputs
        outputs = []
        try:
            decoding = [] if mixed else list(self._running.values())  # those that just joined too
            if decoding:
                plan = StepPlan(decode=[r.request_id for r in decoding], drafts=self._drafts(decoding))
                self._execute(plan, decoding, outputs)
            if self._leaving:  # finished ones give their memory back now, not when the next request comes
                self._free_leaving()
        except Exception as exc:
            self._fail_active(exc, outputs)
        self.hooks.iteration(self.running, self.waiting, self.engine.cache_tokens)
        yield outputs

    def fail_all(self, error: KilnError) -> list[Output]:
        """End every request, waiting or active, with ``error`` (shutdown)."""
        self._forget_in_flight()
        with self._lock:
            self._waiting.extend(self._arrived)
            self._arrived.clear()
        outputs = [Output(r, error=error) for r in self._waiting]
        self._waiting.clear()
        active = [*self._prefilling, *self._running.values()]
        self._prefilling.clear()
        self._running.clear()
        self._host_bound.clear()
        self._last_token.clear()
        self._leaving += [r.request_id for r in active]
        outputs += [Output(r, error=error) for r in active]
        for request in active:
            _close_speculator(request)
        self._free_leaving()
        return outputs

    # -- overlapped steps --------------------------------------------------------------------------------
    def _overlapped_step(self) -> list[Output]:
        """Plan and launch step N+1, then collect step N: its outputs."""
        outputs: list[Output] = []
        with self._lock:
            self._waiting.extend(self._arrived)
            self._arrived.clear()
            aborted, self._aborted = self._aborted, set()
        try:
            self._drop(aborted, outputs)
            if self._in_flight is not None and self._host_bound:
                self._collect(outputs)  # a row's next step needs this one's tokens on the host first
            plan = self._plan_prompts(outputs)
            chunked = [r for r in self._prefilling if r.request_id in _chunked(plan)]
            decoding = list(self._running.values())
            if self._in_flight is not None and self._last_token:  # none past its last token: it waits for it
                pending = self._in_flight.choosing
                decoding = [r for r in decoding if r.request_id not in self._last_token or r.request_id not in pending]
            plan.decode = [r.request_id for r in decoding]
            if not plan.empty:
                previous = self._in_flight
                self._launch(plan, chunked + decoding)
                if previous is not None:  # launched before the last one is collected: the overlap
                    self._collect(outputs, previous)
            if self._in_flight is not None and (plan.empty or self._host_bound):
                self._collect(outputs)  # nothing to overlap it with, or a row's logits are read on the host
        except Exception as exc:  # a bug or an engine failure: fail what is active, keep going
            self._fail_active(exc, outputs)
        if self._leaving and self._in_flight is None:  # finished ones give their memory back now
            self._free_leaving()
        self.hooks.iteration(self.running, self.waiting, self.engine.cache_tokens)
        return outputs

    def _launch(self, plan: StepPlan, requests: list[Request]) -> None:
        """Queue ``plan`` on the engine; what it changes is known now (a prompt's chunks are in, a
        prompt's end makes its sequence decode from the next step), its tokens at ``_collect``."""
        engine: OverlappingEngine = self.engine  # type: ignore[assignment]  # self.overlap: it overlaps
        plan.masks = self._masks([r for r in requests if r.request_id in self._running or _ends_prompt(plan, r.request_id)])
        launched = engine.launch(plan)
        by_id = {r.request_id: r for r in requests}
        choosing = set(plan.decode)
        for chunk in plan.chunks:
            request = by_id[chunk.seq]
            request.prefilled = chunk.start + len(chunk.token_ids)
            if chunk.last:
                choosing.add(chunk.seq)
                self._prefilling.remove(request)
                self._running[chunk.seq] = request
        self._in_flight = _InFlight(plan, by_id, launched, choosing)

    def _collect(self, outputs: list[Output], step: _InFlight | None = None) -> None:
        """A launched step's result (default: the one in flight). Its tokens go to requests still
        active; a request it ended leaves the engine once no launched step holds it (``_take_leaving``)."""
        step = step or self._in_flight
        assert step is not None
        if step is self._in_flight:
            self._in_flight = None
        engine: OverlappingEngine = self.engine  # type: ignore[assignment]
        result = engine.collect(step.launched)
        running = self._running
        active = {seq: request for seq, request in step.by_id.items() if running.get(seq) is request}
        for chunk in step.plan.chunks:  # a prompt not all in yet
            if step.by_id[chunk.seq] in self._prefilling:
                active[chunk.seq] = step.by_id[chunk.seq]
        for seq, error in result.errors.items():
            if seq in active:
                self._leave(active.pop(seq))
                outputs.append(Output(step.by_id[seq], error=_kiln_error(error)))
        for chunk in step.plan.chunks:
            request = active.get(chunk.seq)
            if request is not None:
                request.prompt_logprobs += result.prompt_logprobs.get(chunk.seq, [])
                if chunk.seq in result.prompt_logits:
                    request.prompt_logits.append(result.prompt_logits[chunk.seq])
        every = len(active) == len(step.by_id)
        self._deliver(result.sampled if every else [s for s in result.sampled if s.seq in active], active, outputs)

    def _forget_in_flight(self) -> None:
        """After a failure: the launched step's result is not wanted (collected, so the engine is idle)."""
        step, self._in_flight = self._in_flight, None
        if step is not None:
            try:
                self.engine.collect(step.launched)  # type: ignore[attr-defined]  # only an overlapping engine launches
            except Exception:  # noqa: BLE001 - the engine failed: its requests are failed already
                pass

    # -- scheduling --------------------------------------------------------------------------------------
    def _drop(self, aborted: set[Hashable], outputs: list[Output]) -> None:
        now = time.monotonic()
        for request in [*self._prefilling, *self._running.values()]:
            if request.request_id in aborted:
                self._leave(request)
            elif now > request.deadline:
                self._leave(request)
                outputs.append(Output(request, error=_timeout(request)))
        if aborted or any(now > r.deadline for r in self._waiting):
            kept: deque[Request] = deque()
            for request in self._waiting:
                if request.request_id in aborted:
                    continue
                if now > request.deadline:
                    outputs.append(Output(request, error=_timeout(request)))
                else:
                    kept.append(request)
            self._waiting = kept

    def _admit(self, outputs: list[Output]) -> list[Request]:
        active = [r.reserve for r in [*self._prefilling, *self._running.values()]]
        if self._in_flight is not None:  # rows that ended but that the launched step still holds
            held = self._in_flight.by_id
            active += [held[seq].reserve for seq in self._leaving if seq in held]
        admitted: list[Request] = []
        # A prompt another request is still computing waits for it to be in the prefix cache: the answers
        # to one prompt (OpenAI's n) then compute it once, and the others take their first token from it.
        computing = {tuple(r.prompt_ids) for r in self._prefilling} if self.engine.capabilities.prefix_cache else None
        deferred: list[Request] = []
        while self._waiting and len(active) < self.max_running:
            request = self._waiting[0]
            if computing is not None and tuple(request.prompt_ids) in computing and not _scored(request):
                deferred.append(self._waiting.popleft())
                continue
            if self.kv_budget is not None:
                needed = self.engine.kv_tokens_needed([*active, request.reserve])
                if needed > self.kv_budget:
                    break  # oldest first: a big request is not overtaken forever by small ones
                excess = needed + self.engine.prefix_tokens - self.kv_budget
                if excess > 0:  # cached prefixes give way to running sequences
                    self.engine.evict_prefixes(excess)
            self._waiting.popleft()
            try:
                request.state = SequenceState(request.request_id, request.prompt_ids, request.params, self.tokenizer,
                                              self.eos_ids, self.engine.max_context, resumed=request.resume_ids)
            except Exception as exc:  # noqa: BLE001 - its own settings failed (a grammar): it alone ends
                outputs.append(Output(request, error=_kiln_error(exc)))
                continue
            if self.speculation.on and request.params.constraint is None and request.params.logprobs is None:
                # not for grammars (a mask per drafted position) nor log-probabilities (plain steps give them)
                request.speculator = self.speculation.speculator(request.prompt_ids, self.draft_model)
            active.append(request.reserve)
            admitted.append(request)
            if _needs_host(request):
                self._host_bound.add(request.request_id)
            if request.state.tokens_left <= 1:
                self._last_token.add(request.request_id)
            if computing is not None:
                computing.add(tuple(request.prompt_ids))
        self._waiting.extendleft(reversed(deferred))  # still the oldest
        return admitted

    def _plan_prompts(self, outputs: list[Output]) -> StepPlan:
        """Admit, then plan this step's prompt chunks (and the sequences the engine must free)."""
        plan = StepPlan()
        for request in self._admit(outputs):
            prompt = request.prompt_ids
            cached = self.engine.capabilities.prefix_cache and not _scored(request)
            restore = self.engine.cached_prefix(prompt) if cached else 0
            self.hooks.prefix(request, restore)
            request.prefilled = restore
            # a resumed request's sent tokens, all but the last, prefilled in chunks after its prompt
            # (not for scored prompts: their positions' outputs are the prompt's alone)
            chunked_resume = bool(request.resume_ids) and self.engine.capabilities.prefill_is_decode \
                and not _scored(request)
            request.prefill_ids = prompt + request.resume_ids[:-1] if chunked_resume else prompt
            assert request.seed is not None  # add_request chose it
            plan.starts.append(SeqStart(request.request_id, prompt, request.params, request.seed, restore=restore,
                                        generated=list(request.resume_ids), prefill_generated=chunked_resume))
            self._prefilling.append(request)
        budget = self.prefill_chunk
        for request in self._prefilling:
            prompt = request.prefill_ids
            end = self._chunk_end(request)
            n = end - request.prefilled
            if n > budget and budget < self.prefill_chunk:
                break  # the next chunk does not fit in what is left of this step
            targets = None
            if request.params.prompt_logprobs is not None:
                targets = prompt[request.prefilled + 1:end + 1]
            plan.chunks.append(Chunk(request.request_id, request.prefilled, prompt[request.prefilled:end],
                                     last=end == len(prompt), targets=targets, keep_logits=request.score))
            budget -= n
            if budget <= 0:
                break
        plan.finished = self._take_leaving()
        return plan

    def _chunk_end(self, request: Request) -> int:
        """Chunks end at fixed positions (multiples of ``prefill_chunk``), whatever the load."""
        prompt = len(request.prefill_ids)
        return min(prompt, (request.prefilled // self.prefill_chunk + 1) * self.prefill_chunk)

    # -- executing and updating ----------------------------------------------------------------------------
    def _execute(self, plan: StepPlan, requests: list[Request], outputs: list[Output]) -> None:
        """Run ``plan``; ``requests`` are those whose chunk or decode row is in it."""
        if not plan.finished:
            plan.finished = self._take_leaving()
        by_id = {r.request_id: r for r in requests}
        choosing = [r for r in requests if r.request_id in self._running or _ends_prompt(plan, r.request_id)]
        plan.masks = self._masks(choosing)
        started = time.perf_counter()
        result = self.engine.execute(plan)
        if self.speculation.on and plan.decode and not plan.chunks and len(plan.decode) <= SPECULATE_MAX_ROWS:
            fed = len(plan.decode) + sum(len(d) for d in plan.drafts.values())
            self._call_costs.record(fed, time.perf_counter() - started)
        self._update(plan, by_id, result, outputs)

    def _drafts(self, decoding: list[Request]) -> dict[Hashable, list[int]]:
        """Tokens to verify after each decoding sequence's next one, while the batch is small enough
        for them to pay (``speculation/policy.py``); at most what the answer may still take, less the
        token the step chooses anyway."""
        if not self.speculation.on or len(decoding) > SPECULATE_MAX_ROWS:
            return {}
        drafts = {}
        fed = len(decoding)  # tokens the call feeds so far: each row's next one, the drafts chosen before
        for request in decoding:
            if request.speculator is not None and request.state is not None and request.state.tokens_left > 1:
                speculator = request.speculator
                cost = self._call_costs.relative(fed, speculator.drafter.token_seconds)
                draft = speculator.draft(request.state.generated_ids, request.state.tokens_left - 1, len(decoding), cost)
                if draft:
                    drafts[request.request_id] = draft
                    fed += len(draft)
        return drafts

    def _masks(self, choosing: list[Request]) -> Any:
        """The grammar bitmasks of the sequences that choose a token in this call. Costly ones are
        computed in a thread while the engine's model runs (onnxruntime and the grammar engine
        release the GIL); cheap ones before it: handing them to a thread cost more than computing
        them (SmolLM2, one json_object stream, 2 busy cores: +0.3-0.5 ms a token threaded, +0.0-0.1
        inline, for masks of ~10 µs)."""
        constrained = [(r.request_id, r.state) for r in choosing if r.state is not None and r.state.matcher is not None]
        if not constrained:
            return None

        def compute() -> dict[Hashable, Any]:
            started = time.perf_counter()
            masks = {request_id: state.bitmask() for request_id, state in constrained}
            self._mask_seconds = time.perf_counter() - started
            return masks

        if self._mask_seconds < OVERLAP_MASKS_S:  # the last step's masks were cheap
            masks = compute()
            return lambda: masks
        if self._masker is None:
            self._masker = ThreadPoolExecutor(1, thread_name_prefix="kiln-grammar")
        return self._masker.submit(compute).result

    def _update(self, plan: StepPlan, by_id: dict[Hashable, Request], result: StepResult,
                outputs: list[Output]) -> None:
        for seq, error in result.errors.items():
            request = by_id[seq]
            self._leave(request)
            outputs.append(Output(request, error=_kiln_error(error)))
        for chunk in plan.chunks:
            request = by_id[chunk.seq]
            if chunk.seq in result.errors:
                continue
            request.prefilled = chunk.start + len(chunk.token_ids)
            request.prompt_logprobs += result.prompt_logprobs.get(chunk.seq, [])
            if chunk.seq in result.prompt_logits:
                request.prompt_logits.append(result.prompt_logits[chunk.seq])
            if chunk.last:
                self._prefilling.remove(request)
                self._running[chunk.seq] = request
        for seq, draft in plan.drafts.items():  # acceptance: every token the engine returned but the last
            speculator = by_id[seq].speculator
            if seq not in result.errors and speculator is not None:
                accepted = sum(s.seq == seq for s in result.sampled) - 1
                speculator.verified(len(draft), accepted)
                self.hooks.speculated(by_id[seq], len(draft), accepted)
        self._deliver(result.sampled, by_id, outputs)

    def _deliver(self, chosen: list[Sampled], by_id: dict[Hashable, Request], outputs: list[Output]) -> None:
        """The step's tokens as the clients get them: each request's text, finish and output. One
        clock reading for the step: its tokens came out together."""
        now = time.monotonic()
        for sampled in chosen:
            request = by_id[sampled.seq]
            assert request.state is not None
            if request.state.finished:  # drafted tokens the engine accepted after the answer's end
                continue
            try:
                delta = request.state.accept(sampled.token)
            except Exception as exc:  # noqa: BLE001 - its grammar refused the token: it alone ends
                self._leave(request)
                outputs.append(Output(request, error=_kiln_error(exc)))
                continue
            delta.logprob, delta.top_logprobs = sampled.logprob, sampled.top_logprobs
            if request.params.prompt_logprobs is not None and request.first_token_at == 0.0:
                delta.prompt_logprobs = [None, *request.prompt_logprobs]
            self.hooks.token(request, now)  # before the times change: it tells the first token by them
            if request.first_token_at == 0.0:
                request.first_token_at = now
            request.last_token_at = now
            outputs.append(Output(request, delta, logits=sampled.logits))
            if delta.finish_reason is not None:
                self.hooks.finished(request, now)
                self._leave(request)
            elif self.overlap and request.state.tokens_left <= 1:
                self._last_token.add(request.request_id)

    def _leave(self, request: Request) -> None:
        """Forget a request; the engine frees its sequence at its next call."""
        self._running.pop(request.request_id, None)
        if request in self._prefilling:
            self._prefilling.remove(request)
        self._leaving.append(request.request_id)
        self._host_bound.discard(request.request_id)
        self._last_token.discard(request.request_id)
        _close_speculator(request)

    def _take_leaving(self) -> list[Hashable]:
        """The sequences that leave the engine with the next plan: those that ended, less those a
        launched step still computes for (they leave after it is collected, their rows held till then)."""
        if not self._leaving:
            return []
        held = self._in_flight.by_id if self._in_flight is not None else {}
        leaving = [seq for seq in self._leaving if seq not in held]
        self._leaving = [seq for seq in self._leaving if seq in held]
        return leaving

    def _free_leaving(self) -> None:
        leaving = self._take_leaving()
        try:
            self.engine.execute(StepPlan(finished=leaving))
        except Exception:  # noqa: BLE001 - the engine is in a bad state; the next requests start afresh
            pass

    def _fail_active(self, exc: Exception, outputs: list[Output]) -> None:
        self._forget_in_flight()
        error = _kiln_error(exc)
        failed = [*self._prefilling, *self._running.values()]
        self._prefilling.clear()
        self._running.clear()
        self._host_bound.clear()
        self._last_token.clear()
        self._leaving += [r.request_id for r in failed]
        outputs += [Output(request, error=error) for request in failed]
        for request in failed:
            _close_speculator(request)
        self._free_leaving()


@dataclass(eq=False)
class _InFlight:
    """A step launched on an overlapping engine and not yet collected (at most one between two
    ``step_parts``: each launches the next step, then collects this one): its plan, its requests,
    the sequences that choose a token in it."""

    plan: StepPlan
    by_id: dict[Hashable, Request]
    launched: Launched
    choosing: set[Hashable]


def _needs_host(request: Request) -> bool:
    """Whether its next step needs this one's results on the host, or its logits read there before
    another step runs: a grammar's mask, log-probabilities, prompt scores."""
    params = request.params
    return (request.state is not None and request.state.matcher is not None) or params.logprobs is not None \
        or params.prompt_logprobs is not None or request.score


def _close_speculator(request: Request) -> None:
    """The request left: its drafter gives back what it holds (a draft model's cache slot)."""
    if request.speculator is not None:
        speculator, request.speculator = request.speculator, None
        speculator.close()


def _scored(request: Request) -> bool:
    """Whether its prompt's positions are wanted (log-probabilities, scores): computed in full, never
    restored from the prefix cache."""
    return request.params.prompt_logprobs is not None or request.score


def _chunked(plan: StepPlan) -> set[Hashable]:
    return {c.seq for c in plan.chunks}


def _ends_prompt(plan: StepPlan, seq: Hashable) -> bool:
    return any(c.seq == seq and c.last for c in plan.chunks)


def _kiln_error(exc: Exception) -> KilnError:
    return exc if isinstance(exc, KilnError) else KilnError(f"generation failed ({type(exc).__name__}: {exc})")


def _timeout(request: Request) -> RequestTimeoutError:
    return RequestTimeoutError(f"generation request timed out after {request.deadline - request.arrived:g}s")


# --- driving a core to the end: kiln generate, eval, the gate, bench ------------------------------------------


def run_to_completion(core: EngineCore, requests: Iterable[Request]) -> Iterator[Output]:
    """Add every request, then step until all are done, yielding outputs as they come. A consumer
    that stops early leaves nothing in the engine."""
    added = []
    for request in requests:
        core.add_request(request)
        added.append(request.request_id)
    try:
        while core.has_work():
            for part in core.step_parts():
                yield from part
    finally:
        if core.has_work():
            for request_id in added:
                core.abort(request_id)
            core.step()


@dataclass
class Completion:
    request_id: Hashable
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    logits: list[np.ndarray] = field(default_factory=list)  # per token, with keep_logits


def complete(core: EngineCore, requests: Sequence[Request]) -> list[Completion]:
    """Run every request to the end; completions in request order. An error ends the call."""
    done = {r.request_id: Completion(r.request_id, "", [], "", len(r.prompt_ids)) for r in requests}
    for output in run_to_completion(core, requests):
        if output.error is not None:
            raise output.error
        completion = done[output.request_id]
        assert output.delta is not None
        completion.text += output.delta.text
        completion.token_ids.append(output.delta.token_id)
        completion.finish_reason = output.delta.finish_reason or completion.finish_reason
        if output.logits is not None:
            completion.logits.append(output.logits)
    return [done[r.request_id] for r in requests]


def prompt_logits(core: EngineCore, prompt_ids: Sequence[int], request_id: Hashable = "score") -> np.ndarray:
    """Every position's logits [len, vocab] of a prompt, computed the way a request's prompt is
    (the same chunks): the gate's and the eval's comparisons and perplexities."""
    request = Request(request_id, list(prompt_ids), greedy(1), score=True)
    complete(core, [request])
    return np.concatenate(request.prompt_logits)


def greedy(max_new_tokens: int, **overrides: Any) -> SamplingParams:
    """Greedy decoding of exactly ``max_new_tokens`` tokens (end-of-sequence ignored): the gate and bench."""
    return SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True, **overrides)
