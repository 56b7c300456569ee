"""Torch artifacts end to end: `kiln convert --engine torch` of encoders (every task, tiny models of
four architectures) and of a decoder, their answers against the ONNX artifact of the same model,
pooling on the device, the buckets the CUDA graphs use (run eagerly on the CPU), `kiln serve` of a
torch encoder and a torch decoder over HTTP, and `kiln serve` of ONNX generation never importing
torch. All on the CPU."""

from __future__ import annotations

import subprocess
import sys

import httpx
import numpy as np
import openai
import pytest
import torch

from modelkiln.manifest import Manifest, Pooling
from modelkiln.runtime.pipeline import load_pipeline
from modelkiln.runtime.registry import capabilities
from modelkiln.samples import SAMPLE_QA, SAMPLE_TEXTS
from servers import Server

TASKS = {"sentence-embeddings": "bert", "text-classification": "roberta", "token-classification": "distilbert",
         "question-answering": "mpnet"}


@pytest.fixture(scope="module")
def torch_artifacts(zoo, tmp_path_factory):
    """(torch artifact, ONNX artifact) of one tiny model per task."""
    from modelkiln.convert.pipeline import ConvertConfig, convert

    root = tmp_path_factory.mktemp("torch-encoders")
    found = {}
    for task, arch in TASKS.items():
        out = root / f"{arch}-{task}"
        convert(ConvertConfig(model=str(zoo.model(arch, task)), out=out, engine="torch", precisions=["fp32", "bf16"],
                              threads=1, timing_seconds=0.02))
        found[task] = (out, zoo.artifact(arch, task, ("fp32",)))
    return found


def inputs_of(task: str) -> list:
    return list(SAMPLE_QA[:6]) if task == "question-answering" else list(SAMPLE_TEXTS[:12])


@pytest.mark.parametrize("task", list(TASKS))
def test_torch_variants_pass_the_gate_and_answer_as_onnx_does(torch_artifacts, task):
    torch_folder, onnx_folder = torch_artifacts[task]
    manifest = Manifest.load(torch_folder)
    variants = {v.name: v for v in manifest.variants}
    fp32, bf16 = variants["torch-fp32"], variants["torch-bf16"]
    assert fp32.kept and fp32.engine == "torch" and fp32.file == "model.torch-fp32.safetensors"
    assert fp32.validation.passed and fp32.validation.batch_min_cosine >= 0.99999 and manifest.opset is None
    # bf16 is gated like any variant (kept only where faster than fp32): on a tiny random model the
    # labels of near-tied logits may flip, so only the embeddings' ranks must hold
    assert bf16.validation.batch_min_cosine >= 0.99999 and bf16.validation.min_cosine > 0.99
    if task == "sentence-embeddings":
        assert bf16.validation.passed
    assert not (torch_folder / "model.onnx").exists()
    ours, theirs = load_pipeline(torch_folder, "torch-fp32"), load_pipeline(onnx_folder, "fp32")
    assert type(ours.engine).__name__ == "TorchEncoderEngine"
    a, b = ours(inputs_of(task)), theirs(inputs_of(task))
    if task == "sentence-embeddings":
        np.testing.assert_allclose(np.stack(a), np.stack(b), atol=1e-5)
    elif task == "question-answering":
        assert [x["answer"] for x in a] == [x["answer"] for x in b]
    elif task == "token-classification":
        assert [[(e["entity_group"], e["start"], e["end"]) for e in x] for x in a] == \
               [[(e["entity_group"], e["start"], e["end"]) for e in x] for x in b]
    else:
        assert [x[0]["label"] for x in a] == [x[0]["label"] for x in b]
        np.testing.assert_allclose([x[0]["score"] for x in a], [x[0]["score"] for x in b], atol=1e-5)


def test_capabilities_come_from_the_variant():
    from modelkiln.manifest import Variant

    onnx_cpu = capabilities(Variant("fp32", "fp32", "cpu", "model.onnx", True))
    torch_gpu = capabilities(Variant("torch-bf16", "bf16", "cuda", "w.safetensors", True, engine="torch"))
    assert (onnx_cpu.padding_cheap, onnx_cpu.own_threads, onnx_cpu.max_padding) == (False, True, 0.15)
    assert (torch_gpu.padding_cheap, torch_gpu.own_threads, torch_gpu.max_batch, torch_gpu.max_padding) == (True, False, 256, 1.0)


@pytest.mark.parametrize("mode,normalize", [("mean", True), ("cls", False), ("max", True)])
def test_pooling_on_the_device_is_the_tasks_pooling(mode, normalize):
    from modelkiln.runtime.torch_encoder import pool as device_pool
    from modelkiln.tasks.embeddings import pool as host_pool

    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((4, 9, 16)).astype(np.float32)
    mask = np.zeros((4, 9), dtype=np.float32)
    for row, length in enumerate((9, 3, 1, 6)):
        mask[row, :length] = 1
    pooling = Pooling(mode, normalize)
    ours = device_pool(torch.from_numpy(hidden), torch.from_numpy(mask.astype(np.int64)), pooling).numpy()
    np.testing.assert_allclose(ours, host_pool(hidden, mask, pooling), atol=1e-6)


