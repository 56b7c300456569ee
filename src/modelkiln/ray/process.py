"""``kiln ray ...`` as a child process with its own local cluster, for tests and benchmarks (as
``tune.sweep.ServeProcess`` is for kiln serve). It runs in a session of its own, so every process
of its cluster can be found (``session_pids``) and, if it hangs on the way out, ended by that
session id, never by name."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from ..net import child_environment, free_port, wait_until_ready


class RayProcess:
    def __init__(self, args: Sequence[str], timeout: float = 300.0, env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="kiln-ray-", suffix=".log", mode="w+", delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "modelkiln", "ray", *args, "--port", str(self.port)],
            env=child_environment(RAY_USAGE_STATS_ENABLED="0", **(env or {})), stdout=self.log, stderr=subprocess.STDOUT,
            start_new_session=True)
        # slower polls than kiln serve's: a cluster takes tens of seconds to come up
        wait_until_ready(self.proc, self.url, timeout, "kiln ray", lambda: self.output()[-3000:], self.stop, poll_s=0.5)

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def session_pids(self, title: str = "") -> list[int]:
        """Processes of this kiln ray's session (its cluster) whose command line contains ``title``
        (Ray titles a replica's process ``ray::ServeReplica:APP:DEPLOYMENT``)."""
        return session_pids(self.proc.pid, title)

    def replica_pids(self, app: str) -> list[int]:
        return self.session_pids(f"ServeReplica:{app}:")

    def stop(self, timeout: float = 90.0) -> int:
        """Ctrl-C (kiln ray deletes its applications and stops its cluster); the session is killed
        if that has not finished within ``timeout``."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> RayProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def session_pids(session: int, title: str = "") -> list[int]:
    """Live processes (not zombies) of the session ``session`` whose command line contains ``title``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace") if title else ""
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after the command's name: state, ppid, pgrp, session...
        if int(fields[3]) == session and fields[0] != "Z" and title in cmdline:
            pids.append(int(entry.name))
    return pids
