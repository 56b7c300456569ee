"""`kiln serve` end to end: a real server process called by real clients (tritonclient.http,
openai, httpx). Tiny random models keep it fast; tests/serve/test_serve_slow.py covers MiniLM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from error_cases import CASES, HTTP_STATUS
from modelkiln.errors import ErrorKind
from modelkiln.machine import cpu_flags, matrix_engine
from modelkiln.net import free_port
from modelkiln.runtime.pipeline import load_pipeline
from modelkiln.samples import SAMPLE_QA, SAMPLE_TEXTS
from servers import TASKS, Server

@pytest.fixture(scope="module")
def artifacts(zoo) -> dict[str, Path]:
    return {name: zoo.artifact("bert", task) for name, task in TASKS.items()}


@pytest.fixture(scope="module")
def server(artifacts):
    srv = Server([f"{n}={p}" for n, p in artifacts.items()] + ["--variant", "fp32", "--max-inputs-per-request", "64",
                                                               "--max-body-bytes", "200000", "--body-read-timeout", "1"])
    yield srv
    code, err = srv.stop()
    assert code == 0, err[-2000:]


@pytest.fixture(scope="module")
def reference(artifacts):
    return {n: load_pipeline(p, variant="fp32", threads=1) for n, p in artifacts.items()}


def post(server: Server, path: str, body, **kw) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(server.url + path, content=content, timeout=30, **kw)


# --- health, metadata ----------------------------------------------------------------------------


def test_health_metadata_and_stats(server):
    assert httpx.get(server.url + "/v2/health/live").status_code == 200
    assert httpx.get(server.url + "/v2/health/ready").status_code == 200
    meta = httpx.get(server.url + "/v2").json()
    assert meta["name"] == "modelkiln" and "binary_tensor_data" in meta["extensions"]
    fp32_unit = matrix_engine("fp32", "cpu", cpu_flags())
    for name, task in TASKS.items():
        for path in (f"/v2/models/{name}", f"/v2/models/{name}/versions/1"):
            m = httpx.get(server.url + path).json()
            assert m["name"] == name and m["parameters"]["task"] == task and m["versions"] == ["1"]
            assert m["parameters"]["matrix_engine"] == fp32_unit  # the unit its products run on
        assert httpx.get(f"{server.url}/v2/models/{name}/ready").status_code == 200
    emb = httpx.get(server.url + "/v2/models/emb").json()
    assert emb["inputs"] == [{"name": "TEXT", "datatype": "BYTES", "shape": [-1]}]
    assert emb["outputs"][0]["name"] == "EMBEDDINGS" and emb["outputs"][0]["shape"][1] > 0
    post(server, "/v2/models/cls/predict", {"inputs": "hello"})
    stats = httpx.get(server.url + "/v2/models/cls/stats").json()["model_stats"][0]
    assert stats["inference_stats"]["success"]["count"] >= 1 and stats["execution_count"] >= 1
    metrics = httpx.get(server.url + "/metrics").text
    for name in ("kiln_requests_total", "kiln_queue_duration_seconds", "kiln_batch_size", "kiln_batch_tokens",
                 "kiln_batch_compute_seconds", "kiln_requests_in_flight"):
        assert name in metrics
    assert 'route="predict",status="200"' in metrics
    for name, task in TASKS.items():  # Prometheus' info pattern: what each model runs, on which unit
        assert (f'kiln_model_info{{matrix_engine="{fp32_unit}",model="{name}",task="{task}",variant="fp32"}} 1.0'
                in metrics)


# --- tritonclient: every task, JSON and binary ------------------------------------------------------


def _triton_infer(server, model: str, inputs: dict[str, list[str]], binary: bool, outputs: list[str] | None = None):
    import tritonclient.http as th

    client = th.InferenceServerClient(server.url.removeprefix("http://"))
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(model)
    tensors = []
    for name, values in inputs.items():
        t = th.InferInput(name, [len(values)], "BYTES")
        t.set_data_from_numpy(np.array([v.encode() for v in values], dtype=object), binary_data=binary)
        tensors.append(t)
    requested = [th.InferRequestedOutput(n, binary_data=binary) for n in outputs] if outputs else None
    return client.infer(model, tensors, outputs=requested, request_id="req-42")


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_tritonclient_every_task(server, reference, binary):
    texts = list(SAMPLE_TEXTS[:5])
    result = _triton_infer(server, "emb", {"TEXT": texts}, binary)
    assert result.get_response()["id"] == "req-42"
    expected = np.stack(reference["emb"](texts))
    np.testing.assert_allclose(result.as_numpy("EMBEDDINGS"), expected, atol=1e-4)

    result = _triton_infer(server, "cls", {"TEXT": texts}, binary, outputs=["PROBABILITIES", "LABEL"])
    answers = reference["cls"](texts)
    labels = [a[0]["label"] for a in answers]
    assert [v.decode() if isinstance(v, bytes) else v for v in result.as_numpy("LABEL")] == labels
    assert result.as_numpy("PROBABILITIES").shape == (5, 2)
    assert result.as_numpy("SCORE") is None  # not requested: not returned
    pairs = _triton_infer(server, "cls", {"TEXT": texts[:2], "TEXT_PAIR": texts[2:4]}, binary)
    ref_pairs = reference["cls"](list(zip(texts[:2], texts[2:4])))
    np.testing.assert_allclose(pairs.as_numpy("SCORE"), [a[0]["score"] for a in ref_pairs], atol=1e-4)

    result = _triton_infer(server, "ner", {"TEXT": texts}, binary)
    entities = [json.loads(v) for v in result.as_numpy("ENTITIES")]
    assert [[e["word"] for e in ents] for ents in entities] == [[e["word"] for e in ents]
                                                                for ents in reference["ner"](texts)]

    qs, cs = [q for q, _ in SAMPLE_QA[:3]], [c for _, c in SAMPLE_QA[:3]]
    result = _triton_infer(server, "qa", {"QUESTION": qs, "CONTEXT": cs}, binary)
    ref = reference["qa"](list(zip(qs, cs)))
    assert list(result.as_numpy("START")) == [a["start"] for a in ref]
    assert list(result.as_numpy("END")) == [a["end"] for a in ref]
    got = [v.decode() if isinstance(v, bytes) else v for v in result.as_numpy("ANSWER")]
    assert got == [a["answer"] for a in ref]


def test_pretokenized_int64_inputs(server, reference):
    import tritonclient.http as th

    pipe = reference["emb"]
    feeds, _ = pipe.encoder.encode(list(SAMPLE_TEXTS[:3]))
    client = th.InferenceServerClient(server.url.removeprefix("http://"))
    tensors = []
    for name, array in feeds.items():
        t = th.InferInput(name, list(array.shape), "INT64")
        t.set_data_from_numpy(array, binary_data=True)
        tensors.append(t)
    result = client.infer("emb", tensors)
    np.testing.assert_allclose(result.as_numpy("EMBEDDINGS"), np.stack(pipe(list(SAMPLE_TEXTS[:3]))), atol=1e-4)
    # per-token task without text: the model's raw outputs come back
    feeds, _ = reference["ner"].encoder.encode(["Angela Merkel met Macron"])
    body = {"inputs": [{"name": n, "datatype": "INT64", "shape": list(a.shape), "data": a.ravel().tolist()}
                       for n, a in feeds.items()]}
    out = post(server, "/v2/models/ner/infer", body).json()["outputs"]
    assert out[0]["name"] == "logits" and out[0]["shape"][:2] == list(feeds["input_ids"].shape)


def test_json_infer_shape_n1_and_raw_json(server, reference):
    body = {"id": "abc", "inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [2, 1], "data": [["a b"], ["c"]]}],
            "outputs": [{"name": "EMBEDDINGS"}]}
    r = post(server, "/v2/models/emb/versions/1/infer", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["id"] == "abc" and out["model_name"] == "emb" and out["outputs"][0]["shape"][0] == 2
    np.testing.assert_allclose(np.array(out["outputs"][0]["data"]).reshape(2, -1),
                               np.stack(reference["emb"](["a b", "c"])), atol=1e-4)


# --- predict and OpenAI ----------------------------------------------------------------------------


def test_predict_every_task(server, reference):
    r = post(server, "/v2/models/cls/predict", {"inputs": "I love it"})
    expected = reference["cls"](["I love it"])[0]
    assert [a["label"] for a in r.json()] == [a["label"] for a in expected]
    assert [a["score"] for a in r.json()] == pytest.approx([a["score"] for a in expected], abs=1e-5)
    r = post(server, "/v2/models/cls/predict", {"inputs": ["a", {"text": "b", "text_pair": "c"}],
                                                 "parameters": {"top_k": 1}})
    assert [len(a) for a in r.json()] == [1, 1]
    emb = post(server, "/v2/models/emb/predict", {"inputs": ["x y", "z"]}).json()
    np.testing.assert_allclose(emb, np.stack(reference["emb"](["x y", "z"])), atol=1e-4)
    ner = post(server, "/v2/models/ner/predict", {"inputs": SAMPLE_TEXTS[17]}).json()
    assert [e["word"] for e in ner] == [e["word"] for e in reference["ner"]([SAMPLE_TEXTS[17]])[0]]
    q, c = SAMPLE_QA[0]
    qa = post(server, "/v2/models/qa/predict", {"inputs": {"question": q, "context": c}}).json()
    assert qa["answer"] == reference["qa"]([(q, c)])[0]["answer"] and set(qa) == {"answer", "score", "start", "end"}


def test_openai_client_embeddings(server, reference):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    texts = list(SAMPLE_TEXTS[:4])
    expected = np.stack(reference["emb"](texts))
    for kwargs in ({}, {"encoding_format": "float"}):  # the client asks for base64 by default
        res = client.embeddings.create(model="emb", input=texts, **kwargs)
        np.testing.assert_allclose(np.array([d.embedding for d in res.data]), expected, atol=1e-4)
        assert res.usage.prompt_tokens > 0 and res.model == "emb"
    single = client.embeddings.create(model="emb", input="hello")
    assert len(single.data) == 1
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nope", input="x")
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model="cls", input="x")
    metrics = httpx.get(server.url + "/metrics").text  # counted under the model named in the body
    assert 'kiln_requests_total{model="emb",protocol="http",route="embeddings",status="200"}' in metrics


# --- the error table ------------------------------------------------------------------------------


def error_message(r: httpx.Response) -> str:
    """OIP routes answer ``{"error": "..."}``; OpenAI's (/v1/...) ``{"error": {"message": ...}}``."""
    error = r.json()["error"]
    return error["message"] if isinstance(error, dict) else error


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_error_table(server, case):
    """Every bad request of tests/error_cases.py gets its kind's status and a clear message."""
    r = post(server, case.path, case.content())
    assert r.status_code == HTTP_STATUS[case.kind], (case.id, r.status_code, r.text)
    assert case.message in error_message(r), (case.id, r.json())
    assert r.headers["x-request-id"]
    if case.kind in (ErrorKind.TIMED_OUT, ErrorKind.OVERLOADED):
        assert r.headers["retry-after"] == "1"
    if case.route == "embeddings":  # OpenAI's error object, which its clients parse
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert r.json()["error"]["code"] == case.kind.value


