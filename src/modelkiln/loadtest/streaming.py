"""Streaming text generation under load: request bodies for the three generation protocols, and
a client that timestamps every server-sent event as it arrives (into a ``records.StreamRecord``).

- ``openai-chat``: ``POST /v1/chat/completions``, the prompt as one user message;
- ``openai-completions``: ``POST /v1/completions``;
- ``generate``: Triton's generate extension, ``POST /v2/models/{m}/generate_stream`` with
  ``{"text_input", "parameters": {"max_tokens", "temperature", "ignore_eos"}}``.

Every request streams (OpenAI with ``stream_options.include_usage``) and is greedy
(``temperature: 0``), so that ``--check`` can compare each answer with its prompt's reference.

The client is the load generator's own small HTTP/1.1 client (``client.py``) grown by what a
stream needs: the response body is decoded as it arrives (chunked or not), cut into SSE events
on blank lines, and each event is parsed and stamped with ``time.perf_counter()`` when its last
byte arrives. A *token chunk* is an event that adds text; time to first token is the first of
them, inter-token latencies are the gaps between consecutive ones (a chunk may carry more than
one token when the server held some back, e.g. a possible stop string)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from ..errors import KilnError
from .client import closed_unanswered
from .inputs import Item
from .protocols import GENERATION_PROTOCOLS, PreparedRequest
from .records import CONNECT_ERROR, MID_STREAM_CODE, StepState, StreamRecord, error_code


def is_generation(protocol: str) -> bool:
    return protocol in GENERATION_PROTOCOLS


def prompt_text(item: Item) -> str:
    """One prompt from a text item: a SQuAD (question, context) pair reads as a reading-comprehension
    request; any other pair (a tab in a file line) is joined by a newline."""
    if isinstance(item, str):
        return item
    first, second = item
    return f"{second}\n\nQuestion: {first}" if len(second) > len(first) else f"{first}\n{second}"


# Sampled traffic as most users send it: OpenAI's and llama-server's own fields, and a seed per prompt
# so that every answer is reproducible (kiln serve's draws depend only on the seed and the token's index).
SAMPLED = {"temperature": 0.7, "top_p": 0.95}


@dataclass(frozen=True)
class GenerationRequest:
    protocol: str
    model: str
    max_tokens: int | None = None  # None: the server's default (natural lengths up to it)
    ignore_eos: bool = False
    extra: tuple[tuple[str, Any], ...] = ()  # more request fields (genai-perf's --extra-inputs): a response_format...
    sampled: bool = False  # SAMPLED's settings with the prompt's index as its seed, else greedy

    def build(self, prompt: str, index: int = 0) -> PreparedRequest:
        sampling: dict[str, Any] = {**SAMPLED, "seed": index} if self.sampled else {"temperature": 0}
        if self.max_tokens is not None:
            sampling["max_tokens"] = self.max_tokens
        if self.ignore_eos:  # a vLLM extension that kiln serve and llama.cpp accept; not sent unless asked
            sampling["ignore_eos"] = True
        sampling.update(self.extra)
        if self.protocol == "generate":
            path = f"/v2/models/{self.model}/generate_stream"
            # "stream": Triton's decoupled models (its vLLM backend, `kiln triton`'s) send one response per
            # token only when asked, else the whole answer as one event; kiln serve's route always streams
            body: dict[str, Any] = {"text_input": prompt, "parameters": {**sampling, "stream": True}}
        else:
            chat = self.protocol == "openai-chat"
            path = "/v1/chat/completions" if chat else "/v1/completions"
            body = {"model": self.model, **({"messages": [{"role": "user", "content": prompt}]} if chat
                                            else {"prompt": prompt}),
                    **sampling, "stream": True, "stream_options": {"include_usage": True}}
        return PreparedRequest(path, json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode(),
                               (("Content-Type", "application/json"), ("Accept", "text/event-stream")), 1)


class StreamConnection(asyncio.Protocol):
    """One keep-alive connection that reads a streamed response as it arrives. One request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.buf = bytearray()
        self._record: StreamRecord | None = None
        self._done: asyncio.Future[int] | None = None
        self.answered = 0  # whole responses read on this connection
        self._reset()

    def _reset(self) -> None:
        self.buf.clear()
        self.received = False  # any byte of this request's answer
        self.status = 0
        self.head_done = False
        self.chunked = False
        self.remaining: int | None = None  # Content-Length left to read, when given
        self.close_after = False
        self.sse = bytearray()  # body bytes not yet cut into events
        self.error_body = bytearray()

    @classmethod
    async def open(cls, host: str, port: int) -> StreamConnection:
        _, conn = await asyncio.get_running_loop().create_connection(cls, host, port)
        return conn

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a TCP connection's: create_connection made it

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._done is not None and not self._done.done():
            if self.head_done and self.remaining is None and not self.chunked and exc is None:
                self._finish()  # a body that ends when the server closes
            else:
                self._done.set_exception(ConnectionError("connection closed by the server"))

    def data_received(self, data: bytes) -> None:
        if self._done is None or self._done.done():
            return
        self.received = True
        self.buf += data
        try:
            self._parse(time.perf_counter())
        except Exception as exc:  # a malformed response: fail the request, drop the connection
            self.abort()
            if not self._done.done():
                self._done.set_exception(ConnectionError(f"bad HTTP response: {exc}"))

    def _parse(self, now: float) -> None:
        if not self.head_done:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.buf[:end]).lower()
            del self.buf[:end + 4]
            self.status = int(head[9:12])
            self.head_done = True
            self.close_after = b"\nconnection: close" in head
            self.chunked = b"\ntransfer-encoding: chunked" in head
            i = head.find(b"\ncontent-length:")
            if i >= 0 and not self.chunked:
                j = head.find(b"\r", i + 16)
                self.remaining = int(head[i + 16: j if j >= 0 else None])
        if self.chunked:
            while True:
                line_end = self.buf.find(b"\r\n")
                if line_end < 0:
                    return
                size = int(bytes(self.buf[:line_end]).split(b";")[0], 16)
                if size == 0:
                    if self.buf.find(b"\r\n\r\n", line_end) < 0:  # the trailers' end (usually no trailers)
                        return
                    self._finish()
                    return
                if len(self.buf) < line_end + 2 + size + 2:
                    return
                self._body(bytes(self.buf[line_end + 2: line_end + 2 + size]), now)
                del self.buf[:line_end + 2 + size + 2]
        elif self.remaining is not None:
            take = bytes(self.buf[:self.remaining])
            del self.buf[:len(take)]
            self.remaining -= len(take)
            self._body(take, now)
            if self.remaining == 0:
                self._finish()
        else:
            self._body(bytes(self.buf), now)
            self.buf.clear()

    def _body(self, data: bytes, now: float) -> None:
        if self.status != 200:
            self.error_body += data
            return
        self.sse += data.replace(b"\r\n", b"\n") if b"\r" in data else data
        assert self._record is not None
        while (i := self.sse.find(b"\n\n")) >= 0:
            event = bytes(self.sse[:i])
            del self.sse[:i + 2]
            if event.strip(b"\n"):
                self._record.event(event.lstrip(b"\n"), now)

    def _finish(self) -> None:
        assert self._record is not None and self._done is not None
        if self.status == 200 and self.sse.strip():
            self._record.framing.append(f"the stream ended inside an event (no blank line after it): "
                                        f"{bytes(self.sse[:80])!r}")
            self._record.event(bytes(self.sse).strip(b"\n"), time.perf_counter())  # still read it
        self.answered += 1
        if self.close_after:
            self.abort()
        if not self._done.done():
            self._done.set_result(self.status)

    async def stream(self, raw: bytes, record: StreamRecord, timeout: float) -> int:
        """Send pre-rendered bytes, read the answer into ``record`` → the HTTP status.
        Raises ConnectionError / TimeoutError (the connection is then unusable)."""
        if self.closed or self.transport is None:
            raise ConnectionError("connection is closed")
        self._reset()
        self._record = record
        self._done = asyncio.get_running_loop().create_future()
        self.transport.write(raw)
        try:
            return await asyncio.wait_for(asyncio.shield(self._done), timeout)
        except asyncio.TimeoutError:
            self._done.cancel()  # nobody waits for it any more
            self.abort()
            raise TimeoutError("no complete answer in time") from None
        finally:
            self._record = None

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


