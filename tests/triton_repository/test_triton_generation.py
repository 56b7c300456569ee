"""`kiln triton` on a text-generation artifact, run on the real tritonserver (nvidia-pytriton's,
python backend, CPU): /generate, /generate_stream and tritonclient.grpc's stream give the same
greedy text as `kiln generate`, requests in flight together included."""

from __future__ import annotations

import json
import queue
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from helpers import kiln

pytest.importorskip("pytriton")
grpcclient = pytest.importorskip("tritonclient.grpc")

from modelkiln.manifest import Manifest  # noqa: E402
from modelkiln.triton import server as triton_server  # noqa: E402
from modelkiln.triton.repository import model_name  # noqa: E402

PROMPTS = ["The quick brown fox", "Hello", "Once upon a time there was", "ÜŋíçØdé ✓"]
TOKENS = 10


@pytest.fixture(scope="module")
def artifact(tiny_generation_artifact):
    return tiny_generation_artifact


@pytest.fixture(scope="module")
def expected(artifact) -> dict[str, str]:
    """What `kiln generate` answers, greedy, for each prompt."""
    answers = {}
    for prompt in PROMPTS:
        r = kiln("generate", str(artifact), prompt, "-n", str(TOKENS), "--temperature", "0", "--ignore-eos",
                 "--threads", "1", "--json")
        assert r.returncode == 0, r.stderr
        answers[prompt] = json.loads(r.stdout)["text"]
    return answers


@pytest.fixture(scope="module")
def triton(artifact, tmp_path_factory):
    repo = tmp_path_factory.mktemp("gen-repo") / "repo"
    r = kiln("triton", str(artifact), str(repo), "--threads", "1", "--max-batch-size", "8")
    assert r.returncode == 0, r.stderr
    name = model_name(Manifest.load(artifact))
    assert "decoupled python model" in r.stdout and (repo / name / "1" / "model.py").is_file()
    config = (repo / name / "config.pbtxt").read_text()
    assert "decoupled: true" in config and 'name: "text_input"' in config and 'name: "text_output"' in config
    srv = triton_server.start(repo, timeout=300)
    yield srv, name
    srv.stop()


def generate(url: str, name: str, prompt: str, **fields) -> httpx.Response:
    body = {"text_input": prompt, "max_tokens": TOKENS, "temperature": 0.0, "ignore_eos": True, **fields}
    return httpx.post(f"http://{url}/v2/models/{name}/generate", json=body, timeout=120)


def test_generate_equals_kiln_generate(triton, expected):
    srv, name = triton
    for prompt in PROMPTS:
        r = generate(srv.url, name, prompt)
        assert r.status_code == 200, r.text
        assert r.json()["text_output"] == expected[prompt], prompt
        assert r.json()["finish_reason"] == "length"
    # the same settings given as the request's parameters instead of inputs
    r = httpx.post(f"http://{srv.url}/v2/models/{name}/generate", timeout=120, json={
        "text_input": PROMPTS[0], "parameters": {"max_tokens": TOKENS, "temperature": 0.0, "ignore_eos": True}})
    assert r.status_code == 200 and r.json()["text_output"] == expected[PROMPTS[0]], r.text


def test_requests_in_flight_together_get_their_lone_answers(triton, expected):
    srv, name = triton
    prompts = PROMPTS * 3
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: generate(srv.url, name, p), prompts))
    assert [a.json()["text_output"] for a in answers] == [expected[p] for p in prompts]


def test_generate_stream_sends_pieces(triton, expected):
    srv, name = triton
    body = {"text_input": PROMPTS[2], "max_tokens": TOKENS, "temperature": 0.0, "ignore_eos": True, "stream": True}
    events = []
    with httpx.stream("POST", f"http://{srv.url}/v2/models/{name}/generate_stream", json=body, timeout=120) as r:
        assert r.status_code == 200 and "text/event-stream" in r.headers["content-type"]  # 2.51: "application/json, text/event-stream"
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    assert len(events) > 1  # streamed, not one answer
    assert "".join(e["text_output"] for e in events) == expected[PROMPTS[2]]
    assert events[-1]["finish_reason"] == "length"


def test_grpc_stream(triton, expected):
    srv, name = triton
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{srv.grpc_port}")
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        def tensor(input_name, value, datatype):
            t = grpcclient.InferInput(input_name, [1], datatype)
            t.set_data_from_numpy(np.array([value], dtype=object if datatype == "BYTES" else None))
            return t

        inputs = [tensor("text_input", PROMPTS[0].encode(), "BYTES"), tensor("stream", np.bool_(True), "BOOL"),
                  tensor("max_tokens", np.int32(TOKENS), "INT32"), tensor("ignore_eos", np.bool_(True), "BOOL"),
                  tensor("temperature", np.float32(0), "FP32")]
        client.async_stream_infer(name, inputs, request_id="g1")
        pieces = []
        while True:
            result, error = responses.get(timeout=120)
            assert error is None, error
            pieces.append(result.as_numpy("text_output")[0].decode())
            if result.as_numpy("finish_reason") is not None:
                break
    finally:
        client.stop_stream()
        client.close()
    assert len(pieces) > 1 and "".join(pieces) == expected[PROMPTS[0]]


def test_bad_requests_are_clear_errors_and_leave_others_alone(triton, expected):
    srv, name = triton
    r = httpx.post(f"http://{srv.url}/v2/models/{name}/generate", json={"max_tokens": 3}, timeout=60)
    assert r.status_code == 400 and "text_input" in r.text
    r = generate(srv.url, name, "hi", top_p=0.0)
    assert r.status_code == 400 and "top_p" in r.text
    assert generate(srv.url, name, PROMPTS[1]).json()["text_output"] == expected[PROMPTS[1]]
