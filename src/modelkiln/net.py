"""Small networking helpers shared by the commands that start servers (tune, triton, ray), the
benchmarks and the tests."""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable

from .errors import KilnError


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` now (the OS picks it; another process could still take
    it before the caller binds, which is why callers wait for their server to answer)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_until_ready(proc: subprocess.Popen, url: str, timeout: float, what: str, output: Callable[[], str],
                     stop: Callable[[], object], poll_s: float = 0.1) -> None:
    """Poll ``{url}/v2/health/ready`` until it answers 200. KilnError, carrying ``output()`` (the
    end of the server's log), when ``proc`` exits first, or when ``timeout`` s pass (after ``stop()``)."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise KilnError(f"{what} exited with {proc.returncode}: {output()}")
        try:
            with urllib.request.urlopen(url + "/v2/health/ready", timeout=max(poll_s, 1.0)) as reply:
                if reply.status == 200:
                    return
        except OSError:  # refused while starting, 503 while loading (HTTPError), a timeout
            pass
        if time.monotonic() > deadline:
            stop()
            raise KilnError(f"{what} was not ready after {timeout:.0f}s: {output()}")
        time.sleep(poll_s)
