"""The two load generators of a step.

- Closed loop (``concurrency=N``): N clients, each with its own keep-alive connection, send
  back to back. Throughput is what the server sustains at N outstanding requests.
- Open loop (``rate=R``): arrivals at Poisson times (exponential gaps, seeded) are taken in order
  by whichever connection is free (up to ``max_connections``). When every connection is busy an
  arrival waits, and its latency counts from its *scheduled* time, so a slow server cannot
  hide its queueing by slowing the client down (coordinated omission). When a connection was
  idle, latency counts from the actual send: the ≤1 ms timer jitter of the event loop is the
  client's, not the server's.

Both record into one ``StepState``; ``runner.run_step`` reads it window by window."""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from .client import Connection, Outcome, closed_unanswered
from .records import CONNECT_ERROR, StepState, error_code

# sends one request on a connection (None: open one), records it from start (None: from the send)
# and returns the connection to reuse
Sender = Callable[["StepState", Any, str, int, float, "float | None"], Awaitable[Any]]


async def send_one(state: StepState, conn: Connection | None, host: str, port: int, timeout: float,
                   start: float | None = None) -> Connection | None:
    """One request on ``conn`` (opened if needed), recorded into ``state`` with its latency from
    ``start`` (default: when it is sent) → the connection to reuse."""
    index, raw = state.next_indexed()
    for attempt in (1, 2):  # a second time only on a new connection, after client.closed_unanswered
        try:
            if conn is None or conn.closed:
                conn = await asyncio.wait_for(Connection.open(host, port), timeout)
                conn.keep_body = state.checker is not None
            if attempt == 1:
                state.sent += 1
            start = time.perf_counter() if start is None else start
            response = await conn.request(raw, timeout)
            state.record_answer(start, time.perf_counter(), response.status, index, response.body)
            return conn
        except (TimeoutError, ConnectionError, OSError, asyncio.TimeoutError) as exc:
            again = attempt == 1 and conn is not None and closed_unanswered(conn, exc)
            if conn is not None:
                conn.abort()  # its response may still come: never reuse it
            conn = None
            if not again:
                state.record(time.perf_counter() if start is None else start, time.perf_counter(), error_code(exc))
                return None
    return None


class ClosedLoop:
    """One closed-loop client on one keep-alive connection. Each response sends the next request
    from the connection's own callback, as wrk does: no task, future or timer per request, so the
    client's CPU per request is parsing one response and writing the next request. (On a small
    machine every microsecond the client spends is taken from the server it measures.)"""

    def __init__(self, state: StepState, host: str, port: int, timeout: float):
        self.state = state
        self.host, self.port, self.timeout = host, port, timeout
        self.conn: Connection | None = None
        self.started = 0.0
        self.index = 0  # of the request in flight
        self.raw = b""
        self.last_code = 0
        self._again = False  # the next _fire sends the last request again (client.closed_unanswered)
        self._retried = False  # the request in flight is already a second try
        self._chain: asyncio.Future[None] | None = None

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self.state.stop:
            if self.conn is None or self.conn.closed:
                start = time.perf_counter()
                try:
                    self.conn = await asyncio.wait_for(Connection.open(self.host, self.port), self.timeout)
                    self.conn.keep_body = self.state.checker is not None  # --check reads every answer
                except (OSError, asyncio.TimeoutError):
                    self.state.record(self.started if self._again else start, time.perf_counter(), CONNECT_ERROR)
                    self._again = False  # that request has its answer now: a connection error
                    await asyncio.sleep(0.01)  # a dead server must not turn the loop into a busy spin
                    continue
            self._chain = loop.create_future()
            self._fire()
            await self._chain  # until the chain of requests ends: stop, an error, or a closed connection
            if self.last_code == CONNECT_ERROR:
                await asyncio.sleep(0.01)
        if self._again:  # the step ended before the second try: the request was never answered
            self.state.sent -= 1
        if self.conn is not None:
            self.conn.abort()

    def expire(self, now: float) -> None:
        """The step's watchdog: fail the request in flight if it is overdue."""
        if self.conn is not None and self.conn.busy and now - self.started > self.timeout:
            self.conn.fail(TimeoutError("no response in time"))

    def _fire(self) -> None:
        assert self.conn is not None
        self._retried, again = self._again, self._again
        self._again = False
        if not again:  # a second try keeps its request, its count and its start time
            self.state.sent += 1
            self.started = time.perf_counter()
            self.index, self.raw = self.state.next_indexed()
        self.conn.send(self.raw, self._done)

    def _done(self, outcome: Outcome) -> None:
        end = time.perf_counter()
        assert self.conn is not None
        if not self._retried and closed_unanswered(self.conn, outcome):
            self.conn.abort()
            self._again = True  # run() opens a new connection and _fire sends this request again
            self.last_code = 0
            if self._chain is not None and not self._chain.done():
                self._chain.set_result(None)
            return
        if isinstance(outcome, BaseException):
            self.last_code = error_code(outcome)
            self.conn.abort()  # its response may still come: never reuse it
            self.state.record(self.started, end, self.last_code)
        else:
            self.last_code = outcome.status
            self.state.record_answer(self.started, end, self.last_code, self.index, outcome.body)
        if not (self.state.stop or self.conn.closed):
            self._fire()
        elif self._chain is not None and not self._chain.done():
            self._chain.set_result(None)


async def watchdog(loops: Sequence[ClosedLoop], timeout: float) -> None:
    """One timer for all closed-loop connections instead of one per request."""
    while True:
        await asyncio.sleep(min(0.1, timeout / 10))
        now = time.perf_counter()
        for c in loops:
            c.expire(now)


class Pool:
    """Keep-alive connections for the open loop, reused last-in first-out so a low rate keeps
    reusing one warm connection instead of opening a cold one per request."""

    def __init__(self, limit: int):
        self.limit = limit
        self.opened = 0
        self.idle: list[Any] = []  # None: a slot whose connection must be (re)opened
        self.waiters: collections.deque[asyncio.Future[Any]] = collections.deque()

    async def acquire(self) -> Any:
        if self.idle:
            return self.idle.pop()
        if self.opened < self.limit:
            self.opened += 1
            return None
        waiter = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        return await waiter

    def release(self, conn: Any) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(conn)
                return
        self.idle.append(conn)

    def close(self) -> None:
        for conn in self.idle:
            if conn is not None:
                conn.abort()


async def open_loop(state: StepState, host: str, port: int, timeout: float, limit: int,
                    in_flight: set[asyncio.Task[None]], send: Sender = send_one) -> None:
    """Fire arrivals at their Poisson times, each on a free connection (its own task); ``send``
    sends and records one request (``send_one``, or ``streaming.send_stream`` for generation)."""
    pool = Pool(limit)

    async def one(conn: Any, start: float | None) -> None:
        pool.release(await send(state, conn, host, port, timeout, start))

    try:
        while not state.stop:
            scheduled = state.next_arrival()
            delay = scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            conn = await pool.acquire()
            if state.stop:
                pool.release(conn)
                break
            late = time.perf_counter() - scheduled
            if delay > 0 and late < 2e-3:
                start = None  # on time up to the event loop's timer resolution: that jitter is ours
                state.lags.append(0.0)
            else:
                start = scheduled  # every connection was busy: the wait is part of the latency
                state.lags.append(late)
            task = asyncio.create_task(one(conn, start))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
    finally:
        if in_flight:
            await asyncio.wait(list(in_flight), timeout=timeout + 5)
        pool.close()
