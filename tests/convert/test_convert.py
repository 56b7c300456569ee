"""kiln convert on tiny random models of four architectures × four tasks."""

from __future__ import annotations

import inspect
import json

import numpy as np
import pytest
import torch
import transformers as tf

from modelkiln.manifest import Manifest
from modelkiln.runtime.pipeline import load_pipeline
from modelkiln.samples import SAMPLE_PAIRS, SAMPLE_QA, SAMPLE_TEXTS
from tiny_models import ARCHITECTURES, CLASS_LABELS, NER_LABELS, TASKS

AUTO = {
    "text-classification": tf.AutoModelForSequenceClassification,
    "token-classification": tf.AutoModelForTokenClassification,
    "question-answering": tf.AutoModelForQuestionAnswering,
    "sentence-embeddings": tf.AutoModel,
}


def inputs_for(task: str) -> list:
    if task == "question-answering":
        return list(SAMPLE_QA[:6])
    if task == "text-classification":
        return [*SAMPLE_TEXTS[:6], *SAMPLE_PAIRS[:3]]
    return list(SAMPLE_TEXTS[:8])


def torch_reference(model_dir, task: str, inputs: list, max_length: int) -> list[np.ndarray]:
    """The task's raw outputs straight from transformers, one row per input, unpadded."""
    tok = tf.AutoTokenizer.from_pretrained(model_dir)
    model = AUTO[task].from_pretrained(model_dir).eval()
    rows = []
    for item in inputs:
        args = (item,) if isinstance(item, str) else tuple(item)
        trunc = "only_second" if task == "question-answering" else True
        enc = tok(*args, return_tensors="pt", truncation=trunc, max_length=max_length)
        enc = {k: v for k, v in enc.items() if k in inspect.signature(model.forward).parameters}
        with torch.no_grad():
            out = model(**enc)
        if task == "sentence-embeddings":
            v = out.last_hidden_state[0].mean(0)
            rows.append((v / v.norm()).numpy())
        elif task == "question-answering":
            rows.append(np.concatenate([out.start_logits[0].numpy(), out.end_logits[0].numpy()]))
        else:
            rows.append(out.logits[0].numpy())
    return rows


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("task", TASKS)
def test_every_kept_variant_agrees_with_pytorch(zoo, arch, task):
    folder = zoo.artifact(arch, task)
    manifest = Manifest.load(folder)
    assert manifest.task == task
    kept = manifest.kept_variants()
    assert "fp32" in [v.name for v in kept]
    # Input names come from the tokenizer: only BERT has token_type_ids here.
    assert ("token_type_ids" in manifest.input_names) == (arch == "bert")
    inputs = inputs_for(task)
    expected = torch_reference(zoo.model(arch, task), task, inputs, manifest.max_length)
    for variant in kept:
        pipe = load_pipeline(folder, variant=variant.name, threads=1)
        prepared = pipe.task.prepare(inputs)
        for item, want in zip(prepared, expected):
            feeds, _ = pipe.encoder.encode([item])
            out = pipe.engine.run(feeds)
            if task == "sentence-embeddings":
                got = pipe(([item]))[0]
            elif task == "question-answering":
                got = np.concatenate([out["start_logits"][0], out["end_logits"][0]])
            else:
                got = out["logits"][0]
            cos = float(got.ravel() @ want.ravel() / np.linalg.norm(got) / np.linalg.norm(want))
            if variant.precision == "fp32":
                np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-3)
            else:
                assert cos > 0.97, (variant.name, cos)
        assert variant.validation is not None and variant.validation.passed
        assert variant.latency_ms and variant.latency_ms > 0
        assert variant.served_ms and variant.served_ms > 0  # per text, the gate's texts at their own lengths


def test_the_default_variant_is_the_fastest_on_mixed_lengths_where_measured():
    """kiln serve's default: the kept variant fastest on the gate's texts one after another (served_ms);
    an artifact converted before that was measured is chosen by its fixed-shape latency."""
    from modelkiln.manifest import Manifest, TokenizerSpec, Variant

    def variant(name, fixed, mixed, kept=True):
        return Variant(name, "fp32", "cpu", name + ".onnx", kept, latency_ms=fixed, served_ms=mixed)

    manifest = Manifest("m", "sentence-embeddings", ["input_ids"], ["x"], 128, TokenizerSpec(), [
        variant("a", 2.0, 1.5), variant("b", 1.0, 1.8), variant("c", 0.5, 0.1, kept=False)])
    assert manifest.fastest_variant().name == "a"
    manifest.variants[0].served_ms = None  # not measured: every candidate by its fixed shape
    assert manifest.fastest_variant().name == "b"
    # another engine than onnxruntime's must be 10% faster than the fastest ONNX variant to be the default
    openvino = Variant("openvino-int8", "int8", "cpu", "model.xml", True, latency_ms=0.5, served_ms=1.4, engine="openvino")
    manifest.variants = [variant("int8", 1.0, 1.5), openvino]
    assert manifest.fastest_variant().name == "int8"  # 1.4 against 1.5: a near tie
    openvino.served_ms = 1.3
    assert manifest.fastest_variant().name == "openvino-int8"