def outcome_code(status: int, record: StreamRecord) -> int:
    """The code a finished stream is recorded with: its HTTP status, or MID_STREAM_CODE when a 200 stream
    carried an error event or ended before the protocol's end (finish reason / [DONE])."""
    if status == 200 and not record.complete:
        return MID_STREAM_CODE
    return status


async def send_stream(state: StepState, conn: StreamConnection | None, host: str, port: int, timeout: float,
                      start: float | None = None) -> StreamConnection | None:
    """One streamed request on ``conn`` (opened if needed), recorded into ``state`` with its
    StreamRecord (and its --check verdict), timed from ``start`` (default: when it is sent)
    → the connection to reuse (None after a failure).

    A kept-alive connection that the server closed before answering a byte (``client.closed_unanswered``)
    is not the server failing the request: it is sent once more on a new connection, timed from the
    first try."""
    index, raw = state.next_indexed()
    first_start = start
    for attempt in (1, 2):
        record = StreamRecord(state.protocol)
        try:
            if conn is None or conn.closed:
                conn = await asyncio.wait_for(StreamConnection.open(host, port), timeout)
            if attempt == 1:
                state.sent += 1
            record.start = first_start = time.perf_counter() if first_start is None else first_start
            code = outcome_code(await conn.stream(raw, record, timeout), record)
            break
        except (TimeoutError, ConnectionError, OSError, asyncio.TimeoutError) as exc:
            stale = conn is not None and closed_unanswered(conn, exc)
            if conn is not None:
                conn.abort()  # its answer may still come: never reuse it
            conn = None
            if stale and attempt == 1:
                continue
            code = error_code(exc)
            break
    record.end = time.perf_counter()
    if not record.start:
        record.start = record.end if first_start is None else first_start
    state.record_stream(index, record, code)
    return conn


