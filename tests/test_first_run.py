"""What a new user meets first: a partial install, bracketed text, a hub id without network, --version,
and the bench's warnings about disturbed timings. Every error is one line and exit code 2."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from helpers import SRC, kiln
from modelkiln.bench.stability import timing_warnings
from modelkiln.timing import Stats
from modelkiln.net import free_port

CONVERT_MODULES = ("torch", "transformers", "onnx", "onnxscript")


def kiln_without(modules: tuple[str, ...], *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """The CLI in a process where ``modules`` cannot be imported (``None`` in sys.modules makes both
    ``import`` and ``importlib.util.find_spec`` report them missing), as after ``pip install 'modelkiln[serve]'``."""
    code = ("import sys\n"
            f"for m in {modules!r}: sys.modules[m] = None\n"
            f"sys.argv = ['kiln', *{args!r}]\n"
            "from modelkiln.cli import main\n"
            "main()\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(SRC)})


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


def test_convert_without_the_convert_extra_names_it(tmp_path):
    res = kiln_without(CONVERT_MODULES, "convert", str(tmp_path), "--out", str(tmp_path / "out"))
    assert res.returncode == 2, res.stderr
    line = one_line(res.stderr)
    assert "kiln convert needs modelkiln[convert]" in line
    assert "pip install 'modelkiln[convert]'" in line
    assert "Traceback" not in res.stderr


def test_eval_without_torch_names_the_extra_and_no_reference(zoo):
    res = kiln_without(("torch",), "eval", str(zoo.artifact("bert", "sentence-embeddings")))
    assert res.returncode == 2, res.stderr
    line = one_line(res.stderr)
    assert "pip install 'modelkiln[convert]'" in line and "--no-reference" in line
    assert "torch is not installed" in line


def test_bench_of_a_model_folder_without_the_extra_names_it(zoo):
    res = kiln_without(CONVERT_MODULES, "bench", str(zoo.model("bert", "sentence-embeddings")))
    assert res.returncode == 2, res.stderr
    assert "pip install 'modelkiln[convert]'" in one_line(res.stderr)


def test_bench_of_an_artifact_without_torch_falls_back_to_no_reference(zoo):
    res = kiln_without(CONVERT_MODULES, "bench", str(zoo.artifact("bert", "sentence-embeddings")), "--batch", "1",
                       "--seq", "16", "--threads", "1", "--warmup", "0", "--min-iters", "2", "--min-seconds", "0")
    assert res.returncode == 0, res.stderr
    assert "running as --no-reference" in res.stderr and "pip install 'modelkiln[convert]'" in res.stderr
    assert "onnxruntime fp32" in res.stdout and "pytorch" not in res.stdout
    # no PyTorch in the run: no speed-up column, and the footer does not promise one
    assert "speed-up" not in res.stdout


def test_error_text_keeps_square_brackets(tmp_path):
    missing = tmp_path / "pip install 'modelkiln[demo]'"
    res = kiln("convert", str(missing), "--out", str(tmp_path / "out"))
    assert res.returncode == 2
    assert f"model folder {missing} does not exist" in one_line(res.stderr)


def test_help_keeps_square_brackets():
    res = kiln("bench", "--help", env={"COLUMNS": "80"})
    assert res.returncode == 0
    assert "(needs modelkiln[convert])" in " ".join(res.stdout.split())  # the text may wrap, never lose brackets


def test_hub_id_without_network_fails_fast_in_one_line(tmp_path):
    # A hub endpoint nobody listens on stands for "no network"; it is refused at once, as DNS fails at once here.
    env = {**os.environ, "PYTHONPATH": str(SRC), "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"}
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        env.pop(var, None)
    started = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "modelkiln", "convert", "made-up-org/made-up-model", "--out",
                          str(tmp_path / "out")], capture_output=True, text=True, timeout=60, env=env)
    elapsed = time.perf_counter() - started
    assert res.returncode == 2, res.stderr
    line = one_line(res.stderr)
    assert "cannot be reached" in line and "local model folder" in line and "HF_HUB_OFFLINE=1" in line
    assert elapsed < 10, f"took {elapsed:.1f} s"


def test_version_names_the_runtime_libraries():
    res = kiln("--version")
    assert res.returncode == 0
    import modelkiln
    import numpy
    import onnxruntime
    import tokenizers

    line = one_line(res.stdout)
    assert line.startswith(f"modelkiln {modelkiln.__version__} ")
    for name, module in (("onnxruntime", onnxruntime), ("tokenizers", tokenizers), ("numpy", numpy)):
        assert f"{name} {module.__version__}" in line


def _cell(backend: str, batch: int, seq: int, median: float, p95: float, speedup: float | None = None):
    from modelkiln.bench.runner import Cell

    return Cell(backend, "cpu", batch, seq, Stats(10, median, 0.0, median, p95, median, p95, p95), speedup)


def test_bench_warns_about_spread_and_out_of_order_cells():
    steady = [_cell("onnxruntime int8", 1, 16, 1.0, 1.1), _cell("onnxruntime int8", 8, 128, 9.0, 9.5)]
    assert timing_warnings(steady) == []
    spread = timing_warnings([_cell("pytorch fp32", 1, 16, 2.0, 5.0)])
    assert len(spread) == 1 and "2.5× the median" in spread[0]
    # the small cell ran while the machine was busy: slower than a cell with 64 times the work
    collapsed = timing_warnings([_cell("pytorch fp32", 1, 16, 40.0, 41.0), _cell("pytorch fp32", 8, 128, 20.0, 21.0)])
    assert len(collapsed) == 1 and "longer than the larger 8×128" in collapsed[0]
    # PyTorch uniformly slowed down: every cell in order and steady, but the speed-up is implausible on CPU
    starved = [_cell("pytorch fp32", 1, 16, 82.0, 85.0, 1.0), _cell("onnxruntime int8", 1, 16, 2.4, 2.5, 34.2)]
    warnings = timing_warnings(starved)
    assert len(warnings) == 1 and "34.2× PyTorch" in warnings[0]
    assert timing_warnings([_cell("onnxruntime int8", 1, 16, 2.4, 2.5, 5.0)]) == []


def test_examples_clients_against_a_real_server(zoo):
    from servers import Server

    grpc_port = free_port()
    srv = Server([f"emb={zoo.artifact('bert', 'sentence-embeddings')}", "--variant", "fp32",
                  "--grpc-port", str(grpc_port)])
    try:
        res = subprocess.run([sys.executable, str(SRC.parent / "examples" / "clients.py"), "--url", srv.url,
                              "--grpc-url", f"127.0.0.1:{grpc_port}", "--model", "emb"],
                             capture_output=True, text=True, timeout=120)
    finally:
        code, err = srv.stop()
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert [line.split(" ", 1)[0] for line in lines] == ["tritonclient", "tritonclient.grpc:", "httpx", "openai:"], res.stdout
    assert "(2, " in lines[0] and "float32" in lines[0]
    assert code == 0, err[-2000:]


def test_tables_keep_square_brackets_in_names(zoo, tmp_path):
    model = zoo.model("bert", "sentence-embeddings")
    res = kiln("convert", str(model), "--out", str(tmp_path / "out"), "--name", "mini[demo]", "--precision", "fp32",
               "--threads", "1")
    assert res.returncode == 0, res.stderr
    assert "mini[demo]: sentence-embeddings" in res.stdout
    assert "Loading weights" not in res.stdout + res.stderr  # transformers' progress bars are silenced