def test_manifest_records_what_serving_needs(zoo):
    folder = zoo.artifact("roberta", "token-classification")
    data = json.loads((folder / "kiln.json").read_text())
    assert data["labels"] == NER_LABELS
    assert data["input_names"] == ["input_ids", "attention_mask"]
    assert data["max_length"] == 128
    assert data["opset"] == 17
    assert {"torch", "transformers", "onnx", "onnxruntime"} <= set(data["versions"])
    names = {v["name"]: v for v in data["variants"]}
    assert set(names) >= {"fp32", "optimized", "int8"}
    for v in data["variants"]:
        if v["kept"]:
            assert (folder / v["file"]).is_file()
            assert v["validation"]["passed"]
        else:
            assert v["file"] is None and v["reason"]
    # Only kept variants leave files behind.
    onnx_files = {p.name for p in folder.glob("*.onnx")}
    assert onnx_files == {v["file"] for v in data["variants"] if v["kept"]}
    assert (folder / "tokenizer.json").is_file()


def test_classification_labels_and_pairs(zoo):
    pipe = load_pipeline(zoo.artifact("bert", "text-classification"), variant="fp32")
    single, pair = pipe(["I loved it", ("A man is eating.", "Someone eats food.")])
    for answer in (single, pair):
        assert [a["label"] for a in answer] and {a["label"] for a in answer} == set(CLASS_LABELS)
        assert abs(sum(a["score"] for a in answer) - 1.0) < 1e-5
        assert answer[0]["score"] >= answer[1]["score"]


@pytest.mark.parametrize("mode", ["cls", "max"])
def test_sentence_transformers_pooling_is_honoured(zoo, mode):
    folder = zoo.artifact("bert", "sentence-embeddings", precisions=("fp32",), pooling=mode)
    manifest = Manifest.load(folder)
    assert manifest.pooling.mode == mode and manifest.pooling.normalize
    model_dir = zoo.model("bert", "sentence-embeddings", pooling=mode)
    tok, model = tf.AutoTokenizer.from_pretrained(model_dir), tf.AutoModel.from_pretrained(model_dir).eval()
    text = SAMPLE_TEXTS[5]
    with torch.no_grad():
        hidden = model(**tok(text, return_tensors="pt")).last_hidden_state[0]
    want = hidden[0] if mode == "cls" else hidden.max(0).values
    want = (want / want.norm()).numpy()
    got = load_pipeline(folder)([text])[0]
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_auto_task_detection(zoo):
    for task in TASKS:
        assert Manifest.load(zoo.artifact("distilbert", task)).task == task  # built with task=auto
    plain = zoo.model("distilbert", "sentence-embeddings", sentence_transformers=False)
    assert not (plain / "modules.json").exists()


def test_weights_beside_the_graph_and_readable_by_all(zoo, tmp_path):
    """Every ONNX variant's weights are in FILE.data beside it (the sessions of a server map one copy);
    the artifact's folder and files are readable by other users (mkdtemp and onnx's data files are
    owner-only); a graph with its weights inline (below the threshold) gives the same answers."""
    import stat

    from modelkiln.convert.pipeline import ConvertConfig, convert

    artifact = zoo.artifact("bert", "text-classification")
    manifest = Manifest.load(artifact)
    for variant in manifest.kept_variants():
        if variant.file and variant.file.endswith(".onnx"):
            graph, data = artifact / variant.file, artifact / (variant.file + ".data")
            assert data.is_file() and graph.stat().st_size < data.stat().st_size, variant.name
    for path in [artifact, *artifact.iterdir()]:
        assert stat.S_IMODE(path.stat().st_mode) & 0o044 == 0o044, path  # as the umask of 022 gives
    out = tmp_path / "inline"
    convert(ConvertConfig(model=str(zoo.model("bert", "text-classification")), out=out, precisions=("fp32",),
                          external_data_threshold=2**40, timing_seconds=0.02))
    assert not (out / "model.onnx.data").exists()
    a = load_pipeline(out, variant="fp32")([SAMPLE_TEXTS[2]])
    b = load_pipeline(artifact, variant="fp32")([SAMPLE_TEXTS[2]])
    assert a[0][0]["label"] == b[0][0]["label"] and abs(a[0][0]["score"] - b[0][0]["score"]) < 1e-5


def test_sessions_of_a_variant_share_its_weights_read_once(zoo, tmp_path):
    """Two engines on one variant hold the same buffer of its weights file (a server's instances), and
    rewriting the artifact in place under them (truncating the weights) changes no answer: the weights
    were read, not mapped (a mapped file truncated under a process stops it with SIGBUS)."""
    import shutil

    from modelkiln.runtime.onnx import OnnxEngine

    artifact = shutil.copytree(zoo.artifact("bert", "text-classification"), tmp_path / "a")
    graph = artifact / Manifest.load(artifact).variant("int8").file
    first, second = OnnxEngine(graph, threads=1), OnnxEngine(graph, threads=1)
    assert first._weights is not None and first._weights is second._weights
    feeds = {name: np.ones((2, 7), np.int64) for name in first.input_names}
    before = first.run(feeds)
    (artifact / (graph.name + ".data")).write_bytes(b"")
    for engine in (first, second):
        after = engine.run(feeds)
        assert all(np.array_equal(before[k], after[k]) for k in before)


def test_serving_path_needs_neither_torch_nor_transformers(zoo):
    import subprocess
    import sys

    from helpers import SRC

    folder = zoo.artifact("roberta", "question-answering")
    code = (
        "import sys\n"
        "from modelkiln.runtime.pipeline import load_pipeline\n"
        f"p = load_pipeline({str(folder)!r})\n"
        "print(p([('Who?', 'Marie Curie won.')])[0]['answer'] is not None)\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONPATH": str(SRC)})
    assert res.returncode == 0, res.stderr
    assert res.stdout.split("\n")[:2] == ["True", "[]"]