async def closed_loop(state: StepState, host: str, port: int, timeout: float) -> None:
    """One client on one keep-alive connection, streams back to back until the step stops."""
    conn: StreamConnection | None = None
    while not state.stop:
        conn = await send_stream(state, conn, host, port, timeout)
        if conn is None and state.codes[-1] == CONNECT_ERROR:
            await asyncio.sleep(0.01)  # a dead server must not turn the loop into a busy spin
    if conn is not None:
        conn.abort()


async def reference(host: str, port: int, raw: bytes, protocol: str, timeout: float) -> tuple[int, StreamRecord]:
    """One request alone on a fresh connection (``--check``'s reference answers)."""
    record = StreamRecord(protocol)
    try:
        conn = await asyncio.wait_for(StreamConnection.open(host, port), timeout)
    except (OSError, asyncio.TimeoutError) as exc:
        raise KilnError(f"cannot connect to {host}:{port}: {exc}") from None
    try:
        record.start = time.perf_counter()
        status = await conn.stream(raw, record, timeout)
        record.end = time.perf_counter()
    except (ConnectionError, TimeoutError) as exc:
        raise KilnError(f"a reference request failed: {exc}") from None
    finally:
        conn.abort()
    return status, record


def build_requests(protocol: str, model: str, items: Sequence[Item], max_tokens: int | None,
                   ignore_eos: bool, extra: Sequence[tuple[str, Any]] = (), sampled: bool = False) -> list[PreparedRequest]:
    builder = GenerationRequest(protocol, model, max_tokens, ignore_eos, tuple(extra), sampled)
    return [builder.build(prompt_text(item), i) for i, item in enumerate(items)]
