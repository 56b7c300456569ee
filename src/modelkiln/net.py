"""Small networking helpers shared by the commands that start servers (tune, triton) and the tests."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` now (the OS picks it; another process could still take
    it before the caller binds, which is why callers wait for their server to answer)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
