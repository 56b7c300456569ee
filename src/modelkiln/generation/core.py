"""The engine core: one object that owns a decoder engine and every request on it, and advances
them all by one ``step()``. It has no threads and no asyncio; ``kiln generate``, ``kiln eval``,
the gate, ``kiln bench`` (``run_to_completion``), ``kiln serve`` and the Triton model (each a
thread calling ``step()``) drive the same core, so they schedule alike.

One ``step()``:
1. take what arrived (``add_request``, ``abort``: safe from any thread, under a lock);
2. drop what was aborted (a client left) or ran out of time: its cache is freed before the next
   engine call, so a disconnect costs at most the call already running;
3. admit waiting requests, oldest first, while a row is free (``max_running``) and the KV cache
   holds every admitted sequence up to its last possible token (``kv_budget``, counted the way the
   engine lays its cache out: ``engine.kv_tokens_needed``);
4. prefill admitted prompts in chunks of ``prefill_chunk`` tokens, at most ``prefill_chunk`` tokens
   per step in all (at least one chunk), so a long prompt costs running streams one chunk's time per
   token instead of its whole prefill; a prompt fully prefilled yields its first token and joins;
5. one decode step for every running sequence; finished ones leave at once.

Chunk boundaries are fixed (tokens 0-127, 128-255, ...) whatever the load, so a prompt's cache is
computed the same way alone and under load: an answer does not depend on what else runs (with the
serving graph, bit for bit; the gate checks it through this same code)."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from tokenizers import Tokenizer

from ..errors import InvalidInputError, KilnError, OverloadedError, RequestTimeoutError
from .sampling import SamplingParams
from .sequence import Delta, SequenceState

DEFAULT_PREFILL_CHUNK = 128  # prompt tokens per step: a running stream's gap grows by one chunk's time
DEFAULT_MAX_RUNNING = 32


class Engine(Protocol):
    """What the core needs of a decoder engine (serving_engine.py, padded_engine.py)."""

    max_context: int | None
    rows: list[Hashable]

    prefix_tokens: int  # tokens the engine's prefix cache holds (they count in the KV budget)

    def prefill(self, seq_id: Hashable, token_ids: Sequence[int], all_logits: bool = False) -> np.ndarray: ...
    def prefill_first(self, prompts: Sequence[tuple[Hashable, Sequence[int]]]) -> list[np.ndarray]: ...
    @property
    def free_staging_rows(self) -> int: ...  # how many new sequences prefill_first can take now
    def restore_prefix(self, seq_id: Hashable, prompt_ids: Sequence[int]) -> int: ...
    def remember_prefix(self, seq_id: Hashable, prompt_ids: Sequence[int]) -> None: ...
    def evict_prefixes(self, tokens: int) -> int: ...
    def join(self, seq_id: Hashable) -> None: ...
    def step(self, next_tokens: dict[Hashable, int]) -> np.ndarray: ...
    def remove(self, seq_id: Hashable) -> None: ...
    def __contains__(self, seq_id: Hashable) -> bool: ...
    @property
    def cache_tokens(self) -> int: ...
    def kv_tokens_needed(self, reserves: Sequence[int]) -> int: ...


@dataclass(eq=False)
class Request:
    """One generation request. ``reserve``: the KV tokens it may reach (prompt + max new tokens,
    within the context); ``deadline``: ``time.monotonic()`` after which it ends with a timeout."""

    request_id: Hashable
    prompt_ids: list[int]
    params: SamplingParams
    deadline: float = float("inf")
    arrived: float = field(default_factory=time.monotonic)
    reserve: int = 0
    # the core's bookkeeping
    state: SequenceState | None = None
    prefilled: int = 0  # prompt tokens in the cache so far
    prefix_checked: bool = False  # the engine's prefix cache was asked for this prompt
    next_token: int = -1  # fed to the next decode step
    first_token_at: float = 0.0
    last_token_at: float = 0.0


@dataclass
class Output:
    """What one step produced for one request: a token (``delta``; the last one has a
    ``finish_reason``) or an ``error`` that ends it. ``logits``: the row the token was chosen
    from, kept only when the core was made with ``keep_logits`` (the gate compares them)."""

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


class EngineCore:
    def __init__(self, engine: Engine, tokenizer: Tokenizer, eos_ids: Iterable[int] = (), *,
                 max_running: int = DEFAULT_MAX_RUNNING, max_waiting: int | None = None,
                 kv_budget: int | None = None, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 hooks: CoreHooks | None = None, keep_logits: bool = False):
        self.engine = engine
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(eos_ids)
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.kv_budget = kv_budget
        self.prefill_chunk = prefill_chunk
        self.hooks = hooks or CoreHooks()
        self.keep_logits = keep_logits
        self._lock = threading.Lock()  # guards the inbox: add_request and abort come from other threads
        self._arrived: deque[Request] = deque()
        self._aborted: set[Hashable] = set()
        self._waiting: deque[Request] = deque()
        self._prefilling: list[Request] = []  # admitted, prompt not all in the cache yet
        self._running: dict[Hashable, Request] = {}  # in the engine's decode batch

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
        with self._lock:
            if self.max_waiting is not None and len(self._arrived) + len(self._waiting) >= self.max_waiting:
                raise OverloadedError(f"{len(self._arrived) + len(self._waiting)} generation requests waiting; retry later")
            self._arrived.append(request)

    def abort(self, request_id: Hashable) -> None:
        """The request's client is gone: free its sequence before the next engine call."""
        with self._lock:
            self._aborted.add(request_id)

    def has_work(self) -> bool:
        return bool(self._arrived or self._aborted or self._waiting or self._prefilling or self._running)

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
        sequence: 9 ms alone, 45 ms among 16 on SmolLM2). Ask for both parts: the decode runs only then."""
        outputs: list[Output] = []
        with self._lock:
            self._waiting.extend(self._arrived)
            self._arrived.clear()
            aborted, self._aborted = self._aborted, set()
        try:
            self._drop(aborted, outputs)
            self._admit(outputs)
            self._prefill(outputs)
        except Exception as exc:  # a bug or an engine failure: fail what is active, keep going
            self._fail_active(exc, outputs)
        yield outputs
        outputs = []
        try:
            self._decode(outputs)
        except Exception as exc:
            self._fail_active(exc, outputs)
        self.hooks.iteration(self.running, self.waiting, self.engine.cache_tokens)
        yield outputs

    def fail_all(self, error: KilnError) -> list[Output]:
        """End every request, waiting or active, with ``error`` (shutdown)."""
        with self._lock:
            self._waiting.extend(self._arrived)
            self._arrived.clear()
        outputs = [Output(r, error=error) for r in self._waiting]
        self._waiting.clear()
        for request in [*self._prefilling, *self._running.values()]:
            self._remove(request)
            outputs.append(Output(request, error=error))
        return outputs

    def _drop(self, aborted: set[Hashable], outputs: list[Output]) -> None:
        now = time.monotonic()
        for request in [*self._prefilling, *self._running.values()]:
            if request.request_id in aborted:
                self._remove(request)
            elif now > request.deadline:
                self._remove(request)
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

    def _admit(self, outputs: list[Output]) -> None:
        active = [r.reserve for r in [*self._prefilling, *self._running.values()]]
        while self._waiting and len(active) < self.max_running:
            request = self._waiting[0]
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
                                              self.eos_ids, self.engine.max_context)
            except Exception as exc:  # noqa: BLE001 - its own settings failed (a seed numpy refuses): it alone ends
                outputs.append(Output(request, error=_kiln_error(exc)))
                continue
            active.append(request.reserve)
            self._prefilling.append(request)

    def _prefill(self, outputs: list[Output]) -> None:
        budget = self.prefill_chunk
        while self._prefilling and budget > 0:
            request = self._prefilling[0]
            self._restore_prefix(request)
            if request.prefilled == 0:  # a first chunk with no past: others like it share the call
                spent = self._prefill_first_chunks(budget, outputs)
                if not spent:
                    break
                budget -= spent
                continue
            end = self._chunk_end(request)
            if end - request.prefilled > budget and budget < self.prefill_chunk:
                break  # the next chunk does not fit in what is left of this step
            try:
                logits = self.engine.prefill(request.request_id, request.prompt_ids[request.prefilled:end])
            except InvalidInputError as exc:  # this prompt's fault (too long for the context): this request only
                self._prefilling.pop(0)
                self._remove(request)
                outputs.append(Output(request, error=exc))
                continue
            budget -= end - request.prefilled
            request.prefilled = end
            if end == len(request.prompt_ids):
                self._prefilling.pop(0)
                self._prefilled(request, logits, outputs)

    def _restore_prefix(self, request: Request) -> None:
        if not request.prefix_checked:
            request.prefix_checked = True
            request.prefilled = self.engine.restore_prefix(request.request_id, request.prompt_ids)
            self.hooks.prefix(request, request.prefilled)

    def _chunk_end(self, request: Request) -> int:
        """Chunks end at fixed positions (multiples of ``prefill_chunk``), whatever the load."""
        return min(len(request.prompt_ids), (request.prefilled // self.prefill_chunk + 1) * self.prefill_chunk)

    def _prefill_first_chunks(self, budget: int, outputs: list[Output]) -> int:
        """The first chunks of the new prompts at the head of the queue that have no cached prefix,
        in one engine call, as many as fit ``budget`` counted in padded tokens (rows × the longest)
        and the engine's free staging rows. Returns the tokens spent (0: not even one fits)."""
        group: list[Request] = []
        width = 0
        for request in self._prefilling:
            self._restore_prefix(request)
            if request.prefilled or len(group) >= self.engine.free_staging_rows:
                break
            chunk = self._chunk_end(request)
            if (len(group) + 1) * max(width, chunk) > budget and (group or budget < self.prefill_chunk):
                break
            group.append(request)
            width = max(width, chunk)
        if not group:
            return 0
        try:
            logits = self.engine.prefill_first([(r.request_id, r.prompt_ids[:self._chunk_end(r)]) for r in group])
        except InvalidInputError as exc:  # a prompt too long for the context: each alone says which
            if len(group) > 1:
                group = group[:1]
                return self._prefill_first_chunks(self._chunk_end(group[0]), outputs)
            self._prefilling.remove(group[0])
            self._remove(group[0])
            outputs.append(Output(group[0], error=exc))
            return self._chunk_end(group[0])
        for request, row in zip(group, logits):
            request.prefilled = self._chunk_end(request)
            if request.prefilled == len(request.prompt_ids):
                self._prefilling.remove(request)
                self._prefilled(request, row, outputs)
        return len(group) * width

    def _prefilled(self, request: Request, logits: np.ndarray, outputs: list[Output]) -> None:
        """A prompt all in the cache: remember its prefix, emit its first token, join the batch."""
        self.engine.remember_prefix(request.request_id, request.prompt_ids)
        if self._emit(request, logits, outputs):
            self.engine.remove(request.request_id)
        else:
            self.engine.join(request.request_id)
            self._running[request.request_id] = request

    def _decode(self, outputs: list[Output]) -> None:
        if not self._running:
            return
        logits = self.engine.step({seq: r.next_token for seq, r in self._running.items()})
        done = [request for row, seq in enumerate(list(self.engine.rows))
                if self._emit(request := self._running[seq], logits[row], outputs)]
        for request in done:
            self._remove(request)

    def _emit(self, request: Request, logits: np.ndarray, outputs: list[Output]) -> bool:
        """Choose and accept the request's next token; record its output. True when it is done."""
        assert request.state is not None
        try:
            token = request.state.choose(logits)
            delta = request.state.accept(token)
        except Exception as exc:  # noqa: BLE001 - its own sampling failed: it ends alone, the batch goes on
            outputs.append(Output(request, error=_kiln_error(exc)))
            return True
        request.next_token = token
        now = time.monotonic()
        self.hooks.token(request, now)
        if request.first_token_at == 0.0:
            request.first_token_at = now
        request.last_token_at = now
        outputs.append(Output(request, delta, logits=logits.copy() if self.keep_logits else None))
        if delta.finish_reason is not None:
            self.hooks.finished(request, now)
            return True
        return False

    def _remove(self, request: Request) -> None:
        self._running.pop(request.request_id, None)
        if request in self._prefilling:
            self._prefilling.remove(request)
        if request.request_id in self.engine:
            self.engine.remove(request.request_id)

    def _fail_active(self, exc: Exception, outputs: list[Output]) -> None:
        error = _kiln_error(exc)
        failed = [*self._prefilling, *self._running.values()]
        self._prefilling.clear()
        self._running.clear()
        for request in failed:
            outputs.append(Output(request, error=error))
            try:
                if request.request_id in self.engine:
                    self.engine.remove(request.request_id)
            except Exception:  # noqa: BLE001 - the engine is in a bad state; the next requests start afresh
                pass


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


def greedy(max_new_tokens: int, **overrides: Any) -> SamplingParams:
    """Greedy decoding of exactly ``max_new_tokens`` tokens (end-of-sequence ignored): the gate and bench."""
    return SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True, **overrides)
