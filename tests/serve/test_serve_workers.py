"""``kiln serve --workers N`` is one server to its clients: the same answers bit for bit, from every
worker, over HTTP and gRPC; metrics and statistics that add up over the workers; a worker killed
under load replaced while the others serve and no client hangs; text generation's engine in one
process behind the workers; a port in use refused before anything loads. (The model repository with workers: test_model_repository.py;
SIGTERM under load: the fault suite, run with --workers 2 by test_reliability.py.)"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest
import tritonclient.grpc as grpcclient

from helpers import SRC
from modelkiln.manifest import Manifest
from modelkiln.native import variant_matrix_engine
from modelkiln.samples import SAMPLE_TEXTS
from servers import GrpcServer
from servers import Server


def worker_pids(pid: int) -> list[int]:
    """The worker processes of a server."""
    return child_pids(pid, b"worker_main")


def engine_pids(pid: int) -> list[int]:
    """The engine process of a server that serves text generation with workers."""
    return child_pids(pid, b"engine_main")


def child_pids(pid: int, marker: bytes) -> list[int]:
    """The child processes of ``pid`` whose command line holds ``marker``.

    Threads end and workers die while /proc is read (a test kills one): whatever vanished
    between listing and reading is simply not there.
    """

    def read(path: Path) -> bytes:
        try:
            return path.read_bytes()
        except (FileNotFoundError, ProcessLookupError):
            return b""

    children = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        children += [int(c) for c in read(task / "children").split()]
    return sorted(c for c in children if marker in read(Path(f"/proc/{c}/cmdline")))


def worker_of(response: httpx.Response) -> str:
    """The answering process: request ids are a per-process prefix and a counter."""
    return response.headers["x-request-id"].rsplit("-", 1)[0]


def post_fresh(url: str, path: str, body: dict) -> httpx.Response:
    """On a new connection each time: the kernel spreads connections, not requests, over the workers."""
    return httpx.post(url + path, json=body, timeout=30, headers={"connection": "close"})


def metric(url: str, name: str, labels: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    found = re.search(rf"^{re.escape(name)}{{{re.escape(labels)}}} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


@pytest.fixture(scope="module")
def artifact(zoo) -> Path:
    return zoo.artifact("bert", "sentence-embeddings")


@pytest.fixture(scope="module")
def servers(artifact):
    """A server of two workers (HTTP and gRPC) and a one-process server of the same model."""
    args = [f"emb={artifact}", "--variant", "fp32"]
    many, one = GrpcServer([*args, "--workers", "2"]), Server([*args, "--workers", "1"])
    yield many, one
    for srv in (many, one):
        code, err = srv.stop()
        assert code == 0, err[-2000:]


def test_every_worker_answers_as_one_process_does_bit_for_bit(servers):
    many, one = servers
    assert len(worker_pids(many.proc.pid)) == 2 and worker_pids(one.proc.pid) == []
    answered_by = set()
    for k, text in enumerate(SAMPLE_TEXTS * 3):
        body = {"inputs": [text, SAMPLE_TEXTS[(k + 1) % len(SAMPLE_TEXTS)]]}
        got, want = post_fresh(many.url, "/v2/models/emb/predict", body), post_fresh(one.url, "/v2/models/emb/predict", body)
        assert got.status_code == 200 and got.content == want.content
        answered_by.add(worker_of(got))
    assert len(answered_by) == 2  # 24 connections, two workers: each took some


def test_grpc_answers_from_the_workers_equal_http(servers):
    many, _ = servers
    texts = np.array([t.encode() for t in SAMPLE_TEXTS[:3]], dtype=object)
    via_http = httpx.post(many.url + "/v2/models/emb/infer", timeout=30, json={
        "inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [3], "data": list(SAMPLE_TEXTS[:3])}]}).json()
    for _ in range(4):  # a client each time: its connection may land on either worker
        with grpcclient.InferenceServerClient(many.grpc_url) as client:
            tensor = grpcclient.InferInput("TEXT", [3], "BYTES")
            tensor.set_data_from_numpy(texts)
            answer = client.infer("emb", [tensor]).as_numpy("EMBEDDINGS")
        assert answer.tolist() == np.array(via_http["outputs"][0]["data"], dtype=np.float32).reshape(3, -1).tolist()


def test_metrics_and_statistics_add_up_over_the_workers(servers):
    many, _ = servers
    labels = 'model="emb",protocol="http",route="predict",status="200"'
    before = metric(many.url, "kiln_requests_total", labels)
    stats_before = httpx.get(many.url + "/v2/models/emb/stats").json()["model_stats"][0]
    workers = {worker_of(post_fresh(many.url, "/v2/models/emb/predict", {"inputs": [t, t]})) for t in SAMPLE_TEXTS * 2}
    assert len(workers) == 2
    sent = 2 * len(SAMPLE_TEXTS)
    assert metric(many.url, "kiln_requests_total", labels) - before == sent
    stats = httpx.get(many.url + "/v2/models/emb/stats").json()["model_stats"][0]
    assert stats["inference_count"] - stats_before["inference_count"] == 2 * sent
    assert stats["inference_stats"]["success"]["count"] - stats_before["inference_stats"]["success"]["count"] == sent
    assert "\nkiln_requests_in_flight 1.0\n" in httpx.get(many.url + "/metrics").text  # the metrics request itself


def test_a_worker_killed_under_load_is_replaced_and_no_client_hangs(artifact):
    server = Server([f"emb={artifact}", "--variant", "fp32", "--workers", "2"])
    outcomes: Counter = Counter()
    slowest = [0.0]
    answered_by: list[tuple[float, str]] = []
    stop = threading.Event()

    def client() -> None:
        with httpx.Client(timeout=20) as http:  # keep-alive: a killed worker's connections break
            while not stop.is_set():
                started = time.monotonic()
                try:
                    r = http.post(server.url + "/v2/models/emb/predict", json={"inputs": SAMPLE_TEXTS[:2]})
                    outcomes[r.status_code] += 1
                    answered_by.append((time.monotonic(), worker_of(r)))
                except httpx.TransportError as exc:  # the connection closed under it; a timeout would be a hang
                    outcomes[type(exc).__name__] += 1
                slowest[0] = max(slowest[0], time.monotonic() - started)

    try:
        first = worker_pids(server.proc.pid)
        clients = [threading.Thread(target=client) for _ in range(6)]
        for t in clients:
            t.start()
        time.sleep(1.5)
        os.kill(first[0], signal.SIGKILL)
        killed_at = time.monotonic()
        deadline = killed_at + 60
        while len(set(worker_pids(server.proc.pid)) - set(first)) < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        replacement = set(worker_pids(server.proc.pid)) - set(first)
        assert replacement, "no worker replaced the one killed"
        served_after_kill = sum(1 for at, _ in answered_by if at > killed_at)
        time.sleep(3)  # the replacement loads and serves: new connections reach it
        with_fresh = {worker_of(post_fresh(server.url, "/v2/models/emb/predict", {"inputs": "x"})) for _ in range(30)}
    finally:
        stop.set()
        for t in clients:
            t.join(30)
    code, err = server.stop()
    assert code == 0, err[-2000:]
    assert "ReadTimeout" not in outcomes and "WriteTimeout" not in outcomes and slowest[0] < 15, (outcomes, slowest)
    assert outcomes[200] > 0 and served_after_kill > 0  # the other worker kept serving
    assert set(outcomes) <= {200, "RemoteProtocolError", "ReadError", "ConnectError", "WriteError"}, outcomes
    assert len(with_fresh) == 2  # the survivor and the replacement
    assert "exited with code -9; starting another" in err and "worker" in err


GENERATION_BODIES = [
    {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0},
    {"prompt": "The weather today", "max_tokens": 16, "temperature": 0.9, "top_p": 0.9, "seed": 7},
    {"prompt": "A list of fruit:", "max_tokens": 10, "temperature": 1.0, "seed": 3, "frequency_penalty": 0.5},
    {"prompt": "JSON:", "max_tokens": 30, "temperature": 0.8, "seed": 5, "response_format": {"type": "json_object"}},
]


def completion(url: str, body: dict, stream: bool) -> tuple[str, str]:
    """(text, finish reason) of /v1/completions on a fresh connection, streamed (SSE) or whole."""
    body = {"model": "gen", **body, "stream": stream}
    if not stream:
        answer = post_fresh(url, "/v1/completions", body)
        assert answer.status_code == 200, answer.text
        choice = answer.json()["choices"][0]
        return choice["text"], choice["finish_reason"]
    text, finish = "", None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30, headers={"connection": "close"}) as answer:
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if line.startswith("data: {"):
                choice = orjson.loads(line[6:])["choices"][0]
                text += choice["text"]
                finish = choice["finish_reason"] or finish
    return text, finish


def test_text_generation_runs_its_engine_in_one_process_behind_the_workers(tiny_generation_artifact):
    """--workers 2 with a text-generation model: its engine in the engine process, two workers in front.
    Whole and streamed answers (greedy, seeded sampling with penalties, a grammar), many at once over
    fresh connections (spread over both workers), are the one-process server's; a bad request is the
    worker's 400; the engine's metrics are in /metrics; SIGTERM answers what was accepted and exits 0."""
    one = Server([f"gen={tiny_generation_artifact}", "--workers", "1"])
    try:
        expected = [completion(one.url, body, stream=False) for body in GENERATION_BODIES]
    finally:
        one.stop()
    server = Server([f"gen={tiny_generation_artifact}", "--workers", "2"])
    try:
        pids = worker_pids(server.proc.pid)
        assert len(pids) == 2 and len(engine_pids(server.proc.pid)) == 1
        got: dict[tuple[int, bool, int], tuple[str, str]] = {}

        def ask(i: int, stream: bool, turn: int) -> None:
            got[i, stream, turn] = completion(server.url, GENERATION_BODIES[i], stream)

        threads = [threading.Thread(target=ask, args=(i, stream, turn)) for i in range(len(GENERATION_BODIES))
                   for stream in (False, True) for turn in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(got) == len(threads)
        for (i, _, _), answer in got.items():
            assert answer == expected[i], (GENERATION_BODIES[i], answer, expected[i])
        bad = post_fresh(server.url, "/v1/completions", {"model": "gen", "prompt": "x", "max_tokens": -3})
        assert bad.status_code == 400 and "max_tokens" in bad.text
        assert metric(server.url, "vllm:generation_tokens_total", 'model_name="gen"') >= 24 * 10
        meta = httpx.get(server.url + "/v2/models/gen", timeout=10).json()["parameters"]  # a worker's answer
        variant = Manifest.load(tiny_generation_artifact).variant(meta["variant"])
        unit = variant_matrix_engine(variant.details, variant.precision, variant.device)
        assert meta["matrix_engine"] == unit
        assert metric(server.url, "kiln_model_info",  # written by the engine process
                      f'matrix_engine="{unit}",model="gen",task="text-generation",variant="{variant.name}"') == 1.0
        late = threading.Thread(target=ask, args=(1, True, 9))
        late.start()
        time.sleep(0.2)
        code, err = server.stop()  # SIGTERM with an answer streaming: it is finished first
        late.join(30)
        assert code == 0, err[-2000:]
        assert got[1, True, 9] == expected[1]
    finally:
        server.stop()


def test_the_server_ends_with_its_engine_process(tiny_generation_artifact):
    """The engine process killed: its answers are gone, so the whole server stops (exit 1), and an
    answer streaming then ends instead of hanging."""
    server = Server([f"gen={tiny_generation_artifact}", "--workers", "2"])
    try:
        first, ended = threading.Event(), []
        body = {"model": "gen", "prompt": "Once", "max_tokens": 900, "temperature": 0, "ignore_eos": True, "stream": True}

        def stream() -> None:
            try:
                with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as answer:
                    for line in answer.iter_lines():
                        first.set()
                        if '"finish_reason":"length"' in line:
                            ended.append("whole")
                ended.append("ended")
            except httpx.HTTPError as exc:
                ended.append(type(exc).__name__)

        reader = threading.Thread(target=stream)
        reader.start()
        assert first.wait(30)
        os.kill(engine_pids(server.proc.pid)[0], signal.SIGKILL)
        reader.join(30)
        assert server.proc.wait(60) == 1
        assert ended and "whole" not in ended, ended
        _, err = server.stop()
        assert "the engine process" in err and "stopping the server" in err, err[-2000:]
    finally:
        server.stop()


def test_a_port_in_use_is_refused_before_loading(artifact):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, "PYTHONPATH": str(SRC), "KILN_GRPC_PORT": "0"}
        done = subprocess.run([sys.executable, "-m", "modelkiln", "serve", f"emb={artifact}", "--workers", "2",
                               "--port", str(port)], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2
    assert f"cannot listen for HTTP on 127.0.0.1:{port}" in done.stderr and "loaded model" not in done.stderr
