"""uvicorn's HTTP protocol with a bound added and its writes coalesced.

A response leaves in one write. uvicorn writes a response's head and its body separately, and
uvloop sends each at once: two system calls and two TCP segments per answer, each waking the
client, with the interpreter lock held through both (under load, ~37% of the event loop's time
with the lock was in those two writes: py-spy ``--gil``). ``CoalescingTransport`` joins what one
turn of the event loop writes to a connection and sends it at the end of the turn.

A request's head (request line and headers) must arrive within the body-read timeout.

uvicorn times nothing out before a request's headers are complete: its keep-alive timer is
cancelled by the first byte of the next request and runs only between answered requests. A
connection that sends half a request line and goes silent, or connects and sends nothing, was
held open indefinitely (the fault suite, tests/reliability/fault_suite.py: "stalled-headers" and
"silent-connection" still open after 30 s); each holds a socket, and such a request never reaches
the ASGI app, so ``RequestWatch`` (which bounds the body) cannot see it. Here a timer starts with
a new connection and with the first bytes of each new request; if no request head has been
parsed when it fires, the connection gets a 408 (nothing, if it sent nothing) and is closed."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson


class CoalescingTransport:
    """A transport whose writes within one turn of the event loop go out as one write at its end
    (``close`` first sends what is pending). Everything else is the transport's own."""

    __slots__ = ("_transport", "_loop", "_pending")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop):
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(data)

    def _flush(self) -> None:
        if not self._pending:
            return
        data = self._pending[0] if len(self._pending) == 1 else b"".join(self._pending)
        self._pending = []
        if not self._transport.is_closing():
            self._transport.write(data)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def bounded_head_protocol(timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's default HTTP protocol class (httptools, else h11) with the head timeout."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    body = orjson.dumps({"error": f"request head not received within {timeout_s:g}s"})
    answer = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
              b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)

    class BoundedHeadProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]  # a variable: httptools' class or h11's
        _head_timer: asyncio.TimerHandle | None = None
        _head_cycle: Any = None  # the last request parsed when the timer was armed
        _head_bytes = False  # bytes of the request being waited for have arrived

        def connection_made(self, transport: Any) -> None:
            super().connection_made(CoalescingTransport(transport, self.loop))
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self.cycle is None or self.cycle.response_complete:  # no request in progress: a new one begins
                self._head_bytes = True
                if self._head_timer is None or self._head_cycle is not self.cycle:  # not per byte: a trickle
                    self._arm()  # must not extend its own deadline
            super().data_received(data)

        def connection_lost(self, exc: Exception | None) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_cycle = self.cycle
            self._head_timer = self.loop.call_later(timeout_s, self._head_late, self.cycle)

        def _head_late(self, cycle_then: Any) -> None:
            self._head_timer = None
            if self.cycle is not cycle_then or self.transport.is_closing():
                self._head_bytes = False  # a request head arrived in time (the body is RequestWatch's)
                return
            if self._head_bytes:
                self.transport.write(answer)
            self.transport.close()

    return BoundedHeadProtocol
