"""The package as pip installs it, away from this checkout: the wheel built from the checkout, installed
with `pip install --no-deps --target`, run from a temporary folder with no shared/ anywhere above it and
the installed copy first on PYTHONPATH. kiln convert of a tiny generation model, kiln eval of it, kiln
serve of the result and kiln loadtest --inputs sts all work from what the wheel carries (STS-B and the
SQuAD subset in modelkiln/datasets/)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import httpx
import pytest

from generation_helpers import make_tiny_llama
from helpers import SRC
from modelkiln.loadtest.api import GENERATION_PROMPTS
from servers import Server

REPO = SRC.parent
DATASETS = ["modelkiln/datasets/README.md", "modelkiln/datasets/stsbenchmark/sts-dev.csv",
            "modelkiln/datasets/stsbenchmark/LICENSE.txt", "modelkiln/datasets/squad/squad-v2-dev-subset.json"]
UI = ["modelkiln/serve/ui/index.html", "modelkiln/serve/ui/app.js", "modelkiln/serve/ui/style.css"]  # kiln serve's page


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(the wheel, the folder it is installed in, a working folder with no shared/ above it)."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"  # a copy: building writes build/ and *.egg-info beside the sources
    shutil.copytree(SRC, source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip[:3], "wheel", *pip[3:], "--no-deps", "--no-build-isolation", "-w", str(root / "dist"),
                    str(source)], check=True, timeout=300)
    [wheel] = (root / "dist").glob("modelkiln-*.whl")
    site = root / "site"
    subprocess.run([*pip[:3], "install", *pip[3:], "--no-deps", "--no-index", "--target", str(site), str(wheel)],
                   check=True, timeout=300)
    work = root / "work"
    work.mkdir()
    assert not [p for p in (work, *work.parents) if (p / "shared").exists()]
    return wheel, site, work


def run(installed, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """A command of the installed wheel (its `kiln` script), from the working folder."""
    _, site, work = installed
    env = {k: v for k, v in os.environ.items() if k != "KILN_DATA_DIR"}
    return subprocess.run(args if args[0] == sys.executable else [str(site / "bin" / "kiln"), *args], cwd=work,
                          env={**env, "PYTHONPATH": str(site)}, capture_output=True, text=True, timeout=timeout)


def test_convert_eval_serve_and_loadtest_from_the_installed_wheel(installed):
    wheel, site, work = installed
    assert set(DATASETS + UI) <= set(zipfile.ZipFile(wheel).namelist())
    where = run(installed, sys.executable, "-c", "import modelkiln, modelkiln.data as d; print(modelkiln.__file__); print(d.data_dir())")
    module, data = where.stdout.split()
    assert Path(module).is_relative_to(site) and Path(data) == site / "modelkiln" / "datasets", where.stderr

    model = make_tiny_llama(work / "tiny-llama")
    convert = run(installed, "convert", str(model), "--task", "text-generation", "--precision", "fp32",
                  "--gate-prompts", "2,1", "--threads", "1", "--out", "tiny")
    assert convert.returncode == 0, convert.stderr[-3000:]
    evaluation = run(installed, "eval", "tiny", "--threads", "1", "--no-reference")  # PyTorch ran in the convert
    assert evaluation.returncode == 0, evaluation.stderr[-3000:]
    assert "SQuAD" in evaluation.stdout and "onnxruntime fp32" in evaluation.stdout

    srv = Server(["tiny=tiny", "--variant", "fp32"], env={"PYTHONPATH": str(site)}, cwd=work)
    try:
        page = httpx.get(srv.url + "/")  # the page's files came with the wheel
        assert page.status_code == 200 and "/ui/app.js" in page.text
        load = run(installed, "loadtest", srv.url, "-m", "tiny", "--protocol", "openai-chat", "--inputs", "sts",
                   "--max-tokens", "4", "--ignore-eos", "--concurrency", "1", "--warmup", "0.2", "--window", "0.5",
                   "--max-windows", "1", timeout=120)
    finally:
        code, err = srv.stop()
    assert load.returncode == 0, load.stderr[-3000:]
    texts = re.search(r"\(openai-chat, sts, all, (\d+) texts", load.stdout)
    assert texts and int(texts.group(1)) == GENERATION_PROMPTS, load.stdout  # STS-B sentences as prompts
    assert re.search(r"│\s+c=1\s+│", load.stdout) and code == 0, err[-2000:]
