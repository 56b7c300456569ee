"""The one place where errors become HTTP responses: ``{"error": "..."}`` with the exception's
``status_code`` (Triton's table: 400 bad request, 401, 404 unknown model/version, 413, 503
overloaded / timed out / not ready, 500 only for bugs)."""

from __future__ import annotations

import logging

import orjson

from ..errors import KilnError, OverloadedError, RequestTimeoutError

log = logging.getLogger("modelkiln.serve")

RETRY_AFTER_S = "1"


def error_response(exc: BaseException, request_id: str | None = None) -> tuple[int, bytes, dict[str, str]]:
    """(status, body, extra headers) for any exception a handler raised."""
    if isinstance(exc, KilnError):
        status, message = exc.status_code, str(exc)
    else:  # a bug: say so without leaking internals, and log the traceback with the request id
        log.error("request %s failed: internal error", request_id, exc_info=exc)
        status, message = 500, f"internal server error ({type(exc).__name__})"
    headers = {"retry-after": RETRY_AFTER_S} if isinstance(exc, (OverloadedError, RequestTimeoutError)) else {}
    if status >= 500 or status == 413:
        log.warning("request %s: %d %s", request_id, status, message)
    return status, orjson.dumps({"error": message}), headers
