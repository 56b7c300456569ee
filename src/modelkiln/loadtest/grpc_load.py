"""``--protocol grpc``: KServe v2 ``ModelInfer`` over gRPC, for kiln serve's ``--grpc-port`` and
Triton's 8001.

Requests are serialized once, before the run, with tritonclient's generated messages (an
implementation of the protocol independent of the server's: ``protocols.GrpcInfer``), and sent as bytes through
``grpc.aio`` with no per-request (de)serialization: as the HTTP generators send pre-rendered
bytes. Each closed-loop client has its own channel, i.e. its own HTTP/2 connection, as each HTTP
client has its own keep-alive connection. Outcomes are recorded as the HTTP status the server
would have answered over REST (OK → 200, INVALID_ARGUMENT → 400, ...; DEADLINE_EXCEEDED → the
timeout code), so reports and error columns read the same for every protocol."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from urllib.parse import urlsplit

import grpc

from .protocols import GRPC_METHOD
from .records import CONNECT_ERROR, TIMEOUT, StepState

DEFAULT_GRPC_PORT = 8001

_HTTP_EQUIVALENT = {
    grpc.StatusCode.OK: 200, grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.UNIMPLEMENTED: 405, grpc.StatusCode.RESOURCE_EXHAUSTED: 503,
    grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.INTERNAL: 500, grpc.StatusCode.DEADLINE_EXCEEDED: TIMEOUT,
}


def grpc_target(http_url: str, grpc_url: str | None) -> str:
    """``host:port`` of the gRPC endpoint: ``--grpc-url``, else the HTTP URL's host on 8001."""
    if grpc_url:
        return grpc_url.removeprefix("grpc://")
    host = urlsplit(http_url).hostname or "127.0.0.1"
    return f"{host}:{DEFAULT_GRPC_PORT}"


def open_channel(target: str) -> grpc.aio.Channel:
    """A channel (one HTTP/2 connection) for ModelInfer calls to ``target`` (``host:port``)."""
    # A local subchannel pool: without it every channel to one target shares one connection.
    return grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1),
                                                      ("grpc.max_receive_message_length", 256 * 1024 * 1024)])


async def _send(call: grpc.aio.UnaryUnaryMultiCallable, state: StepState, metadata: tuple[tuple[str, str], ...],
                timeout: float, start: float | None = None) -> int:
    """One ModelInfer call, recorded (and checked under --check) → its HTTP-equivalent code."""
    index, raw = state.next_indexed()
    state.sent += 1
    start = time.perf_counter() if start is None else start
    try:
        answer = await call(raw, timeout=timeout, metadata=metadata or None)
        state.record_answer(start, time.perf_counter(), 200, index, answer)
        return 200
    except grpc.aio.AioRpcError as exc:
        code = _HTTP_EQUIVALENT.get(exc.code(), CONNECT_ERROR)
        state.record(start, time.perf_counter(), code)
        return code


def call_metadata(headers: Sequence[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    """``--header`` pairs as gRPC call metadata (lower-case keys; HTTP's body headers left out)."""
    return tuple((k.lower(), v) for k, v in headers if k.lower() not in ("content-type", "content-length"))


async def closed_loop(state: StepState, target: str, headers: Sequence[tuple[str, str]], timeout: float) -> None:
    """One client: its own channel, requests back to back until the step stops."""
    async with open_channel(target) as channel:
        call = channel.unary_unary(GRPC_METHOD)  # bytes in, bytes out: no (de)serializer
        metadata = call_metadata(headers)
        while not state.stop:
            code = await _send(call, state, metadata, timeout)
            if code == CONNECT_ERROR:
                await asyncio.sleep(0.01)  # a dead server must not turn the loop into a busy spin


async def open_loop(state: StepState, target: str, headers: Sequence[tuple[str, str]], timeout: float, limit: int,
                    in_flight: set[asyncio.Task[None]]) -> None:
    """Poisson arrivals (as ``generators.open_loop``), at most ``limit`` outstanding, multiplexed
    over a few channels; an arrival that waits for a free slot counts from its scheduled time."""
    channels = [open_channel(target) for _ in range(min(limit, 8))]
    calls = [c.unary_unary(GRPC_METHOD) for c in channels]
    slots = asyncio.Semaphore(limit)
    metadata = call_metadata(headers)

    async def one(k: int, start: float | None) -> None:
        try:
            await _send(calls[k % len(calls)], state, metadata, timeout, start)
        finally:
            slots.release()

    try:
        k = 0
        while not state.stop:
            scheduled = state.next_arrival()
            delay = scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            await slots.acquire()
            if state.stop:
                slots.release()
                break
            late = time.perf_counter() - scheduled
            waited = delay <= 0 or late >= 2e-3
            state.lags.append(late if waited else 0.0)
            task = asyncio.create_task(one(k, scheduled if waited else None))
            k += 1
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
    finally:
        if in_flight:
            await asyncio.wait(list(in_flight), timeout=timeout + 5)
        for c in channels:
            await c.close()
