"""``kiln serve --workers N`` is one server to its clients: the same answers bit for bit, from every
worker, over HTTP and gRPC; metrics and statistics that add up over the workers; a worker killed
under load replaced while the others serve and no client hangs; text generation refused; a port in
use refused before anything loads. (The model repository with workers: test_model_repository.py;
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
import pytest
import tritonclient.grpc as grpcclient

from helpers import SRC
from modelkiln.samples import SAMPLE_TEXTS
from servers import GrpcServer
from servers import Server


def worker_pids(pid: int) -> list[int]:
    """The worker processes of a server.

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
    return sorted(c for c in children if b"worker_main" in read(Path(f"/proc/{c}/cmdline")))


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


def test_text_generation_is_served_by_one_process(tiny_generation_artifact):
    env = {**os.environ, "PYTHONPATH": str(SRC), "KILN_GRPC_PORT": "0"}
    done = subprocess.run([sys.executable, "-m", "modelkiln", "serve", f"gen={tiny_generation_artifact}", "--workers", "2"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2
    assert "text-generation models are served by one process: --workers 1 (--workers 2 was asked for)" in done.stderr


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
