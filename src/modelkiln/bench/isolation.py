"""Run one function in a child Python process, so that a peer engine that crashes, hangs or is
missing costs its own bench row and nothing else.

The bench's peer rows (PyTorch, llama.cpp: engines that are not the artifact's own) run native code
that can take the whole process down: llama-cpp-python compiled for a CPU with AMX dies with SIGSEGV
in llama.cpp's AMX code. In a child, such a crash, a hang past the time limit, a missing package or an
exception becomes a ``ChildFailed`` with a one-line reason; the caller turns it into a note and goes on.

The function is a module-level one (the child imports it by its module and name); it takes one JSON
value and returns one. Both travel through temporary files, not stdout: native libraries print there. The child's stdout and
stderr go to a log file, kept (and named in the reason) when the child fails."""

from __future__ import annotations

import faulthandler
import importlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import KilnError

# How long one peer row may run before it is stopped. Generous: PyTorch on a real model over the full
# grid takes minutes on a busy 2-core machine, and a stopped row is a lost measurement.
DEFAULT_TIMEOUT_S = 900.0


class ChildFailed(KilnError):
    """The child crashed, hung, missed a package or raised; ``str()`` is the one-line reason."""

    def __init__(self, reason: str, missing: str | None = None):
        super().__init__(reason)
        self.missing = missing  # the module that could not be imported, when that was the failure


def run_in_child(function: Callable[[Any], Any], argument: Any, timeout: float = DEFAULT_TIMEOUT_S,
                 log_name: str = "child") -> Any:
    """``function(argument)`` in a child ``python -m modelkiln.bench.isolation``; its JSON result, or
    ``ChildFailed``. ``log_name`` goes into the log file's name (``kiln-<log_name>-*.log`` in the temp folder)."""
    if "<" in function.__qualname__:
        raise ValueError(f"{function.__qualname__} is not a module-level function: a child process cannot import it")
    name = f"{function.__module__}:{function.__qualname__}"
    fd, log_path = tempfile.mkstemp(prefix=f"kiln-{_slug(log_name)}-", suffix=".log")
    with tempfile.TemporaryDirectory(prefix="kiln-child-") as tmp, os.fdopen(fd, "wb") as log:
        argument_file, result_file = Path(tmp) / "argument.json", Path(tmp) / "result.json"
        argument_file.write_text(json.dumps(argument))
        # A new session: on a timeout (or Ctrl-C here) the child and anything it started are stopped together.
        proc = subprocess.Popen([sys.executable, "-m", __name__, name, str(argument_file), str(result_file)],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=_child_env(),
                                start_new_session=True)
        try:
            returncode: int | None = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            returncode = None
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        outcome = _read_result(result_file)
    if outcome is not None and "result" in outcome:
        os.unlink(log_path)
        return outcome["result"]
    see = f"; see {log_path}"
    if returncode is None:
        raise ChildFailed(f"did not finish within {timeout:g} s (stopped){see}")
    if returncode < 0:
        raise ChildFailed(f"crashed with {_signal_name(-returncode)}{see}")
    if outcome is None:
        raise ChildFailed(f"exited with code {returncode} without a result{see}")
    if outcome.get("missing"):
        os.unlink(log_path)
        raise ChildFailed(outcome["error"], missing=outcome["missing"])
    if outcome.get("expected"):  # a KilnError: its message is the whole story
        os.unlink(log_path)
        raise ChildFailed(outcome["error"])
    raise ChildFailed(f"failed: {outcome['error']}{see}")


def _child_env() -> dict[str, str]:
    """The parent's environment, with this modelkiln's folder last on PYTHONPATH so that the child
    imports the same modelkiln even where the parent found it some other way (last: whatever the user
    put on PYTHONPATH still comes first)."""
    package_root = str(Path(__file__).resolve().parents[2])
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths + [package_root])}


def _read_result(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # never written, or cut short by a crash
        return None


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower() or "child"


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


# --- the child ---------------------------------------------------------------------------------


def _child_main(function: str, argument_file: str, result_file: str) -> None:
    faulthandler.enable()  # a crash in native code leaves the Python stack in the log
    try:
        module, _, name = function.partition(":")
        result = {"result": getattr(importlib.import_module(module), name)(json.loads(Path(argument_file).read_text()))}
    except ModuleNotFoundError as exc:
        traceback.print_exc()
        result = {"error": f"{exc.name} is not installed", "missing": exc.name or "?"}
    except KilnError as exc:
        result = {"error": _one_line(exc), "expected": True}
    except Exception as exc:  # noqa: BLE001 - any failure of a peer is reported, not raised
        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {_one_line(exc)}"}
    Path(result_file).write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: native libraries' destructors can crash after the result is written.
    os._exit(0)


if __name__ == "__main__":
    _child_main(*sys.argv[1:4])
