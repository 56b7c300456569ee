"""The OpenVINO engine (runtime/openvino.py) and its variants: built by `kiln convert` (fp32 and bf16 on
the exported model.onnx, int8 as NNCF's IR calibrated on real text) and gated like any variant,
offered bf16 only where the CPU computes it natively, answers close to onnxruntime's on the same
file, a text's answer the same bits alone as in a padded batch, and `kiln serve` of such a variant.
Skipped where the openvino and nncf extras are not installed."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

pytest.importorskip("openvino", reason="the openvino extra is not installed (pip install 'modelkiln[openvino]')")
pytest.importorskip("nncf", reason="the nncf extra is not installed (pip install 'modelkiln[nncf]')")

from modelkiln.convert.artifact import openvino_offered  # noqa: E402
from modelkiln.convert.validate import BATCH_MIN_COSINE, batch_invariance  # noqa: E402
from modelkiln.machine import cpu_flags, matrix_engine, native_bf16  # noqa: E402
from modelkiln.manifest import Manifest  # noqa: E402
from modelkiln.runtime.onnx import OnnxEngine  # noqa: E402
from modelkiln.runtime.openvino import OpenVinoEngine  # noqa: E402
from modelkiln.runtime.pipeline import load_encoder, load_pipeline  # noqa: E402
from modelkiln.samples import SAMPLE_TEXTS  # noqa: E402
from servers import Server  # noqa: E402

OPENVINO_ONLY = ("openvino-fp32", "openvino-bf16", "openvino-int8")
NATIVE_BF16 = native_bf16(cpu_flags()) is not None


@pytest.fixture(scope="module")
def artifact(zoo):
    """A tiny embedding model converted to OpenVINO's variants only: fp32 is validated as their base
    but not kept, and its file must stay (they run it)."""
    return zoo.artifact("bert", "sentence-embeddings", OPENVINO_ONLY)


def test_the_variants_are_gated_and_run_the_exported_file(artifact):
    manifest = Manifest.load(artifact)
    variants = {v.name: v for v in manifest.variants}
    assert not variants["fp32"].kept and variants["fp32"].file is None
    assert (artifact / "model.onnx").is_file()
    fp32 = variants["openvino-fp32"]
    assert fp32.kept and fp32.engine == "openvino" and fp32.file == "model.onnx" and fp32.precision == "fp32"
    assert fp32.validation.max_abs_diff < 1e-4 and fp32.validation.batch_min_cosine >= BATCH_MIN_COSINE
    assert fp32.latency_ms is not None and fp32.details["matrix_engine"] in ("AVX-512", "AVX2", "NEON", "scalar")
    bf16 = variants["openvino-bf16"]
    if NATIVE_BF16:
        assert bf16.engine == "openvino" and bf16.validation.passed and bf16.kept
        assert bf16.details["matrix_engine"] == native_bf16(cpu_flags())
    else:
        assert not bf16.kept and "natively" in bf16.reason
    assert "openvino" in manifest.versions
    int8 = variants["openvino-int8"]
    assert int8.kept and int8.engine == "openvino" and int8.precision == "int8", int8.reason
    assert int8.file == "model.openvino-int8.xml" and (artifact / "model.openvino-int8.bin").is_file()
    assert int8.details["method"].startswith("NNCF static") and "SQuAD" in int8.details["calibration"]
    assert int8.details["matrix_engine"] == matrix_engine("int8", "cpu", cpu_flags(), "openvino")
    assert int8.validation.batch_min_cosine > 1 - 1e-9  # the same vectors (bits: below)


def feeds_of(folder, texts):
    manifest = Manifest.load(folder)
    encoder = load_encoder(folder, manifest)
    return encoder.encode(list(texts))[0]


def test_outputs_are_close_to_onnxruntimes_on_the_same_file(artifact):
    feeds = feeds_of(artifact, SAMPLE_TEXTS[:8])
    theirs = OnnxEngine(artifact / "model.onnx", threads=1).run(feeds)["last_hidden_state"]
    engine = OpenVinoEngine(artifact / "model.onnx", "fp32", threads=1)
    assert engine.input_names == list(feeds) and engine.output_shapes["last_hidden_state"] == (-1, -1, 32)
    ours = engine.run(feeds)["last_hidden_state"]
    mask = feeds["attention_mask"].astype(bool)  # padded positions carry no meaning
    np.testing.assert_allclose(ours[mask], theirs[mask], atol=1e-4)
    if NATIVE_BF16:
        half = OpenVinoEngine(artifact / "model.onnx", "bf16", threads=1).run(feeds)["last_hidden_state"]
        a, b = half[mask].ravel().astype(np.float64), theirs[mask].ravel()
        assert a @ b / np.linalg.norm(a) / np.linalg.norm(b) > 0.999


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8"])
def test_a_text_answers_the_same_alone_and_in_a_padded_batch(artifact, precision):
    if precision == "bf16" and not NATIVE_BF16:
        pytest.skip("this CPU has neither AMX nor AVX-512 BF16")
    pipe = load_pipeline(artifact, f"openvino-{precision}", threads=1)
    texts = list(SAMPLE_TEXTS[:24])
    check = batch_invariance(pipe.task, pipe.encoder, pipe.engine, pipe.task.prepare(texts))
    assert check.passed and check.min_cosine > 1 - 1e-9, check
    # the same bits, not only close ones: each text alone, and in one batch padded to the longest
    batch, encodings = pipe.encoder.encode(texts)
    together = pipe.engine.run(batch)["last_hidden_state"]
    for row, encoding in enumerate(encodings):
        alone = pipe.engine.run(pipe.encoder.encode([texts[row]])[0])["last_hidden_state"][0]
        assert np.array_equal(alone, together[row, :len(encoding.ids)]), texts[row]


def test_rows_run_in_buckets_of_their_length_and_padded_positions_are_zeros(artifact, monkeypatch):
    from modelkiln.runtime.openvino import BUCKET

    engine = OpenVinoEngine(artifact / "model.onnx", "fp32", threads=1, pad_id=Manifest.load(artifact).tokenizer.pad_token_id)
    calls = []
    infer = engine._infer
    monkeypatch.setattr(engine, "_infer", lambda feeds: calls.append(feeds["input_ids"].shape) or infer(feeds))
    texts = ["short one", "a much longer text than the others, by far, and longer still: " * 3, "short two, a bit longer"]
    feeds = feeds_of(artifact, texts)
    out = engine.run(feeds)["last_hidden_state"]
    lengths = feeds["attention_mask"].sum(axis=1)
    assert lengths[0] < lengths[2] <= BUCKET < lengths[1]
    assert sorted(calls) == [(1, -(-int(lengths[1]) // BUCKET) * BUCKET), (2, BUCKET)]  # wider than the batch too
    assert out.shape[:2] == feeds["input_ids"].shape and not out[~feeds["attention_mask"].astype(bool)].any()
    engine.run(feeds_of(artifact, ["short one"]))  # alone: padded to its bucket all the same
    assert calls[-1] == (1, BUCKET)


def test_weights_files_are_read_not_mapped(artifact, tmp_path):
    """The ONNX file's external data (fp32) and the IR's .bin (int8) truncated under a running engine
    (an artifact copied over in place) change no answer: mapped, they would stop the process (SIGBUS)."""
    import shutil

    copy = shutil.copytree(artifact, tmp_path / "a")
    feeds = dict(load_encoder(copy, Manifest.load(copy)).encode([SAMPLE_TEXTS[0]])[0])
    for name, precision, weights in (("model.onnx", "fp32", "model.onnx.data"),
                                     ("model.openvino-int8.xml", "int8", "model.openvino-int8.bin")):
        engine = OpenVinoEngine(copy / name, precision, threads=1)
        before = engine.run(feeds)
        (copy / weights).write_bytes(b"")
        after = engine.run(feeds)
        assert all(np.array_equal(before[k], after[k]) for k in before), name


def test_calibration_is_real_text_in_each_tasks_form():
    from modelkiln.convert.pipeline import CALIBRATION_SIZE, calibration_inputs
    from modelkiln.tasks import task_class

    qa = calibration_inputs(task_class("question-answering"), None)
    assert len(qa) == 173 and all(isinstance(q, tuple) and len(q[0]) < len(q[1]) for q in qa)  # one per SQuAD context
    embeddings = calibration_inputs(task_class("sentence-embeddings"), None)
    assert len(embeddings) == CALIBRATION_SIZE and embeddings[:2] == list(qa[0])
    assert {type(x) for x in calibration_inputs(task_class("text-classification"), None)} == {str, tuple}
    assert calibration_inputs(task_class("sentence-embeddings"), ["mine", "and mine"]) == ["mine", "and mine"]


def test_a_failed_quantization_leaves_no_file(zoo, tmp_path, monkeypatch):
    from modelkiln.convert import variants
    from modelkiln.convert.pipeline import ConvertConfig, convert

    def fails(src, dst, calibration):
        dst.write_text("<net/>")
        dst.with_suffix(".bin").write_bytes(b"0")
        raise RuntimeError("NNCF does not know this graph")

    monkeypatch.setattr(variants, "quantize_openvino_int8", fails)
    out = tmp_path / "a"
    manifest = convert(ConvertConfig(model=str(zoo.model("bert", "sentence-embeddings")), out=out,
                                     precisions=("fp32", "openvino-int8"), threads=1, timing_seconds=0.02))
    int8 = next(v for v in manifest.variants if v.name == "openvino-int8")
    assert not int8.kept and int8.reason == "NNCF failed: NNCF does not know this graph"
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("model")) == ["model.onnx", "model.onnx.data"]


def test_bf16_is_offered_only_where_the_cpu_computes_it_and_int8_where_nncf_is_installed():
    assert openvino_offered(True, {"avx2", "avx512f", "avx512_bf16"}, True) == OPENVINO_ONLY  # EPYC Zen 4/5
    assert openvino_offered(True, {"avx2", "avx512f", "amx_tile", "amx_bf16"}, True) == OPENVINO_ONLY  # Xeon with AMX
    assert openvino_offered(True, {"avx2", "avx512f", "avx512_vnni"}, True) == ("openvino-fp32", "openvino-int8")
    assert openvino_offered(True, {"asimd"}) == ("openvino-fp32",)  # no quantizer: no int8
    assert openvino_offered(False, {"amx_bf16"}, True) == ()  # the extra is not installed
    assert matrix_engine("int8", "cpu", {"avx512_vnni", "amx_int8"}, "openvino") == "AMX"
    assert matrix_engine("int8", "cpu", {"avx512_vnni", "amx_int8"}) == "VNNI"  # kiln's int8 in onnxruntime


def test_kiln_serve_answers_with_an_openvino_variant(artifact):
    texts = ["hello world", "another text, a little longer than the first"]
    expected = np.stack(load_pipeline(artifact, "openvino-fp32")(texts))
    srv = Server([f"emb={artifact}", "--variant", "openvino-fp32"])
    try:
        got = httpx.post(srv.url + "/v1/embeddings", json={"model": "emb", "input": texts}, timeout=60).json()
        vectors = np.asarray([d["embedding"] for d in got["data"]], dtype=np.float32)
        np.testing.assert_allclose(vectors, expected, atol=1e-5)
        meta = httpx.get(srv.url + "/v2/models/emb", timeout=10).json()
        assert meta["platform"] == "openvino" and meta["parameters"]["variant"] == "openvino-fp32"
    finally:
        code, err = srv.stop()
    assert code == 0, err[-2000:]
