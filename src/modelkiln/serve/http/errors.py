"""The one place where errors become HTTP responses.

``HTTP_STATUS`` maps each ``ErrorKind`` to its status (Triton's table: 400 bad request, 401, 404
unknown model/version, 405, 413, 503 overloaded / timed out / not ready, 500 only for bugs).
The OIP routes answer ``{"error": "..."}``; OpenAI's routes (``/v1/...``) answer OpenAI's shape,
``{"error": {"message", "type", "param", "code"}}``, which its client libraries parse. A bug's traceback is logged at most once per minute per (exception
type, place), and refusals (413, 503) once per minute per kind with a count, so no client can
flood the log."""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Callable

import orjson

from ...errors import ErrorKind, KilnError

log = logging.getLogger("modelkiln.serve")

HTTP_STATUS: dict[ErrorKind, int] = {
    ErrorKind.INVALID_INPUT: 400,
    ErrorKind.UNAUTHENTICATED: 401,
    ErrorKind.NOT_FOUND: 404,
    ErrorKind.METHOD_NOT_ALLOWED: 405,
    ErrorKind.TOO_LARGE: 413,
    ErrorKind.INTERNAL: 500,
    ErrorKind.NOT_READY: 503,
    ErrorKind.OVERLOADED: 503,
    ErrorKind.TIMED_OUT: 503,
}
# Kinds that say "try again": answered with Retry-After (seconds).
RETRY_AFTER: dict[ErrorKind, str] = {ErrorKind.OVERLOADED: "1", ErrorKind.TIMED_OUT: "1", ErrorKind.NOT_READY: "1"}

# OpenAI's error ``type`` for each status it documents (the rest: "server_error").
_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                 405: "invalid_request_error", 413: "invalid_request_error", 503: "service_unavailable"}

TRACEBACK_EVERY_S = 60.0


class LogThrottle:
    """Log a line once per ``every_s`` per key; in between, count the repeats and report the count
    with the next line. Keys: (exception type, file:line where it was raised) for bugs, the kind
    for refusals (an overloaded server refuses thousands of requests a second: issue 15 measured
    a 503 storm's log lines slowing the event loop that answers them: see ``error_response``)."""

    def __init__(self, every_s: float = TRACEBACK_EVERY_S, clock: Callable[[], float] = time.monotonic):
        self.every_s = every_s
        self.clock = clock
        self._last: dict[tuple[str, ...], float] = {}
        self._skipped: dict[tuple[str, ...], int] = {}
        self._lock = threading.Lock()  # the gRPC servicer may report from other threads

    def should_log(self, key: tuple[str, ...]) -> tuple[bool, int]:
        """(log this one?, repeats not logged since the last one)."""
        now = self.clock()
        with self._lock:
            if now - self._last.get(key, -float("inf")) < self.every_s:
                self._skipped[key] = self._skipped.get(key, 0) + 1
                return False, 0
            self._last[key] = now
            if len(self._last) > 1024:  # bounded: forget the oldest keys
                for old in sorted(self._last, key=self._last.__getitem__)[:512]:
                    self._last.pop(old, None)
                    self._skipped.pop(old, None)
            return True, self._skipped.pop(key, 0)


def bug_key(exc: BaseException) -> tuple[str, str]:
    """(exception type, file:line where it was raised)."""
    frames = traceback.extract_tb(exc.__traceback__)
    return type(exc).__qualname__, f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"


throttle = LogThrottle()


def kind_of(exc: BaseException) -> ErrorKind:
    return exc.kind if isinstance(exc, KilnError) else ErrorKind.INTERNAL


def error_response(exc: BaseException, request_id: str | None = None, openai: bool = False
                   ) -> tuple[int, bytes, dict[str, str]]:
    """(status, body, extra headers) for any exception a handler raised."""
    kind = kind_of(exc)
    status = HTTP_STATUS[kind]
    if not isinstance(exc, KilnError):  # a bug: say so without leaking internals; log the traceback (throttled)
        message = f"internal server error ({type(exc).__name__})"
        first, repeats = throttle.should_log(bug_key(exc))
        if first:
            more = f" (and {repeats} more like it since the last traceback)" if repeats else ""
            log.error("request %s failed: internal error%s", request_id, more, exc_info=exc)
    else:
        message = str(exc)
        if status == 413 or status >= 500:  # refusals worth an operator's eye, once a minute per kind
            first, repeats = throttle.should_log((kind.value,))
            if first:
                more = f" (and {repeats} more since the last such line)" if repeats else ""
                log.warning("request %s: %d %s%s", request_id, status, message, more)
    headers = {"retry-after": RETRY_AFTER[kind]} if kind in RETRY_AFTER else {}
    body: dict[str, object]
    if openai:
        body = {"error": {"message": message, "type": _OPENAI_TYPES.get(status, "server_error"),
                          "param": None, "code": kind.value}}
    else:
        body = {"error": message}
    return status, orjson.dumps(body), headers
