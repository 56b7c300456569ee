"""Dynamic batching: one bounded queue, served by the engine instances' own threads.

The event loop only *submits* (a lock, an append, a notify) and awaits a future. Each engine
instance (an onnxruntime session, like one of Triton's instance-group members) has one thread
that, whenever it is free, takes what has arrived, tokenizes it in one fast batch call, picks a
batch around the oldest waiting input (bounded by a padded-token budget and a row count,
preferring similar lengths to cut padding), runs it and hands the answers back to the loop with
one thread-safe call per batch. The thread that runs a batch is the one that formed it: no hand-
off between a batching thread and an engine thread sits on the path of any request.

There is no sleep either: free threads block on a condition each and wake as soon as work arrives
(the most recently idle thread first), so a lone request on an idle server runs at once, and under
load requests pile up while the engines are busy and naturally form the next batches.
``max_queue_delay`` (off by default) additionally holds a batch open until it fills or the oldest
input has waited that long. Idle instances share what is queued (two requests, two idle
single-threaded instances: they run side by side), and a batch that finds no other batch running
and nothing else waiting is run ``alone``, which lets the model use a session with every core for
it (see model.py)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import KilnError, OverloadedError

log = logging.getLogger("modelkiln.serve")

LOAD_SMOOTHING = 0.1  # weight of each arrival in the moving average of the server's load
ALONE_BELOW = 0.5  # that average under which a lone batch may use every core


@dataclass(eq=False)
class Job:
    """One request: ``n`` inputs whose answers the engine threads fill in, then one future resolved."""

    n: int
    future: asyncio.Future
    enqueued: float = field(default_factory=time.perf_counter)
    results: list[Any] = field(default_factory=list)
    tokens: int = 0  # real (unpadded) tokens, for usage reporting
    remaining: int = 0  # engine side, under the batcher's done-lock
    done: bool = False  # engine side: answered (or failed)
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
    """What the batcher calls (model.py implements it), on an engine instance's thread."""

    def tokenize(self, items: Sequence[Item]) -> list[KilnError | None]:  # pragma: no cover
        raise NotImplementedError

    def execute(self, batch: Sequence[Item], instance: int = 0, alone: bool = False) -> list[Any]:  # pragma: no cover
        """Run a batch on ``instance``. ``alone``: no other batch runs and nothing else waits."""
        raise NotImplementedError

    def observe(self, batch: Sequence[Item], queue_s: list[float], compute_s: float) -> None:
        pass


