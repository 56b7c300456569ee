"""Small networking helpers shared by the commands that start servers (tune, triton, ray), the
benchmarks and the tests."""

from __future__ import annotations

import os
import signal
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


# KILN_* variables that only say where files are: a child process may keep them.
PATH_SETTINGS = ("KILN_CACHE", "KILN_CACHE_DIR", "KILN_DATA_DIR")


def child_environment(**overrides: str) -> dict[str, str]:
    """The environment for a server this process starts (kiln serve, kiln ray): the caller's,
    less its ``KILN_*`` settings, which would silently change what the child serves or what is
    measured (a stray ``KILN_VARIANT`` in the shell), but keeping ``PATH_SETTINGS``; then
    ``overrides``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_") or k in PATH_SETTINGS}
    return {**env, **overrides}


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


def stop_child(proc: subprocess.Popen, timeout: float) -> int:
    """A server started as a child, stopped gracefully (SIGTERM: it drains and exits), killed if it
    has not exited within ``timeout`` seconds. Returns its exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode
