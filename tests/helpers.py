"""Small helpers shared by tests: running the real CLI in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]  # the repository root
TESTS = REPO / "tests"
SRC = REPO / "src"


def kiln(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(SRC), **(env or {})}
    return subprocess.run([sys.executable, "-m", "modelkiln", *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env)


def assert_one_line_error(res: subprocess.CompletedProcess, *fragments: str) -> None:
    """A failed command: exit 2, one ``error:`` line naming each of ``fragments``, no traceback."""
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    assert "Traceback" not in res.stderr
    lines = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, res.stderr[-2000:]
    for fragment in fragments:
        assert fragment in res.stderr.replace("\n", " "), res.stderr[-2000:]
