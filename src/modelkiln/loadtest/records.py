"""What a load step records, shared by the load generators (``generators.py``, ``grpc_load.py``,
``streaming.py``), the step runner and ``--check``: the codes recorded for requests with no HTTP
answer, one streamed answer as received (``StreamRecord``), and the step's record of every
request (``StepState``). Imports nothing else of the load tester, so that any of them can."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

CONNECT_ERROR = 0  # status code recorded for requests that got no HTTP answer
TIMEOUT = -1
MID_STREAM_CODE = -2  # a stream that began (200), then carried an error event or was cut short


def error_code(exc: BaseException) -> int:
    """The code recorded for a request that got no HTTP answer: TIMEOUT if none came in time,
    CONNECT_ERROR otherwise (refused, reset, closed, malformed)."""
    return TIMEOUT if isinstance(exc, TimeoutError) else CONNECT_ERROR


def status_name(code: int) -> str:
    return {CONNECT_ERROR: "connection", TIMEOUT: "timeout", MID_STREAM_CODE: "mid-stream"}.get(code, str(code))


@dataclass
class StreamRecord:
    """What one streamed answer was, as received."""

    protocol: str
    start: float = 0.0
    end: float = 0.0
    token_times: list[float] = field(default_factory=list)  # arrival of each event that added text
    pieces: list[str] = field(default_factory=list)
    completion_tokens: int | None = None  # as the server reports it (OpenAI usage; kiln's generate_stream)
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    done: bool = False  # OpenAI's ``data: [DONE]`` arrived
    events_after_done: int = 0
    error: str | None = None  # an error event mid-stream
    framing: list[str] = field(default_factory=list)  # SSE framing faults, in words

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def output_tokens(self) -> int:
        """The server's count when it gives one, else the token chunks counted."""
        return self.completion_tokens if self.completion_tokens is not None else len(self.token_times)

    @property
    def complete(self) -> bool:
        """Ended as the protocol says a stream ends, without an error event. OpenAI: with
        ``data: [DONE]``. Triton's generate_stream has no end event (its events carry output tensors
        only, no finish reason): the response's own end (the last HTTP chunk) is the end."""
        if self.error is not None:
            return False
        return self.done if self.protocol != "generate" else True

    def event(self, raw: bytes, t: float) -> None:
        """One SSE event (the bytes before its blank line). An event of several lines is a framing
        fault here (each chunk must be its own event); its ``data:`` lines are still read one by
        one, so that the stream's text and timing are not lost as well."""
        lines = raw.split(b"\n")
        if len(lines) != 1 or not raw.startswith(b"data: "):
            self.framing.append(f"an event that is not one 'data: ' line: {raw[:80]!r}")
            for line in lines:
                if line.startswith(b"data:"):
                    self._data(line[5:].removeprefix(b" "), t)
            return
        self._data(raw[6:], t)

    def _data(self, data: bytes, t: float) -> None:
        if self.done:
            self.events_after_done += 1
            self.framing.append(f"an event after data: [DONE]: {data[:80]!r}")
            return
        if data.strip() == b"[DONE]":
            if self.protocol == "generate":
                self.framing.append("data: [DONE] on a Triton generate stream")
            self.done = True
            return
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError:
            self.framing.append(f"an event whose data is not JSON: {data[:80]!r}")
            return
        if not isinstance(event, dict):
            self.framing.append(f"an event whose data is not a JSON object: {data[:80]!r}")
            return
        if "error" in event:
            error = event["error"]
            self.error = str(error.get("message", error) if isinstance(error, dict) else error)
            return
        text, finish = self._read(event)
        if text:
            self.token_times.append(t)
            self.pieces.append(text)
        if finish:
            self.finish_reason = finish

    def _read(self, event: dict[str, Any]) -> tuple[str, str | None]:
        """(text added, finish reason) of one event; usage is taken on the way."""
        if self.protocol == "generate":
            if isinstance(event.get("completion_tokens"), int):  # kiln serve's final event; Triton has none
                self.completion_tokens = event["completion_tokens"]
                self.prompt_tokens = event.get("prompt_tokens")
            text = event.get("text_output")
            return (text if isinstance(text, str) else ""), event.get("finish_reason")
        usage = event.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self.completion_tokens = usage["completion_tokens"]
            self.prompt_tokens = usage.get("prompt_tokens")
        choices = event.get("choices") or []
        if not choices or not isinstance(choices[0], dict):
            return "", None
        choice = choices[0]
        if self.protocol == "openai-chat":
            text = (choice.get("delta") or {}).get("content")
        else:
            text = choice.get("text")
        return (text if isinstance(text, str) else ""), choice.get("finish_reason")


class Verifier(Protocol):
    """``--check``'s verdict on one answer (``check.Checker``): None when it matches its reference."""

    def verify(self, index: int, body: bytes) -> str | None: ...
    def verify_stream(self, index: int, record: StreamRecord) -> str | None: ...


class StepState:
    """What one step sends and records, shared by its generators. Appends only: the event loop is
    single-threaded. ``problems`` (a ``--check`` verdict, None when fine or unchecked) and
    ``streams`` (a generation request's StreamRecord) run parallel to ``codes``."""

    def __init__(self, requests: Sequence[bytes], rate: float | None, seed: int,
                 checker: Verifier | None = None, protocol: str = ""):
        self.requests = requests
        self.checker = checker
        self.protocol = protocol
        self.problems: list[str | None] = []
        self.streams: list[StreamRecord | None] = []
        self.index = 0
        self.stop = False
        self.ends: list[float] = []
        self.latencies: list[float] = []
        self.codes: list[int] = []
        self.lags: list[float] = []
        self.sent = 0
        self.rate = rate
        self.rng = random.Random(seed)
        self.next_t = 0.0

    def next_indexed(self) -> tuple[int, bytes]:
        """The next request and its index (which --check's reference to compare the answer with)."""
        index = self.index
        self.index = (index + 1) % len(self.requests)
        return index, self.requests[index]

    def next_arrival(self) -> float:
        assert self.rate is not None
        self.next_t += self.rng.expovariate(self.rate)
        return self.next_t

    def record(self, start: float, end: float, code: int, problem: str | None = None) -> None:
        self.ends.append(end)
        self.latencies.append(end - start)
        self.codes.append(code)
        self.problems.append(problem)
        self.streams.append(None)

    def record_answer(self, start: float, end: float, code: int, index: int, body: bytes) -> None:
        """A whole (non-streamed) answer, checked against its reference when --check is on."""
        problem = self.checker.verify(index, body) if self.checker is not None and 200 <= code < 300 else None
        self.record(start, end, code, problem)

    def record_stream(self, index: int, stream: StreamRecord, code: int) -> None:
        problem = (self.checker.verify_stream(index, stream)
                   if self.checker is not None and code in (200, MID_STREAM_CODE) else None)
        self.record(stream.start, stream.end, code, problem)
        self.streams[-1] = stream