def test_bucketed_runs_answer_as_exact_shapes_do(torch_artifacts):
    """The CUDA graphs' (batch, length) buckets, run eagerly on the CPU: inputs padded to the bucket,
    padding rows attending to one token, outputs cut back; the answers are the unpadded ones."""
    from modelkiln.runtime.torch_encoder import TorchEncoderEngine

    for task in ("sentence-embeddings", "token-classification"):
        folder = torch_artifacts[task][0]
        manifest = Manifest.load(folder)
        pipe = load_pipeline(folder, "torch-fp32")
        bucketed = TorchEncoderEngine(folder, manifest, folder / "model.torch-fp32.safetensors", threads=1,
                                      keep_hidden=True, graphs=True)
        feeds, _ = pipe.encoder.encode(inputs_of(task)[:5])
        exact = pipe.engine.run(feeds)
        padded = bucketed.run(feeds)
        length = feeds["input_ids"].shape[1]
        assert set(bucketed._graphs) == {(8, next(n for n in (16, 32, 64, 128) if n >= length))}
        for name in exact:
            assert padded[name].shape == exact[name].shape
            np.testing.assert_allclose(padded[name], exact[name], atol=1e-5)


def test_kiln_serve_answers_with_a_torch_encoder(torch_artifacts):
    folder = torch_artifacts["sentence-embeddings"][0]
    expected = np.stack(load_pipeline(folder, "torch-fp32")(["hello world", "another text"]))
    srv = Server([f"emb={folder}", "--variant", "torch-fp32"], timeout=300)  # importing torch takes a while
    try:
        got = httpx.post(srv.url + "/v1/embeddings", json={"model": "emb", "input": ["hello world", "another text"]},
                         timeout=60).json()
        vectors = np.asarray([d["embedding"] for d in got["data"]], dtype=np.float32)
        np.testing.assert_allclose(vectors, expected, atol=1e-5)
        meta = httpx.get(srv.url + "/v2/models/emb", timeout=10).json()
        assert meta["platform"] == "pytorch" and meta["parameters"]["variant"] == "torch-fp32"
        assert meta["outputs"][0]["shape"] == [-1, 32]
    finally:
        code, err = srv.stop()
    assert code == 0, err[-2000:]


def test_kiln_serve_generates_with_a_torch_decoder(tiny_torch_artifact):
    from modelkiln.generation.core import complete, greedy, Request
    from modelkiln.generation.model import CoreOptions, TextGenerationModel

    model = TextGenerationModel(tiny_torch_artifact)
    ids = model.prompt_ids("The quick brown fox")
    expected = complete(model.core(None, CoreOptions(threads=1)), [Request("e", ids, greedy(8))])[0].text
    srv = Server([f"tiny={tiny_torch_artifact}", "--max-batch-size", "4"], timeout=300)
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        answers = [client.completions.create(model="tiny", prompt="The quick brown fox", temperature=0, max_tokens=8)
                   for _ in range(2)]
        assert [a.choices[0].text for a in answers] == [expected, expected]
        stream = client.completions.create(model="tiny", prompt="The quick brown fox", temperature=0, max_tokens=8,
                                           stream=True)
        assert "".join(chunk.choices[0].text for chunk in stream) == expected
        metrics = httpx.get(srv.url + "/metrics", timeout=10).text
        assert "kiln" in metrics
    finally:
        code, err = srv.stop()
    assert code == 0, err[-2000:]


def test_kiln_serve_of_onnx_generation_never_imports_torch(tiny_generation_artifact):
    srv = Server([f"tiny={tiny_generation_artifact}", "--variant", "fp32"], python_flags=("-X", "importtime"))
    httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 3},
               timeout=60).raise_for_status()
    code, err = srv.stop()
    assert code == 0
    imported = {line.rsplit("|", 1)[-1].strip() for line in err.splitlines() if line.startswith("import time:")}
    assert "onnxruntime" in imported
    assert not [m for m in imported if m.split(".")[0] in ("torch", "transformers")]


def test_kiln_convert_engine_torch_on_the_command_line(tmp_path, zoo):
    out = tmp_path / "emb"
    run = subprocess.run([sys.executable, "-m", "modelkiln", "convert", str(zoo.model("bert", "sentence-embeddings")),
                          "--out", str(out), "--engine", "torch", "--threads", "1"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "torch-fp32" in run.stdout and (out / "model.torch-fp32.safetensors").is_file()
    refused = subprocess.run([sys.executable, "-m", "modelkiln", "convert", str(zoo.model("bert", "sentence-embeddings")),
                              "--out", str(tmp_path / "gpu"), "--engine", "torch", "--device", "cuda"],
                             capture_output=True, text=True)
    if not torch.cuda.is_available():
        assert refused.returncode == 2 and "torch sees no CUDA device" in refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1 and not (tmp_path / "gpu").exists()
