"""The API key check (``--api-key``), one rule for the HTTP gate (``app.py``) and the gRPC
servicer (``grpc/server.py``)."""

from __future__ import annotations

import hmac


def bearer_matches(authorization: bytes, api_key: bytes) -> bool:
    """``Authorization: Bearer KEY`` (HTTP header or gRPC metadata). Auth schemes are
    case-insensitive (RFC 9110 §11.1): "bearer KEY" is as good; the key compares in constant time."""
    scheme, _, key = authorization.partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(key.strip(), api_key)
