"""Continuous batching: one thread drives the ``GenerationEngine`` step by step, and requests join
and leave the running batch between steps (iteration-level scheduling, as in Orca, vLLM and TGI).

One iteration of ``_run``:
1. drop what was cancelled (a client left) or ran out of time: its cache is freed before the next
   step, so a disconnect costs at most the step already running;
2. admit waiting requests, oldest first, while the running batch has room: a row free
   (``max_running``) and KV cache to the end of its answer (``kv_budget``, below);
3. prefill admitted prompts in chunks of ``prefill_chunk`` tokens, at most ``prefill_chunk`` tokens
   per iteration in all (at least one chunk), so that a long prompt arriving costs running streams
   one chunk's time per token instead of its whole prefill; a prompt fully prefilled yields its
   first token and joins the batch;
4. one decode step for every running sequence; finished ones leave at once.

Chunk boundaries are fixed (token 0-127, 128-255, ...) whatever the load, so a prompt's cache is
computed the same way alone and under load, and greedy answers do not depend on what else runs.

KV budget: the engine's batch is left-padded to its longest row, so its cache holds
rows × longest-row tokens. A request is admitted only when the batch, with it, fits
``kv_budget`` even once every sequence has reached its last possible token:
(running + 1) × max(prompt + max_new_tokens). Nothing admitted can ever be dropped for memory;
the rest wait in a bounded queue (full: ``OverloadedError``, 503 + Retry-After).

Results go back to asyncio: each job names its event loop and an ``asyncio.Queue``; an iteration's
events are handed over with one ``call_soon_threadsafe`` per loop (not one per token)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from ...errors import InvalidInputError, KilnError, ModelNotReadyError, OverloadedError, RequestTimeoutError
from ...generation.engine import GenerationEngine
from ...generation.sampling import SamplingParams
from ...generation.sequence import Delta, SequenceState

log = logging.getLogger("modelkiln.serve")

_ids = itertools.count(1)


@dataclass(eq=False)
class Job:
    """One generation request as the scheduler sees it. Events put on ``queue`` (in ``loop``):
    ``Delta`` per token (the last one has a ``finish_reason``), or a ``KilnError`` that ends it."""

    prompt_ids: list[int]
    params: SamplingParams
    deadline: float  # time.monotonic()
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    reserve: int  # KV tokens this sequence may reach (prompt + max new tokens, within the context)
    id: int = field(default_factory=lambda: next(_ids))
    arrived: float = field(default_factory=time.monotonic)
    state: SequenceState | None = None
    prefilled: int = 0  # prompt tokens in the cache so far
    next_token: int = -1  # fed to the next decode step
    first_token_at: float = 0.0
    last_token_at: float = 0.0


class SchedulerHooks:
    """What the scheduler reports (metrics); the default reports nothing."""

    def token(self, job: Job, now: float) -> None: ...  # a token delivered (first: TTFT, else ITL)
    def finished(self, job: Job, now: float) -> None: ...  # ended normally (e2e latency, token counts)
    def iteration(self, running: int, waiting: int, cache_tokens: int) -> None: ...


class Scheduler:
    def __init__(self, engine: GenerationEngine, tokenizer: Tokenizer, eos_ids: frozenset[int], *,
                 max_running: int, max_waiting: int, kv_budget: int, prefill_chunk: int,
                 hooks: SchedulerHooks | None = None, name: str = "generation"):
        self.engine = engine
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.kv_budget = kv_budget
        self.prefill_chunk = prefill_chunk
        self.hooks = hooks or SchedulerHooks()
        self.name = name
        self._cond = threading.Condition()
        # shared with the event loop, under _cond:
        self._waiting: deque[Job] = deque()
        self._cancelled: set[int] = set()
        self._stopping = False
        # the scheduler thread's own:
        self._prefilling: list[Job] = []  # admitted, prompt not all in the cache yet
        self._running: dict[int, Job] = {}  # in the engine's batch
        self._thread: threading.Thread | None = None

    # -- called from the event loop ----------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"kiln-generate-{self.name}", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue a job; refused at once when it could never fit or the queue is full."""
        if job.reserve > self.kv_budget:
            raise InvalidInputError(f"prompt + max_tokens = {job.reserve} tokens exceed the server's KV cache of "
                                    f"{self.kv_budget} tokens (--max-kv-tokens): ask for fewer tokens")
        with self._cond:
            if self._stopping:
                raise ModelNotReadyError(f"model '{self.name}' is shutting down")
            if len(self._waiting) >= self.max_waiting:
                raise OverloadedError(f"{len(self._waiting)} generation requests waiting for model '{self.name}'; "
                                      "retry later")
            self._waiting.append(job)
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """The job's client is gone: free its sequence before the next step."""
        with self._cond:
            self._cancelled.add(job.id)
            self._cond.notify()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running) + len(self._prefilling)

    def stop(self, timeout: float | None = None) -> None:
        """Refuse new jobs, finish the accepted ones, then end the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # -- the scheduler thread --------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._waiting or self._running or self._prefilling or self._cancelled):
                    if self._stopping:
                        return
                    self._cond.wait()
                cancelled, self._cancelled = self._cancelled, set()
            events: list[tuple[Job, Any]] = []
            try:
                self._drop(cancelled, events)
                self._admit()
                self._prefill(events)
                self._decode(events)
            except Exception as exc:  # a bug or an engine failure: fail what is active, keep serving
                log.exception("generation step failed for model %s", self.name)
                self._fail_active(exc, events)
            self._deliver(events)
            self.hooks.iteration(self.running, self.waiting, self.engine.cache_tokens)

    def _drop(self, cancelled: set[int], events: list) -> None:
        now = time.monotonic()
        for job in [*self._prefilling, *self._running.values()]:
            if job.id in cancelled:
                self._remove(job)
            elif now > job.deadline:
                self._remove(job)
                events.append((job, _timeout(job)))
        with self._cond:
            if cancelled or any(now > job.deadline for job in self._waiting):  # deadlines differ (Triton's timeout)
                kept = deque()
                for job in self._waiting:
                    if job.id in cancelled:
                        continue
                    if now > job.deadline:
                        events.append((job, _timeout(job)))
                    else:
                        kept.append(job)
                self._waiting = kept

    def _admit(self) -> None:
        active = [*self._prefilling, *self._running.values()]
        widest = max((j.reserve for j in active), default=0)
        with self._cond:
            while self._waiting and len(active) < self.max_running:
                job = self._waiting[0]
                wider = max(widest, job.reserve)
                if (len(active) + 1) * wider > self.kv_budget:
                    break  # oldest first: a big request is not overtaken forever by small ones
                self._waiting.popleft()
                active.append(job)
                widest = wider
                job.state = SequenceState(job.id, job.prompt_ids, job.params, self.tokenizer, self.eos_ids,
                                          self.engine.max_context)
                self._prefilling.append(job)

    def _prefill(self, events: list) -> None:
        budget = self.prefill_chunk
        while self._prefilling and budget > 0:
            job = self._prefilling[0]
            end = min(len(job.prompt_ids), (job.prefilled // self.prefill_chunk + 1) * self.prefill_chunk)
            if end - job.prefilled > budget and budget < self.prefill_chunk:
                break  # the next chunk does not fit in what is left of this iteration
            logits = self.engine.prefill(job.id, job.prompt_ids[job.prefilled:end])
            budget -= end - job.prefilled
            job.prefilled = end
            if end < len(job.prompt_ids):
                continue
            self._prefilling.pop(0)
            if self._emit(job, logits, events):
                self.engine.remove(job.id)
            else:
                self.engine.join(job.id)
                self._running[job.id] = job

    def _decode(self, events: list) -> None:
        if not self._running:
            return
        logits = self.engine.step({seq: job.next_token for seq, job in self._running.items()})
        done = [job for row, seq in enumerate(list(self.engine.rows))
                if self._emit(job := self._running[seq], logits[row], events)]
        for job in done:
            self._remove(job)

    def _emit(self, job: Job, logits: np.ndarray, events: list) -> bool:
        """Choose and accept the job's next token; queue its delta. True when the job is done."""
        assert job.state is not None
        token = job.state.choose(logits)
        delta = job.state.accept(token)
        job.next_token = token
        now = time.monotonic()
        self.hooks.token(job, now)
        if job.first_token_at == 0.0:
            job.first_token_at = now
        job.last_token_at = now
        events.append((job, delta))
        if delta.finish_reason is not None:
            self.hooks.finished(job, now)
            return True
        return False

    def _remove(self, job: Job) -> None:
        self._running.pop(job.id, None)
        if job in self._prefilling:
            self._prefilling.remove(job)
        if job.id in self.engine:
            self.engine.remove(job.id)

    def _fail_active(self, exc: Exception, events: list) -> None:
        error = exc if isinstance(exc, KilnError) else KilnError(f"generation failed ({type(exc).__name__})")
        for job in [*self._prefilling, *self._running.values()]:
            events.append((job, error))
            try:
                self._remove(job)
            except Exception:  # the engine is in a bad state: start over with an empty batch
                log.exception("could not remove sequence %s", job.id)
        self._prefilling.clear()
        self._running.clear()

    @staticmethod
    def _deliver(events: list[tuple[Job, Any]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        for job, event in events:
            by_loop.setdefault(job.loop, []).append((job.queue, event))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the loop is closed (a test, or shutdown): nobody is listening
                pass


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, event in items:
        queue.put_nowait(event)


def _timeout(job: Job) -> RequestTimeoutError:
    return RequestTimeoutError(f"generation request timed out after {job.deadline - job.arrived:g}s")


__all__ = ["Delta", "Job", "Scheduler", "SchedulerHooks"]
