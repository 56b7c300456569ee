"""Repository hygiene: no model weights or generated files in git, and no ORT tool litter."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from modelkiln.convert.variants import in_scratch_directory

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 5 * 1000 * 1000


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="not a git checkout")
def test_no_tracked_file_is_larger_than_5_mb():
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    large = [(name, size) for name in files.decode().split("\0") if name
             if (path := ROOT / name).is_file() and (size := path.stat().st_size) > LIMIT]
    assert not large, f"tracked files over 5 MB (weights are never committed): {large}"


def test_ort_tools_run_outside_the_working_directory(tmp_path, monkeypatch):
    """ORT's symbolic shape inference dumps sym_shape_infer_temp.onnx + <uuid>.data into the
    current directory; every builder runs in a scratch directory instead."""
    monkeypatch.chdir(tmp_path)

    @in_scratch_directory
    def litter() -> str:
        Path("sym_shape_infer_temp.onnx").write_bytes(b"x")
        return os.getcwd()

    ran_in = litter()
    assert ran_in != str(tmp_path)
    assert os.getcwd() == str(tmp_path)
    assert list(tmp_path.iterdir()) == []
    assert not Path(ran_in).exists()  # the scratch directory is removed
