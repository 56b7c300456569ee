"""A minimal HTTP/1.1 keep-alive client on asyncio, for the load generator's hot loop.

Why not httpx/aiohttp: each request there costs 100-300 µs of Python (request objects, header
dicts, response objects), which on a small machine is the same order as a small model's
server-side time, and the client would become what is measured. Here a request is one
``transport.write`` of pre-rendered bytes and the response is parsed just enough to find its end
(status line, Content-Length or chunked) — about 15-30 µs with uvloop. Nothing else is supported
(no redirects, no TLS, no HTTP/2): this talks to inference servers on a network you control."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar, cast
from urllib.parse import urlsplit

from ..errors import KilnError

T = TypeVar("T")


def parse_url(url: str) -> tuple[str, int, str]:
    """``http://host:port/prefix`` → (host, port, prefix without trailing slash)."""
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    if parts.scheme != "http":
        raise KilnError(f"only http:// URLs are supported, got '{url}'")
    if not parts.hostname:
        raise KilnError(f"no host in URL '{url}'")
    return parts.hostname, parts.port or 80, parts.path.rstrip("/")


def render_request(method: str, host: str, port: int, path: str, body: bytes,
                   headers: Iterable[tuple[str, str]] = ()) -> bytes:
    """The whole request as bytes, rendered once before the run."""
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}", f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class _Response:
    __slots__ = ("status", "close", "body")

    def __init__(self, status: int, close: bool, body: bytes):
        self.status = status
        self.close = close
        self.body = body


Outcome = _Response | BaseException


def closed_unanswered(conn: Any, outcome: object) -> bool:
    """The server closed a kept-alive connection (one that has answered before) before a byte of
    the request's answer; ``conn`` is a ``Connection`` or a ``streaming.StreamConnection``.
    Servers close idle connections (llama-server after every streamed answer, without
    ``connection: close``), and such a close can cross the next request on the wire: that is no
    answer from the server, and HTTP clients send the request again on a new connection."""
    return isinstance(outcome, ConnectionError) and conn.answered > 0 and not conn.received