class Batcher:
    def __init__(self, hooks: BatchHooks, max_batch_size: int, max_batch_tokens: int, max_queue_size: int,
                 max_queue_delay_s: float = 0.0, name: str = "model", instances: int = 1,
                 max_padding: float = float("inf")):
        self.hooks = hooks
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.max_queue_size = max_queue_size
        self.max_queue_delay_s = max_queue_delay_s
        self.max_padding = 1.0 + max_padding  # padded tokens per real token a batch may have
        self._queue: deque[Item] = deque()  # submitted, not yet tokenized
        self._pending: list[Item] = []  # tokenized, waiting for a batch
        self._queued = 0  # inputs submitted and not yet taken into a batch
        self._running = 0  # batches being executed now
        # Moving average of the work an arriving request finds in the server (queued inputs +
        # running batches): 0 for one client at a time, about 1 for two, more under load.
        self._load = 0.0
        # One lock; each instance thread waits on a condition of its own, so that new work wakes
        # the thread that went idle *last* (its caches are warm; the shared ORT session's pool saw
        # it last). One shared condition wakes the longest-idle one, and at one client the two
        # threads then take turns: c=1 p99 12.9-19.5 ms that way, 8.7-12.8 ms this way (A/B, 4 rounds).
        self._lock = threading.Lock()
        self._wake = [threading.Condition(self._lock) for _ in range(instances)]
        self._idle: list[int] = []  # instances waiting for work, the most recently idle last
        self._delaying: set[int] = set()  # instances holding a batch open for max_queue_delay
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._done_lock = threading.Lock()  # job bookkeeping: batches of one job may run in parallel
        self._threads = [threading.Thread(target=self._serve, args=(k,), name=f"engine-{name}-{k}", daemon=True)
                         for k in range(instances)]

    # -- event loop side -------------------------------------------------------------------
    def start(self) -> None:
        for t in self._threads:
            t.start()

    @property
    def queued(self) -> int:
        return self._queued

    @property
    def full(self) -> bool:
        """No input fits in the queue now (a check without the lock: ``submit`` decides)."""
        return self._queued >= self.max_queue_size

    def submit(self, items: list[Item]) -> None:
        """Queue a job's inputs, or raise OverloadedError at once when the queue is full."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        with self._lock:
            if self._stopping:
                raise OverloadedError("the server is shutting down")
            if self._queued + len(items) > self.max_queue_size:
                raise OverloadedError(f"queue full ({self._queued} inputs waiting); retry later")
            self._load += LOAD_SMOOTHING * (self._queued + self._running - self._load)
            self._queued += len(items)
            self._queue.extend(items)
            self._wake_one()
            if self._delaying and len(self._queue) + len(self._pending) >= self.max_batch_size:
                for k in self._delaying:  # a batch held open is full: run it now
                    self._wake[k].notify()

    def stop(self, timeout: float | None = None) -> None:
        """Finish everything already queued, then end the engine threads."""
        with self._lock:
            self._stopping = True
            self._wake_all()
        for t in self._threads:
            t.join(timeout)

    def _wake_one(self) -> None:
        """(Lock held.) Wake the most recently idle instance, if any is idle."""
        if self._idle:
            self._wake[self._idle.pop()].notify()

    def _wake_all(self) -> None:
        for cond in self._wake:
            cond.notify_all()

    # -- engine threads --------------------------------------------------------------------
    def _serve(self, instance: int) -> None:
        while True:
            new = self._take(instance)
            if new is None:
                return
            finished: list[Job] = []
            timing = None
            try:
                tokenized = self._tokenize(new, finished) if new else []
                batch, alone = self._form_batch(tokenized, finished)
                if batch:
                    try:
                        timing = self._execute(batch, finished, instance, alone)
                    finally:
                        with self._lock:
                            self._running -= 1
            except Exception:  # a bug: never let an engine thread die and strand every later request
                log.exception("engine thread error")
            if finished:
                self._resolve(finished)
            if timing is not None:  # after the answers are on their way: metrics cost no latency
                try:
                    self.hooks.observe(batch, *timing)
                except Exception:
                    log.exception("metrics hook failed")

    def _take(self, instance: int) -> list[Item] | None:
        """Block until there is work; return the newly queued items ([] when only tokenized ones
        wait), or None to exit (stopping, and nothing left)."""
        wake = self._wake[instance]
        with self._lock:
            while not self._queue and not self._pending:
                if self._stopping:
                    self._wake_all()  # the other threads exit too
                    return None
                self._idle.append(instance)
                wake.wait()
                if instance in self._idle:  # woken by stop, not by work
                    self._idle.remove(instance)
            if self.max_queue_delay_s > 0:
                first = self._pending[0] if self._pending else self._queue[0]
                deadline = first.job.enqueued + self.max_queue_delay_s
                self._delaying.add(instance)
                while len(self._queue) + len(self._pending) < self.max_batch_size and not self._stopping:
                    left = deadline - time.perf_counter()
                    if left <= 0:
                        break
                    wake.wait(left)
                self._delaying.discard(instance)
            new = list(self._queue)
            self._queue.clear()
            return new

    def _form_batch(self, tokenized: list[Item], finished: list[Job]) -> tuple[list[Item], bool]:
        """Add freshly tokenized inputs to the waiting ones and take this thread's batch:
        its share of what waits when other instances are idle, else up to the budgets."""
        with self._lock:
            waiting = self._pending + tokenized
            now = time.perf_counter()
            for it in waiting:  # expired in the queue: answer 503 now, don't spend compute on it
                if it.job.deadline < now and not it.job.done:
                    self._fail(it.job, it.job.timeout_error or TimeoutError("deadline passed"), finished)
            live = [it for it in waiting if not (it.job.done or it.job.cancelled)]
            self._queued -= len(waiting) - len(live)
            if not live:
                self._pending = []
                return [], False
            share = -(-len(live) // (1 + len(self._idle)))
            batch, self._pending = self._select(live, max_rows=share)
            self._queued -= len(batch)
            # Alone: nothing else runs or waits now (a thread still filing its last batch's metrics
            # is not using a core), and requests have been finding the server idle: with two or more
            # clients a second batch would soon run beside it, and a whole-machine session sharing
            # the cores with another one is slower than two single-threaded ones (measured at 16
            # clients: 345-360 req/s with every idle moment run alone, 390-400 never).
            alone = (not self._pending and not self._queue and self._running == 0
                     and self._load < ALONE_BELOW)
            self._running += 1
            if self._pending:
                self._wake_one()  # an idle instance takes the rest
            return batch, alone

    def _tokenize(self, new: list[Item], finished: list[Job]) -> list[Item]:
        live = [it for it in new if not (it.job.done or it.job.cancelled)]
        errors: Sequence[BaseException | None]
        try:
            errors = self.hooks.tokenize(live)
        except Exception as exc:
            errors = [exc] * len(live)
        for item, error in zip(live, errors):
            if error is not None:
                self._fail(item.job, error, finished)
        # dropped inputs (cancelled, failed) are subtracted from the queue count in _form_batch
        return new

    def _select(self, items: list[Item], max_rows: int | None = None) -> tuple[list[Item], list[Item]]:
        """The oldest input plus its nearest neighbours by length, within the budgets (rows,
        padded tokens, padding) and at most ``max_rows``. Returns (batch, rest). Oldest-first
        anchoring means nothing waits forever; an input too far in length from the oldest waits
        for a batch of its own (on CPU a padded token costs as much as a real one, and batching
        gains little: see ServeSettings.max_padding)."""
        rows = min(self.max_batch_size, max_rows or self.max_batch_size)
        items.sort(key=lambda it: it.length)
        anchor = min(range(len(items)), key=lambda k: items[k].job.enqueued)
        lo = hi = anchor
        width = real = items[anchor].length

        def fits(new_width: int, new_rows: int, new_real: int) -> bool:
            padded = new_width * new_rows
            return padded <= self.max_batch_tokens and padded <= new_real * self.max_padding

        while hi - lo + 1 < rows:
            count = hi - lo + 1
            left_cost = right_cost = None  # padded tokens each candidate would add
            if lo > 0 and fits(width, count + 1, real + items[lo - 1].length):
                left_cost = width - items[lo - 1].length  # shorter: only its own padding
            if hi + 1 < len(items) and fits(items[hi + 1].length, count + 1, real + items[hi + 1].length):
                right_cost = (items[hi + 1].length - width) * count  # longer: pads every row so far
            if left_cost is None and right_cost is None:
                break
            if right_cost is None or (left_cost is not None and left_cost <= right_cost):
                lo -= 1
                real += items[lo].length
            else:
                hi += 1
                width = items[hi].length
                real += width
        return items[lo : hi + 1], items[:lo] + items[hi + 1 :]

    def _execute(self, batch: list[Item], finished: list[Job], instance: int, alone: bool
                 ) -> tuple[list[float], float] | None:
        """Run a batch and file its answers; returns (queue seconds per input, compute seconds)."""
        started = time.perf_counter()
        queue_s = [started - it.job.enqueued for it in batch]
        parts = self._run(batch, instance, alone)
        compute_s = time.perf_counter() - started
        for items, results in parts:
            if isinstance(results, BaseException):
                for item in items:
                    self._fail(item.job, results, finished)
                continue
            with self._done_lock:
                for item, result in zip(items, results):
                    job = item.job
                    if job.done:
                        continue
                    job.results[item.index] = result
                    job.tokens += item.length
                    job.remaining -= 1
                    if job.remaining == 0:
                        job.done = True
                        finished.append(job)
        if all(isinstance(results, BaseException) for _, results in parts):
            return None
        return queue_s, compute_s

    def _run(self, batch: list[Item], instance: int, alone: bool) -> list[tuple[list[Item], list[Any] | BaseException]]:
        """Execute a batch: [(items, their results or the error that failed them)]. If the batch
        fails and holds several requests, each request runs again on its own, so one request the
        engine cannot run (inputs the checks before batching did not catch) fails alone instead
        of failing its neighbours (issue 15)."""
        try:
            return [(batch, self.hooks.execute(batch, instance, alone))]
        except Exception as exc:
            by_job: dict[int, list[Item]] = {}
            for item in batch:
                by_job.setdefault(id(item.job), []).append(item)
            if len(by_job) == 1:
                return [(batch, exc)]
            log.warning("a batch of %d requests failed (%s); running each alone to keep the others' answers",
                        len(by_job), type(exc).__name__)
        parts: list[tuple[list[Item], list[Any] | BaseException]] = []
        for items in by_job.values():
            try:
                parts.append((items, self.hooks.execute(items, instance, False)))
            except Exception as exc:
                parts.append((items, exc))
        return parts

    def _fail(self, job: Job, error: BaseException, finished: list[Job]) -> None:
        with self._done_lock:
            if not job.done:
                job.done = True
                job.results = error  # type: ignore[assignment]  # an ended job's error in place of its answers (_resolve_jobs)
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
