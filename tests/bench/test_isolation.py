"""bench/isolation.py: a function run in a child process comes back as its JSON result, or as a
one-line reason for each way it can end (a signal, a hang, a missing package, an exception, an exit)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

import child_targets
from helpers import SRC
from modelkiln.bench.isolation import ChildFailed, run_in_child


@pytest.fixture(autouse=True)
def child_path(monkeypatch, tmp_path):
    """The child imports child_targets from tests/, and writes its log into this test's folder."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(child_targets.__file__).parent), str(SRC)]))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # re-read TMPDIR


def logs(tmp_path: Path) -> list[Path]:
    return sorted(tmp_path.glob("kiln-*.log"))


def test_the_result_comes_back_and_the_log_is_removed(tmp_path):
    out = run_in_child(child_targets.echo, {"ids": [1, 2, 3]}, timeout=60)
    assert out["got"] == {"ids": [1, 2, 3]} and out["pid"] != os.getpid()
    assert logs(tmp_path) == []


def test_a_crash_names_the_signal_and_keeps_the_log(tmp_path):
    with pytest.raises(ChildFailed) as failed:
        run_in_child(child_targets.segfault, None, timeout=60, log_name="llama.cpp (same GGUF)")
    [log] = logs(tmp_path)
    assert str(failed.value) == f"crashed with SIGSEGV; see {log}"
    assert log.name.startswith("kiln-llama-cpp-same-gguf-")
    text = log.read_text()
    assert "native library output on stdout" in text and "Segmentation fault" in text  # faulthandler's stack


def test_a_hang_is_stopped_at_the_time_limit(tmp_path):
    started = time.monotonic()
    with pytest.raises(ChildFailed) as failed:
        run_in_child(child_targets.hang, None, timeout=1.5)
    assert time.monotonic() - started < 30
    assert str(failed.value).startswith("did not finish within 1.5 s (stopped); see ")


def test_a_missing_package_is_named(tmp_path):
    with pytest.raises(ChildFailed) as failed:
        run_in_child(child_targets.missing_dependency, None, timeout=60)
    assert failed.value.missing == "a_module_nobody_installed"
    assert str(failed.value) == "a_module_nobody_installed is not installed"


def test_an_exception_is_one_line_and_a_kiln_error_is_its_message(tmp_path):
    with pytest.raises(ChildFailed) as failed:
        run_in_child(child_targets.raises, 7, timeout=60)
    [log] = logs(tmp_path)
    assert str(failed.value) == f"failed: ValueError: bad value 7; see {log}"
    assert "Traceback" in log.read_text()
    with pytest.raises(ChildFailed) as failed:
        run_in_child(child_targets.expected_error, None, timeout=60)
    assert str(failed.value) == "the source model of 'x' is not available; pass --no-reference"


def test_an_exit_without_a_result(tmp_path):
    with pytest.raises(ChildFailed) as failed:
        run_in_child(child_targets.exits, None, timeout=60)
    assert str(failed.value).startswith("exited with code 3 without a result; see ")


def test_only_module_level_functions_can_run_in_a_child():
    def local(argument):
        return argument

    with pytest.raises(ValueError, match="not a module-level function"):
        run_in_child(local, None)