class Connection(asyncio.Protocol):
    """One keep-alive connection; one request at a time (no pipelining, like a real client).

    ``send`` is callback-driven (the closed loop chains requests from the callback, as wrk does:
    no future, task or timer per request); ``request`` wraps it for code that awaits."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.closed = False
        self.keep_body = False
        self.until_close: tuple[int, int] | None = None  # (status, body start) of a body read to EOF
        self.answered = 0  # whole responses read on this connection
        self.received = False  # any byte of the answer to the request in flight
        self._done: Callable[[Outcome], None] | None = None  # set while a request is in flight

    @classmethod
    async def open(cls, host: str, port: int) -> Connection:
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(cls, host, port)  # asyncio/uvloop set TCP_NODELAY
        return conn

    @property
    def busy(self) -> bool:
        return self._done is not None

    # -- asyncio.Protocol --------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a TCP connection's: create_connection made it

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self.received = True
        if self._done is None:
            return
        try:
            response = self._parse()
        except Exception as exc:  # a malformed response: fail the request, drop the connection
            self.abort()
            self._finish(ConnectionError(f"bad HTTP response: {exc}"))
            return
        if response is not None:
            self.answered += 1
            if response.close:
                self.abort()
            self._finish(response)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._done is not None:
            if self.until_close is not None and exc is None:
                status, start = self.until_close
                self._finish(_Response(status, True, bytes(self.buf[start:])))
            else:
                self._finish(ConnectionError("connection closed by the server"))

    # -- parsing -------------------------------------------------------------------------------
    def _parse(self) -> _Response | None:
        buf = self.buf
        head_end = buf.find(b"\r\n\r\n")
        if head_end < 0:
            return None
        head = bytes(buf[:head_end]).lower()
        status = int(head[9:12])
        start = head_end + 4
        close = b"\nconnection: close" in head
        i = head.find(b"\ncontent-length:")
        if i >= 0:
            j = head.find(b"\r", i + 16)
            length = int(head[i + 16: j if j >= 0 else None])
            end = start + length
            if len(buf) < end:
                return None
            body = bytes(buf[start:end]) if self.keep_body else b""
            del buf[:end]
            return _Response(status, close, body)
        if b"\ntransfer-encoding: chunked" in head:
            pos = start
            parts: list[bytes] = []
            while True:
                line_end = buf.find(b"\r\n", pos)
                if line_end < 0:
                    return None
                size = int(bytes(buf[pos:line_end]).split(b";")[0], 16)
                if size == 0:
                    trailer_end = buf.find(b"\r\n\r\n", line_end)  # trailers (usually none)
                    if trailer_end < 0:
                        return None
                    del buf[:trailer_end + 4]
                    return _Response(status, close, b"".join(parts))
                if len(buf) < line_end + 2 + size + 2:
                    return None
                if self.keep_body:
                    parts.append(bytes(buf[line_end + 2: line_end + 2 + size]))
                pos = line_end + 2 + size + 2
        if status in (204, 304) or 100 <= status < 200:
            del buf[:start]
            return _Response(status, close, b"")
        # no length: the body ends when the server closes (HTTP/1.0 style; Triton's metrics port)
        self.until_close = (status, start)
        return None

    # -- use -------------------------------------------------------------------------------------
    def send(self, raw: bytes, done: Callable[[Outcome], None]) -> None:
        """Send pre-rendered bytes; ``done`` is called once, on the event loop, with the whole
        response or the exception that ended the request (the connection is then unusable)."""
        if self.closed or self.transport is None:
            done(ConnectionError("connection is closed"))
            return
        self._done = done
        self.received = bool(self.buf)  # bytes already here belong to this answer
        self.transport.write(raw)


    def fail(self, exc: BaseException) -> None:
        """End the request in flight with ``exc`` (a client-side timeout) and drop the connection."""
        self.abort()
        self._finish(exc)

    def _finish(self, outcome: Outcome) -> None:
        done, self._done = self._done, None
        if done is not None:
            done(outcome)

    async def request(self, raw: bytes, timeout: float) -> _Response:
        """Send pre-rendered bytes, wait for the whole response. Raises ConnectionError/TimeoutError."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[_Response] = loop.create_future()

        def done(outcome: Outcome) -> None:
            if not waiter.done():
                if isinstance(outcome, BaseException):
                    waiter.set_exception(outcome)
                else:
                    waiter.set_result(outcome)

        self.send(raw, done)
        handle = loop.call_later(timeout, self.fail, TimeoutError("no response in time"))
        try:
            return await waiter
        finally:
            handle.cancel()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


async def fetch(url: str, timeout: float = 10.0, method: str = "GET", body: bytes = b"",
                headers: Iterable[tuple[str, str]] = ()) -> tuple[int, bytes]:
    """One request on a fresh connection (metadata, /metrics): (status, body)."""
    host, port, prefix = parse_url(url)
    split = urlsplit(url if "://" in url else "http://" + url)
    path = (split.path or "/") + (f"?{split.query}" if split.query else "")
    try:
        conn = await asyncio.wait_for(Connection.open(host, port), timeout)
    except (OSError, asyncio.TimeoutError) as exc:
        raise KilnError(f"cannot connect to {host}:{port}: {exc}") from None
    conn.keep_body = True
    try:
        response = await conn.request(render_request(method, host, port, path, body, headers), timeout)
    except (ConnectionError, TimeoutError) as exc:
        raise KilnError(f"{method} {url} failed: {exc}") from None
    finally:
        conn.abort()
    return response.status, response.body


def run_async(factory: Callable[[], Awaitable[T]]) -> T:
    """Run a coroutine on uvloop when installed (2-3x less loop overhead), else on asyncio's loop."""
    try:
        import uvloop

        loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(factory())
    finally:
        loop.close()
