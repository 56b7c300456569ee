"""The generated repository on the real tritonserver (from the nvidia-pytriton wheel, python
backend, CPU): the ensemble's answers must equal the project's own pipeline answers — what
`kiln serve` returns — for the same artifact and texts, for every task.

One server serves all the repositories (several --model-repository flags) so the suite pays
for one startup."""

from __future__ import annotations

import importlib.util
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

http = pytest.importorskip("tritonclient.http")
pytest.importorskip("pytriton")

from modelkiln.manifest import Manifest  # noqa: E402
from modelkiln.runtime.pipeline import load_pipeline  # noqa: E402
from modelkiln.tasks import tensors as protocol  # noqa: E402
from modelkiln.triton import server  # noqa: E402
from modelkiln.triton.config import Options  # noqa: E402
from modelkiln.triton.repository import model_name, write_repository  # noqa: E402

# (arch, task): roberta/distilbert have no token_type_ids, so the inputs really come from kiln.json.
CASES = [
    ("bert", "text-classification"),
    ("roberta", "text-classification"),
    ("bert", "sentence-embeddings"),
    ("bert", "token-classification"),
    ("bert", "question-answering"),
]

TEXTS = [
    "The movie was wonderful.",
    "A man is playing a guitar on the street while a small crowd of tourists listens and takes photographs.",
    "John Smith moved from London to New York in 1999.",
    "Ünïcödé text — with “quotes”, emoji 🙂 and tabs\tinside.",
    "x",
]
PAIRS = [("A man is eating food.", "A man is eating a meal."), ("The cat sleeps.", "Stock markets fell sharply today.")]
QA = [
    ("Where does Marie live?", "Marie lives in Paris with her two cats and works at a bakery near the river."),
    ("When did it open?", "The museum opened in 1851. " * 30),  # context longer than max_length: truncated
    ("Who?", "Nobody."),
]


def inputs_for(task: str) -> list[list]:
    """Requests to send: several batched requests, and single-example ones."""
    if task == "question-answering":
        return [QA, [QA[0]], [QA[2]]]
    requests = [TEXTS, [TEXTS[0]], TEXTS[1:3]]
    if task == "text-classification":
        requests.append(PAIRS)
    return requests


# OpenVINO's int8 variant (NNCF's IR, no model.onnx left in the artifact) in the python backend, where the
# openvino and nncf extras are installed
OPENVINO = ("bert-openvino", "sentence-embeddings")
HAS_OPENVINO = all(importlib.util.find_spec(m) for m in ("openvino", "nncf"))


@pytest.fixture(scope="module")
def triton(zoo, tmp_path_factory):
    root = tmp_path_factory.mktemp("triton-repos")
    repos, artifacts = [], {}
    options = Options(model_backend="python", max_batch_size=8, max_queue_delay_us=2000, threads=1)
    for arch, task in CASES:
        artifact = zoo.artifact(arch, task)
        repos.append(write_repository(artifact, root / f"{arch}-{task}", options))
        artifacts[(arch, task)] = artifact
    if HAS_OPENVINO:
        artifact = zoo.artifact("bert", "sentence-embeddings", ("openvino-int8",))
        repos.append(write_repository(artifact, root / "openvino", options))
        artifacts[OPENVINO] = artifact
    srv = server.start(repos, timeout=180)
    yield srv, artifacts
    srv.stop()


def infer(client, name: str, task: str, labels: list[str], inputs: list) -> list:
    request = []
    for key, value in protocol.tensors_from_inputs(task, inputs).items():
        value = value.reshape(-1, 1)  # the ensemble's inputs have dims [1]
        tensor = http.InferInput(key, list(value.shape), "BYTES")
        tensor.set_data_from_numpy(value)
        request.append(tensor)
    result = client.infer(name, request)
    return protocol.answers_from_tensors(task, labels, {n: result.as_numpy(n) for n in protocol.TASK_OUTPUTS[task]})


def assert_same(task: str, got: list, want: list) -> None:
    """Exact labels / spans / entity boundaries; scores within float noise (the ensemble pads to
    a bucket width, the pipeline to the longest text, so the floats differ in the last bits)."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if task == "text-classification":
            assert [x["label"] for x in g] == [x["label"] for x in w]
            np.testing.assert_allclose([x["score"] for x in g], [x["score"] for x in w], atol=1e-5)
        elif task == "sentence-embeddings":
            assert g.shape == w.shape
            np.testing.assert_allclose(g, w, atol=1e-5)
        elif task == "token-classification":
            assert [(e["entity_group"], e["word"], e["start"], e["end"]) for e in g] == [
                (e["entity_group"], e["word"], e["start"], e["end"]) for e in w]
            np.testing.assert_allclose([e["score"] for e in g], [e["score"] for e in w], atol=1e-5)
        else:
            assert (g["answer"], g["start"], g["end"]) == (w["answer"], w["start"], w["end"])
            assert g["score"] == pytest.approx(w["score"], abs=1e-5)


@pytest.mark.parametrize(("arch", "task"), CASES, ids=[f"{a}-{t}" for a, t in CASES])
def test_ensemble_matches_pipeline(triton, arch, task):
    srv, artifacts = triton
    artifact = artifacts[(arch, task)]
    manifest = Manifest.load(artifact)
    pipeline = load_pipeline(artifact)
    client = http.InferenceServerClient(srv.url)
    for inputs in inputs_for(task):
        assert_same(task, infer(client, model_name(manifest), task, manifest.labels or [], inputs), pipeline(inputs))


@pytest.mark.skipif(not HAS_OPENVINO, reason="the openvino and nncf extras are not installed")
def test_an_openvino_variant_matches_its_pipeline_bit_for_bit(triton):
    """Rows of every width, batched by Triton and padded by the python model: the OpenVINO engine runs
    each length unpadded, so each text gets the bits it gets alone."""
    srv, artifacts = triton
    artifact = artifacts[OPENVINO]
    manifest = Manifest.load(artifact)
    assert [v.name for v in manifest.kept_variants()] == ["openvino-int8"] and not (artifact / "model.onnx").exists()
    pipeline = load_pipeline(artifact)
    client = http.InferenceServerClient(srv.url)
    got = infer(client, model_name(manifest), manifest.task, [], TEXTS)
    for g, text in zip(got, TEXTS):
        assert np.array_equal(g, pipeline([text])[0])


def test_concurrent_requests_are_batched_and_still_match(triton):
    """Many one-text requests at once: the dynamic batcher joins those of the same width."""
    srv, artifacts = triton
    artifact = artifacts[("bert", "sentence-embeddings")]
    manifest = Manifest.load(artifact)
    pipeline = load_pipeline(artifact)
    texts = TEXTS * 4

    def one(text: str):
        client = http.InferenceServerClient(srv.url)
        return infer(client, model_name(manifest), manifest.task, [], [text])[0]

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(one, texts))
    assert_same(manifest.task, got, [pipeline([t])[0] for t in texts])
    stats = http.InferenceServerClient(srv.url).get_inference_statistics(f"{model_name(manifest)}_model")
    model_stats = stats["model_stats"][0]
    # Every row went through the model; executions ≤ rows (fewer when requests were joined).
    assert int(model_stats["inference_count"]) >= len(texts)
    assert int(model_stats["execution_count"]) <= int(model_stats["inference_count"])


def test_invalid_input_is_a_clear_error(triton):
    srv, artifacts = triton
    manifest = Manifest.load(artifacts[("bert", "question-answering")])
    client = http.InferenceServerClient(srv.url)
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException, match="question and context must not be empty"):
        infer(client, model_name(manifest), manifest.task, [], [("  ", "some context")])
