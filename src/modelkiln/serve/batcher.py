"""Dynamic batching: a bounded queue owned by one worker thread.

The event loop only *submits* (a lock, an append, a notify) and awaits a future. The worker
thread tokenizes whatever has arrived in one fast batch call, picks a batch around the oldest
waiting input (bounded by a padded-token budget and a row count, preferring similar lengths to
cut padding), runs it, and hands the answers back to the loop with one thread-safe call per
batch. There is no sleep on this path: the worker blocks on a condition and wakes as soon as
work arrives, so a lone request on an idle server runs at once, and under load requests pile up
while the model is busy and naturally form the next batch. ``max_queue_delay`` (off by default)
additionally holds a batch open until it fills or the oldest input has waited that long.

With ``instances`` > 1 (several single-threaded engine sessions, like Triton's instance groups)
the worker forms a batch only when an instance is free and hands it to that instance's thread:
on small machines this keeps every core busy without onnxruntime's spinning thread pools
competing with the event loop."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import KilnError, OverloadedError

log = logging.getLogger("modelkiln.serve")


@dataclass(eq=False)
class Job:
    """One request: ``n`` inputs whose answers the worker fills in, then one future resolved."""

    n: int
    future: asyncio.Future
    enqueued: float = field(default_factory=time.perf_counter)
    results: list[Any] = field(default_factory=list)
    tokens: int = 0  # real (unpadded) tokens, for usage reporting
    remaining: int = 0  # touched by the worker thread only
    done: bool = False  # worker side: answered (or failed)
    cancelled: bool = False  # loop side: the client is no longer waiting (timeout)
    deadline: float = float("inf")  # perf_counter time after which the answer is useless
    timeout_error: BaseException | None = None  # what to answer when the deadline passed in the queue

    def __post_init__(self) -> None:
        self.results = [None] * self.n
        self.remaining = self.n


@dataclass(eq=False, slots=True)
class Item:
    """One input of a job: prepared text (or a pre-tokenized row) and, once tokenized, its encoding."""

    job: Job
    index: int
    text: Any  # str | (str, str) | None for pre-tokenized rows
    encoding: Any = None  # tokenizers.Encoding or a row with .ids/.attention_mask/.type_ids
    length: int = 0


class BatchHooks:
    """What the batcher calls (model.py implements it). Runs on the worker thread."""

    def tokenize(self, items: Sequence[Item]) -> list[KilnError | None]:  # pragma: no cover
        raise NotImplementedError

    def execute(self, batch: Sequence[Item], instance: int = 0) -> list[Any]:  # pragma: no cover
        raise NotImplementedError

    def observe(self, batch: Sequence[Item], queue_s: list[float], compute_s: float) -> None:
        pass


class Batcher:
    def __init__(self, hooks: BatchHooks, max_batch_size: int, max_batch_tokens: int, max_queue_size: int,
                 max_queue_delay_s: float = 0.0, name: str = "model", instances: int = 1):
        self.hooks = hooks
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.max_queue_size = max_queue_size
        self.max_queue_delay_s = max_queue_delay_s
        self._queue: deque[Item] = deque()
        self._queued = 0  # inputs submitted and not yet taken into a batch
        self._cond = threading.Condition()
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name=f"batcher-{name}", daemon=True)
        self._done_lock = threading.Lock()  # job bookkeeping: batches of one job may run in parallel
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()  # idle engine instances
        self._inbox: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(instances)]
        self._runners = [threading.Thread(target=self._runner, args=(k,), name=f"engine-{name}-{k}", daemon=True)
                         for k in range(instances)]
        for k in range(instances):
            self._free.put(k)

    # -- event loop side -------------------------------------------------------------------
    def start(self) -> None:
        for t in self._runners:
            t.start()
        self._thread.start()

    @property
    def queued(self) -> int:
        return self._queued

    def submit(self, items: list[Item]) -> None:
        """Queue a job's inputs, or raise OverloadedError at once when the queue is full."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        with self._cond:
            if self._stopping:
                raise OverloadedError("the server is shutting down")
            if self._queued + len(items) > self.max_queue_size:
                raise OverloadedError(f"queue full ({self._queued} inputs waiting); retry later")
            self._queued += len(items)
            self._queue.extend(items)
            self._cond.notify()

    def stop(self, timeout: float | None = None) -> None:
        """Finish everything already queued, then end the worker."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)
        for box in self._inbox:
            box.put(None)
        for t in self._runners:
            t.join(timeout)

    # -- worker thread ---------------------------------------------------------------------
    def _take(self, pending: list[Item]) -> list[Item] | None:
        """Block until there is work; return newly queued items ([] if only ``pending``), None to exit."""
        with self._cond:
            while not self._queue and not pending:
                if self._stopping:
                    return None
                self._cond.wait()
            if self.max_queue_delay_s > 0:
                oldest = pending[0].job.enqueued if pending else self._queue[0].job.enqueued
                deadline = oldest + self.max_queue_delay_s
                while len(self._queue) + len(pending) < self.max_batch_size and not self._stopping:
                    left = deadline - time.perf_counter()
                    if left <= 0:
                        break
                    self._cond.wait(left)
            new = list(self._queue)
            self._queue.clear()
            return new

    def _run(self) -> None:
        pending: list[Item] = []
        while True:
            instance = self._free.get()  # form a batch only when an engine can run it at once
            new = self._take(pending)
            if new is None:
                self._free.put(instance)
                return
            finished: list[Job] = []
            dispatched = False
            try:
                if new:
                    pending.extend(self._tokenize(new, finished))
                now = time.perf_counter()
                for it in pending:  # expired in the queue: answer 503 now, don't spend compute on it
                    if it.job.deadline < now and not it.job.done:
                        self._fail(it.job, it.job.timeout_error or TimeoutError("deadline passed"), finished)
                live = [it for it in pending if not (it.job.done or it.job.cancelled)]
                self._release(len(pending) - len(live))
                if live:
                    # Idle instances share the queue: two requests on two idle single-threaded
                    # instances run side by side rather than as one batch of two on one of them.
                    idle = 1 + self._free.qsize()
                    batch, pending = self._select(live, max_rows=-(-len(live) // idle))
                    self._release(len(batch))
                    self._inbox[instance].put(batch)
                    dispatched = True
                else:
                    pending = []
            except Exception:  # a bug: never let the worker die and strand every later request
                log.exception("batcher worker error")
            if not dispatched:
                self._free.put(instance)
            if finished:
                self._resolve(finished)

    def _runner(self, instance: int) -> None:
        """One engine instance's thread: run batches handed to it, answer, report itself free."""
        while True:
            batch = self._inbox[instance].get()
            if batch is None:
                return
            finished: list[Job] = []
            try:
                self._execute(batch, finished, instance)
            except Exception:
                log.exception("engine thread error")
            self._free.put(instance)
            if finished:
                self._resolve(finished)

    def _release(self, n: int) -> None:
        if n:
            with self._cond:
                self._queued -= n

    def _tokenize(self, new: list[Item], finished: list[Job]) -> list[Item]:
        live = [it for it in new if not (it.job.done or it.job.cancelled)]
        self._release(len(new) - len(live))
        try:
            errors = self.hooks.tokenize(live)
        except Exception as exc:
            errors = [exc] * len(live)  # type: ignore[list-item]
        kept = []
        for item, error in zip(live, errors):
            if error is not None:
                self._fail(item.job, error, finished)
            if item.job.done:
                self._release(1)
            else:
                kept.append(item)
        return kept

    def _select(self, items: list[Item], max_rows: int | None = None) -> tuple[list[Item], list[Item]]:
        """The oldest input plus its nearest neighbours by length, within the budgets (and at most
        ``max_rows``). Returns (batch, rest). Oldest-first anchoring means nothing waits forever."""
        rows = min(self.max_batch_size, max_rows or self.max_batch_size)
        items.sort(key=lambda it: it.length)
        anchor = min(range(len(items)), key=lambda k: items[k].job.enqueued)
        lo = hi = anchor
        width = items[anchor].length
        while hi - lo + 1 < rows:
            count = hi - lo + 1
            left_cost = width - items[lo - 1].length if lo > 0 else None  # shorter: only its own padding
            right_cost = None
            if hi + 1 < len(items):
                new_width = items[hi + 1].length
                right_cost = (new_width - width) * count if new_width * (count + 1) <= self.max_batch_tokens else None
            if left_cost is not None and width * (count + 1) > self.max_batch_tokens:
                left_cost = None
            if left_cost is None and right_cost is None:
                break
            if right_cost is None or (left_cost is not None and left_cost <= right_cost):
                lo -= 1
            else:
                hi += 1
                width = items[hi].length
        return items[lo : hi + 1], items[:lo] + items[hi + 1 :]

    def _execute(self, batch: list[Item], finished: list[Job], instance: int = 0) -> None:
        started = time.perf_counter()
        queue_s = [started - it.job.enqueued for it in batch]
        try:
            results = self.hooks.execute(batch, instance)
        except Exception as exc:
            for item in batch:
                self._fail(item.job, exc, finished)
            return
        compute_s = time.perf_counter() - started
        with self._done_lock:
            for item, result in zip(batch, results):
                job = item.job
                if job.done:
                    continue
                job.results[item.index] = result
                job.tokens += item.length
                job.remaining -= 1
                if job.remaining == 0:
                    job.done = True
                    finished.append(job)
        try:
            self.hooks.observe(batch, queue_s, compute_s)
        except Exception:
            log.exception("metrics hook failed")

    def _fail(self, job: Job, error: BaseException, finished: list[Job]) -> None:
        with self._done_lock:
            if not job.done:
                job.done = True
                job.results = error  # type: ignore[assignment]
                finished.append(job)

    def _resolve(self, jobs: list[Job]) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(_resolve_jobs, jobs)
        except RuntimeError:  # loop closed during shutdown
            pass


def _resolve_jobs(jobs: list[Job]) -> None:
    """On the event loop: wake each waiting handler (one call for the whole batch)."""
    for job in jobs:
        if job.future.done():
            continue
        if isinstance(job.results, BaseException):
            job.future.set_exception(job.results)
        else:
            job.future.set_result(job.results)


async def wait_for(job: Job, timeout_s: float, on_timeout: Callable[[], BaseException]) -> list[Any]:
    """Await a job with a deadline; on timeout, tell the worker to skip what is left of it."""
    try:
        return await asyncio.wait_for(job.future, timeout_s)
    except asyncio.TimeoutError:
        job.cancelled = True
        raise on_timeout() from None
    except asyncio.CancelledError:
        job.cancelled = True
        raise
