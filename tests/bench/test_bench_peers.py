"""`kiln bench` when a peer row (an engine that is not the artifact's own) fails: each peer runs in a
child process, so a crash (SIGSEGV, as llama.cpp's AMX code on Xeons), a hang past --peer-timeout or a
missing package becomes one note in the table, the artifact's own rows print, and the exit code is 0.
The llama.cpp peer is a fake ``llama_cpp`` package put first on PYTHONPATH of a real `kiln bench`."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from generation_helpers import write_tiny_gguf
from helpers import SRC, kiln
from modelkiln.bench.generation_backends import llama_cpp_install_hint
from modelkiln.machine import cpu_flags, matrix_engine
from modelkiln.manifest import Manifest
from test_first_run import kiln_without

# The smallest grid: one prompt length, decode at batch 1, no PyTorch row; llama.cpp the only peer.
SMALL = ("--seq", "8", "--past", "8", "--threads", "1", "--no-reference")
GRID = (*SMALL, "--batch", "1", "--peers", "llama.cpp")

FAKE_LLAMA_CPP = {
    "crash": "import os, signal\n"
             "class Llama:\n"
             "    def __init__(self, *args, **kwargs):\n"
             "        print('llama_model_loader: loaded meta data')  # native libraries print on stdout\n"
             "        os.kill(os.getpid(), signal.SIGSEGV)\n",
    "hang": "import time\n"
            "class Llama:\n"
            "    def __init__(self, *args, **kwargs):\n"
            "        time.sleep(600)\n",
    "missing": "import llama_cpp_native_library_not_here  # noqa: F401\n",
}


@pytest.fixture(scope="module")
def gguf_artifact(tmp_path_factory) -> Path:
    """A tiny GGUF converted by kiln convert (fp32): its manifest names the GGUF file, so the bench adds
    the llama.cpp row."""
    from modelkiln.convert.pipeline import ConvertConfig, convert

    root = tmp_path_factory.mktemp("gguf-artifact")
    gguf = write_tiny_gguf(root / "gguf" / "tiny.gguf")
    out = root / "tiny-gguf"
    convert(ConvertConfig(model=str(gguf), out=out, task="text-generation", precisions=["fp32"], threads=1,
                          gate_short=2, gate_squad=1, timing_seconds=0.05))
    return out


def bench_with_fake_llama_cpp(artifact: Path, tmp_path: Path, kind: str, *args: str):
    fake = tmp_path / "fake" / "llama_cpp"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(FAKE_LLAMA_CPP[kind])
    env = {"PYTHONPATH": os.pathsep.join([str(fake.parent), str(SRC)]), "TMPDIR": str(tmp_path)}
    return kiln("bench", str(artifact), *GRID, "--json", str(tmp_path / "bench.json"), *args, env=env, timeout=120)


def own_rows_printed(res) -> None:
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [line for line in res.stdout.splitlines() if "│ onnxruntime fp32" in line]
    assert [r.split("│")[1].strip() for r in rows] == ["prefill", "decode"], res.stdout


def note(res, label: str) -> str:
    [line] = [line for line in res.stdout.splitlines() if line.startswith(f"note: {label}: ")]
    return line[len(f"note: {label}: "):]


def test_a_peer_that_crashes_is_a_note(gguf_artifact, tmp_path):
    res = bench_with_fake_llama_cpp(gguf_artifact, tmp_path, "crash")
    own_rows_printed(res)
    [log] = tmp_path.glob("kiln-llama-cpp-same-gguf-*.log")
    assert note(res, "llama.cpp (same GGUF)") == f"crashed with SIGSEGV; see {log}"
    assert "loaded meta data" in log.read_text() and "Segmentation fault" in log.read_text()
    assert "loaded meta data" not in res.stdout  # the child's output stays in its log
    data = json.loads((tmp_path / "bench.json").read_text())
    assert f"llama.cpp (same GGUF): crashed with SIGSEGV; see {log}" in data["notes"]
    assert {c["backend"] for c in data["cells"]} == {"onnxruntime fp32"}
    # the unit its products ran on, as kiln convert recorded it (fp32: the widest vector unit)
    assert {c["matrix_engine"] for c in data["cells"]} == {matrix_engine("fp32", "cpu", cpu_flags())}


def test_a_peer_that_hangs_is_stopped_at_the_time_limit(gguf_artifact, tmp_path):
    res = bench_with_fake_llama_cpp(gguf_artifact, tmp_path, "hang", "--peer-timeout", "3")
    own_rows_printed(res)
    assert note(res, "llama.cpp (same GGUF)").startswith("did not finish within 3 s (stopped); see ")


def test_a_peer_missing_a_package_is_a_note(gguf_artifact, tmp_path):
    res = bench_with_fake_llama_cpp(gguf_artifact, tmp_path, "missing")
    own_rows_printed(res)
    assert note(res, "llama.cpp (same GGUF)") == "llama_cpp_native_library_not_here is not installed"


def test_without_llama_cpp_the_note_is_the_install_hint_for_this_cpu(gguf_artifact):
    res = kiln_without(("llama_cpp",), "bench", str(gguf_artifact), *GRID)
    own_rows_printed(res)
    hint = note(res, "llama.cpp")
    assert hint == f"not installed ({llama_cpp_install_hint()})"
    assert "pip install 'modelkiln[llamacpp]'" in hint and "GGML_NATIVE=ON" not in hint


def test_an_encoder_reference_that_fails_is_a_skipped_line(zoo, tmp_path):
    folder = tmp_path / "artifact"
    shutil.copytree(zoo.artifact("bert", "sentence-embeddings"), folder)
    manifest = Manifest.load(folder)
    manifest.source["model"] = str(tmp_path / "deleted-model")  # the model it came from is gone
    manifest.save(folder)
    res = kiln("bench", str(folder), "--batch", "1", "--seq", "16", "--threads", "1", "--variants", "fp32",
               "--min-iters", "3", "--min-seconds", "0.01")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "│ onnxruntime fp32" in res.stdout and "speed-up" not in res.stdout
    [line] = [line for line in res.stdout.splitlines() if line.startswith("skipped: pytorch fp32: ")]
    assert f"the source model of '{manifest.name}' is not available" in line and "deleted-model does not exist" in line


def test_the_onnxruntime_genai_row_builds_its_own_model_and_runs(gguf_artifact, tmp_path):
    """The peer builds onnxruntime-genai's own int4 model of the same weights (cached) and times its
    Generator in the same grid as the artifact's rows."""
    pytest.importorskip("onnxruntime_genai")
    env = {"PYTHONPATH": str(SRC), "KILN_CACHE_DIR": str(tmp_path / "cache")}
    res = kiln("bench", str(gguf_artifact), *SMALL, "--batch", "1,2", "--peers", "onnxruntime-genai", "--json", str(tmp_path / "bench.json"), env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    cells = json.loads((tmp_path / "bench.json").read_text())["cells"]
    theirs = {(c["phase"], c["batch"]) for c in cells if c["backend"].startswith("onnxruntime-genai")}
    assert theirs == {("prefill", 1), ("decode", 1), ("decode", 2)}
    assert list((tmp_path / "cache" / "onnxruntime-genai").glob("*/genai_config.json"))


def test_sampled_decode_cells_are_said_and_refused_for_encoders(gguf_artifact, zoo, tmp_path):
    """`kiln bench --sampled`: the decode cells sample (said under the table and kept in the JSON's
    config), PyTorch's row with them (generate's top-k turned off, as the others draw); an encoder
    artifact, which chooses no tokens, is refused with a one-line error."""
    from modelkiln.bench.generation_backends import TorchBackend, drawing
    from modelkiln.generation.model import TextGenerationModel

    out = tmp_path / "bench.json"
    res = kiln("bench", str(gguf_artifact), *SMALL, "--batch", "1,2", "--peers", "none", "--sampled", "--json", str(out),
               timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "sampled (temperature 0.7, top_p 0.95, a seed per sequence" in " ".join(res.stdout.split())
    report = json.loads(out.read_text())
    assert report["config"]["sampled"] is True
    assert {(c["phase"], c["batch"]) for c in report["cells"]} == {("prefill", 1), ("decode", 1), ("decode", 2)}
    torch_row = TorchBackend(TextGenerationModel(gguf_artifact), 1)
    assert len(torch_row.decode_step_seconds([list(range(5, 13))] * 2, 2, sampled=True)) == 2
    assert drawing(True) == {"do_sample": True, "top_k": 0, "temperature": 0.7, "top_p": 0.95}
    encoder = zoo.artifact("bert", "sentence-embeddings", precisions=("fp32",))
    refused = kiln("bench", str(encoder), "--batch", "1", "--seq", "8", "--no-reference", "--sampled")
    assert refused.returncode == 2 and "--sampled is for text generation" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    missing = kiln("bench", str(tmp_path / "no-such-artifact"), "--no-reference", "--sampled")
    assert missing.returncode == 2 and f"{tmp_path / 'no-such-artifact'}: no such file or folder" in missing.stderr


def test_a_peers_refused_decode_cell_is_a_note_and_its_other_cells_stay():
    """onnxruntime-genai's Generator refuses more than 32 sequences: that cell becomes a note and the
    peer's other cells stay in the table; the same failure in one of the artifact's own variants ends
    the bench (it would be kiln's bug, not a peer's bound)."""
    from modelkiln.bench.generation import GenerationBenchConfig, GenerationInputs, measure_backend

    class Bounded:
        def prefill_seconds(self, ids):
            return 0.001

        def decode_step_seconds(self, prompts, steps, sampled=False):
            if len(prompts) > 32:
                raise RuntimeError(f"batch_size ({len(prompts)}) must be in [1, 32]")
            return [0.002] * steps

    inputs = GenerationInputs({8: list(range(8))}, [list(range(8))] * 64)
    cfg = GenerationBenchConfig(prompt_lengths=[8], batches=[1, 64, 16], past=8, decode_steps=2)
    cells, notes = measure_backend(Bounded(), "peer", inputs, cfg, peer=True)
    assert [(c.phase, c.batch) for c in cells] == [("prefill", 1), ("decode", 1), ("decode", 16)]
    assert notes == ["peer: batch 64 not measured (RuntimeError: batch_size (64) must be in [1, 32])"]
    with pytest.raises(RuntimeError, match="must be in"):
        measure_backend(Bounded(), "own", inputs, cfg)