def test_error_routes_methods_and_request_ids(server):
    r = httpx.get(server.url + "/v2/nothing/here")
    assert r.status_code == 404 and "error" in r.json()
    for path in ("/v2/models/emb/infer", "/v2/models/emb/versions/1/predict", "/v1/embeddings"):
        r = httpx.get(server.url + path)  # an inference route asked with the wrong method
        assert r.status_code == 405 and r.headers["allow"] == "POST" and "use POST" in error_message(r), (path, r.text)
    r = httpx.post(server.url + "/v2/models/emb/predict", content=b'{"inputs":"x"}', headers={"x-request-id": "rid-7"})
    assert r.headers["x-request-id"] == "rid-7"


def test_a_stalled_body_is_answered_408_in_bounded_time(server):
    """A client that announces a body and stops sending (issue 15: open, unanswered, after 40 s)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /v2/models/emb/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 150000\r\n\r\n{\"inputs\": ")
        started = time.monotonic()
        answer = sock.recv(65536)
        waited = time.monotonic() - started
        while chunk := sock.recv(65536):  # the rest, until the server closes the connection
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert b"not received within 1s" in answer and b"connection: close" in answer.lower()
        assert waited < 5, waited  # --body-read-timeout 1


def test_a_stalled_request_head_is_answered_408_and_a_silent_connection_closed(server):
    """uvicorn bounds nothing before a request's headers are complete: half a request line, or
    nothing at all, kept the connection open for good (found by tests/reliability/fault_suite.py). Now
    both end within --body-read-timeout (1 s here), and a keep-alive connection still works."""
    for sent, expected in ((b"POST /v2/models/emb/infer HTTP/1.1\r\nHost: x\r\nContent-Le", b"HTTP/1.1 408"), (b"", b"")):
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(sent)
            started = time.monotonic()
            answer = b""
            while chunk := sock.recv(65536):  # until the server closes the connection
                answer += chunk
            assert time.monotonic() - started < 5
            assert answer.startswith(expected), answer[:200]
            if expected:
                assert b"request head not received within 1s" in answer
    with httpx.Client(timeout=10) as client:  # keep-alive: a pause between requests is not a stalled head
        for _ in range(2):
            assert client.post(server.url + "/v2/models/emb/predict", json={"inputs": "x"}).status_code == 200
            time.sleep(1.5)


def test_bad_pretokenized_clients_do_not_fail_their_neighbours(server, reference):
    """Issue 15: out-of-vocabulary ids reached onnxruntime and failed every request batched with
    them. Now they are refused (400) before batching; good requests at the same time all succeed."""
    feeds, _ = reference["emb"].encoder.encode(list(SAMPLE_TEXTS[:2]))
    good = {"inputs": [{"name": n, "datatype": "INT64", "shape": list(a.shape), "data": a.ravel().tolist()}
                       for n, a in feeds.items()]}
    bad_ids = feeds["input_ids"].copy()
    bad_ids[0, 1] = 999999999
    bad = {"inputs": [{"name": n, "datatype": "INT64", "shape": list(a.shape), "data": a.ravel().tolist()}
                      for n, a in {**feeds, "input_ids": bad_ids}.items()]}

    def call(i: int) -> tuple[bool, int]:
        is_bad = i % 8 == 0
        with httpx.Client(timeout=30) as c:
            codes = [c.post(f"{server.url}/v2/models/emb/infer", json=bad if is_bad else good).status_code
                     for _ in range(10)]
            codes += [c.post(f"{server.url}/v2/models/emb/predict", json={"inputs": ["a text", "b"]}).status_code]
        return is_bad, codes

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(call, range(16)))
    for is_bad, codes in results:
        assert codes == ([400] * 10 if is_bad else [200] * 10) + [200], (is_bad, codes)


def test_tritonclient_error_surface(server):
    import tritonclient.http as th
    from tritonclient.utils import InferenceServerException

    client = th.InferenceServerClient(server.url.removeprefix("http://"))
    t = th.InferInput("TEXT", [1], "BYTES")
    t.set_data_from_numpy(np.array([b"x"], dtype=object))
    with pytest.raises(InferenceServerException, match="unknown model"):
        client.infer("nope", [t])


# --- concurrency: every client gets its own answers -------------------------------------------------


def test_concurrent_clients_get_their_own_answers(server, reference):
    texts = [f"{SAMPLE_TEXTS[i % len(SAMPLE_TEXTS)]} #{i}" for i in range(96)]
    expected = np.stack(reference["emb"](texts))
    labels = [a[0]["label"] for a in reference["cls"](texts)]

    def call(i: int) -> tuple[int, list, list]:
        with httpx.Client(timeout=30) as c:
            n = 1 + i % 3  # requests of 1..3 inputs, so batches mix requests and split them
            chunk = list(range(i, min(i + n, len(texts))))
            emb = c.post(f"{server.url}/v2/models/emb/predict", json={"inputs": [texts[k] for k in chunk]}).json()
            cls = c.post(f"{server.url}/v2/models/cls/predict", json={"inputs": [texts[k] for k in chunk]}).json()
            return i, chunk, [emb, cls]

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(call, range(len(texts))))
    for _, chunk, (emb, cls) in results:
        np.testing.assert_allclose(np.array(emb), expected[chunk], atol=1e-4)
        assert [a[0]["label"] for a in cls] == [labels[k] for k in chunk]
    sizes = httpx.get(server.url + "/metrics").text
    assert "kiln_batch_size_bucket" in sizes


# --- limits, auth, overload, shutdown, imports ------------------------------------------------------


def test_api_key_queue_full_and_no_truncate(artifacts):
    srv = Server([str(artifacts["emb"]), "--max-queue-size", "8", "--max-batch-size", "1", "--no-truncate"],
                 env={"KILN_API_KEY": "s3cret"})
    try:
        name = httpx.get(srv.url + "/v2/health/ready").status_code and "bert-sentence-embeddings-fp32-optimized-int8"
        auth = {"Authorization": "Bearer s3cret"}
        assert httpx.get(srv.url + f"/v2/models/{name}").status_code == 401
        assert httpx.get(srv.url + "/metrics").status_code == 401
        assert httpx.get(srv.url + f"/v2/models/{name}", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(srv.url + f"/v2/models/{name}", headers=auth).status_code == 200
        for scheme in ("bearer", "BEARER", "bEaReR"):  # HTTP auth schemes are case-insensitive
            assert httpx.get(srv.url + f"/v2/models/{name}", headers={"Authorization": f"{scheme} s3cret"}).status_code == 200
        assert httpx.get(srv.url + f"/v2/models/{name}", headers={"Authorization": "Basic s3cret"}).status_code == 401
        assert httpx.get(srv.url + f"/v2/models/{name}", headers={"Authorization": "bearers3cret"}).status_code == 401
        r = httpx.post(srv.url + f"/v2/models/{name}/predict", json={"inputs": "word " * 400}, headers=auth)
        assert r.status_code == 400 and "longer than" in r.json()["error"]

        def call(_: int) -> httpx.Response:
            return httpx.post(srv.url + f"/v2/models/{name}/predict", json={"inputs": list(SAMPLE_TEXTS[:6])},
                              headers=auth, timeout=30)

        with ThreadPoolExecutor(24) as pool:
            responses = list(pool.map(call, range(48)))
        codes = [r.status_code for r in responses]
        assert set(codes) <= {200, 503} and 503 in codes and 200 in codes, codes
        full = next(r for r in responses if r.status_code == 503)
        assert full.headers["retry-after"] == "1" and "queue full" in full.json()["error"]
    finally:
        code, err = srv.stop()
    assert code == 0, err[-2000:]


def test_work_of_clients_that_left_is_not_computed(artifacts):
    """Issue 15: of 200 requests whose clients closed the socket right after sending, 70 ran to
    completion. Clients here send 30 requests of 64 inputs (one input per batch: 1,920 batches
    of work) and hang up at once; the server must drop most of it, then be idle again."""
    srv = Server([f"emb={artifacts['emb']}", "--max-batch-size", "1", "--max-queue-size", "4096"],
                 env={"KILN_INSTANCES": "1", "KILN_ALONE_THREADS": "0"})
    try:
        body = json.dumps({"inputs": [f"{SAMPLE_TEXTS[19]} {i}" for i in range(64)]}).encode()
        request = (b"POST /v2/models/emb/predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        socks = [socket.create_connection(("127.0.0.1", srv.port), timeout=10) for _ in range(30)]
        for sock in socks:
            sock.sendall(request)
        for sock in socks:
            sock.close()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until nothing is queued or in flight
            metrics = httpx.get(srv.url + "/metrics").text
            values = {ln.split()[0]: float(ln.split()[-1]) for ln in metrics.splitlines()
                      if ln.startswith(("kiln_requests_in_flight", "kiln_queue_inputs"))}
            if values.get('kiln_queue_inputs{model="emb"}') == 0 and values["kiln_requests_in_flight"] == 1:
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"the server did not go idle: {values}")
        computed = httpx.get(srv.url + "/v2/models/emb/stats").json()["model_stats"][0]["inference_count"]
        assert computed < 30 * 64 / 4, computed  # measured: 0 of 1,920 (1,920 without the disconnect watch)
        assert 'route="predict",status="499"' in metrics
    finally:
        code, err = srv.stop()
    assert code == 0, err[-2000:]


def test_sigterm_finishes_accepted_requests(artifacts):
    srv = Server([f"emb={artifacts['emb']}", "--max-batch-size", "2", "--variant", "fp32"])
    texts = [f"{t} {i}" for i, t in enumerate(SAMPLE_TEXTS)] * 3
    results: list = [None] * 12
    started = threading.Barrier(13)

    def call(i: int) -> None:
        started.wait()
        try:
            results[i] = httpx.post(srv.url + "/v2/models/emb/predict", json={"inputs": texts}, timeout=60)
        except httpx.HTTPError as exc:  # pragma: no cover - a failure is what the test looks for
            results[i] = exc

    threads = [threading.Thread(target=call, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    started.wait()
    deadline = time.monotonic() + 10  # SIGTERM once every request is in flight (accepted)
    while time.monotonic() < deadline:
        metrics = httpx.get(srv.url + "/metrics", timeout=10).text
        line = next((ln for ln in metrics.splitlines() if ln.startswith("kiln_requests_in_flight")), "0 0")
        if float(line.split()[-1]) >= 13:  # 12 + the metrics request itself
            break
        time.sleep(0.02)
    code, err = srv.stop()
    for t in threads:
        t.join()
    assert code == 0, err[-2000:]
    assert all(isinstance(r, httpx.Response) and r.status_code == 200 for r in results), results
    assert all(len(r.json()) == len(texts) for r in results)
    with pytest.raises(httpx.ConnectError):
        httpx.get(srv.url + "/v2/health/live")


@pytest.mark.parametrize("workers", ["1", "2"])
def test_server_never_imports_torch_or_transformers(artifacts, workers, tmp_path):
    """PYTHONPROFILEIMPORTTIME lists every module each server process imports (with --workers 2: the
    supervisor and both workers) on stderr, here a file (three processes' lists fill a pipe)."""
    log = tmp_path / "stderr.log"
    port = free_port()
    with log.open("w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "modelkiln", "serve", f"emb={artifacts['emb']}",
                                 f"qa={artifacts['qa']}", "--workers", workers, "--port", str(port)],
                                env={**os.environ, "KILN_THREADS": "1", "PYTHONPROFILEIMPORTTIME": "1"},
                                stdout=subprocess.DEVNULL, stderr=stderr)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 180
            while True:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                try:
                    if httpx.get(url + "/v2/health/ready", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
            httpx.post(url + "/v2/models/emb/predict", json={"inputs": "hello"}, timeout=30).raise_for_status()
            httpx.post(url + "/v1/embeddings", json={"model": "emb", "input": ["hello"]}, timeout=30).raise_for_status()
        finally:
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(60)
    assert code == 0
    err = log.read_text()
    imported = {line.rsplit("|", 1)[-1].strip() for line in err.splitlines() if line.startswith("import time:")}
    assert "fastapi" in imported and "onnxruntime" in imported
    heavy = sorted(m for m in imported if m.split(".")[0] in ("torch", "transformers", "pickle"))
    assert not [m for m in heavy if m.split(".")[0] != "pickle"], heavy


def test_not_ready_with_zero_models_and_settings_from_env():
    from modelkiln.serve.dataplane import DataPlane
    from modelkiln.serve.settings import ServeSettings, parse_model_arg

    assert not DataPlane({}, ServeSettings()).ready()
    s = ServeSettings.from_env({"KILN_PORT": "9", "KILN_TRUNCATE": "false", "KILN_MAX_QUEUE_DELAY_MS": "2.5"},
                               port=None, host="0.0.0.0")
    assert (s.port, s.truncate, s.max_queue_delay_ms, s.host) == (9, False, 2.5, "0.0.0.0")
    assert ServeSettings().host == "127.0.0.1"
    assert parse_model_arg("m=/x", None).name == "m" and parse_model_arg("/x", "int8").variant == "int8"


def test_fuzzed_requests_never_get_a_5xx(server):
    """Hypothesis against the real server: nearly valid OIP bodies (right names, odd shapes,
    types, outputs, parameters, binary flags) for every model get an answer or a 4xx, never a 5xx."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from test_codec_fuzz import near_valid, parameters

    outputs = st.one_of(st.none(), st.lists(st.fixed_dictionaries(
        {"name": st.sampled_from(["EMBEDDINGS", "LABEL", "SCORE", "PROBABILITIES", "ENTITIES", "ANSWER", "START",
                                  "logits", "NOPE"])},
        optional={"parameters": st.one_of(parameters, st.fixed_dictionaries({"binary_data": st.booleans()}))}),
        max_size=3))
    names = {"cls": ["TEXT", "TEXT_PAIR"], "emb": ["TEXT"], "ner": ["TEXT"], "qa": ["QUESTION", "CONTEXT"]}

    @st.composite
    def valid_inputs(draw: st.DrawFn, model: str) -> list[dict]:
        n = draw(st.integers(1, 3))
        columns = names[model][:1] if model == "cls" and draw(st.booleans()) else names[model]
        return [{"name": c, "datatype": "BYTES", "shape": draw(st.sampled_from([[n], [n, 1]])),
                 "data": draw(st.lists(st.text(min_size=1, max_size=12), min_size=n, max_size=n))} for c in columns]

    @st.composite
    def requests(draw: st.DrawFn) -> tuple[str, dict]:
        model = draw(st.sampled_from(list(TASKS)))
        inputs = draw(st.one_of(valid_inputs(model), st.lists(near_valid(), min_size=1, max_size=3)))
        body = draw(st.fixed_dictionaries({}, optional={"outputs": outputs, "parameters": parameters,
                                                        "id": st.text(max_size=4)}))
        return model, {"inputs": inputs, **body}

    seen: dict[int, int] = {}

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(requests())
    def check(request: tuple[str, dict]) -> None:
        model, body = request
        r = httpx.post(f"{server.url}/v2/models/{model}/infer", content=json.dumps(body), timeout=30)
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, (model, body, r.text)

    with httpx.Client():
        check()
    assert seen.get(200, 0) > 0 and sum(v for k, v in seen.items() if 400 <= k < 500) > 0, seen
