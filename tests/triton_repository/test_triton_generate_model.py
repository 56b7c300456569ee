"""The Triton text-generation model (``triton/models/generate_model.py``) in process, with a stand-in
for Triton's ``triton_python_backend_utils``: its loop keeps the running batch within ``max_batch``,
and a response that cannot be sent costs that request only, not the thread and every later request.
(The real tritonserver runs the same file in tests/triton_repository/test_triton_generation.py.)"""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
import time
import types

import numpy as np
import pytest

from helpers import kiln
from modelkiln.manifest import Manifest
from modelkiln.triton.repository import model_name


class _Tensor:
    def __init__(self, name, array):
        self.name, self.array = name, array

    def as_numpy(self):
        return self.array


class _Response:
    def __init__(self, output_tensors=None, error=None):
        self.output_tensors, self.error = output_tensors or [], error


class _TritonError(Exception):
    INVALID_ARG = 3

    def __init__(self, message, code=0):
        super().__init__(message)
        self.code = code


class Sender:
    """Records what the model sends; ``broken`` raises instead, as a sender of a client gone can."""

    def __init__(self, broken=False):
        self.broken = broken
        self.cancelled = False  # Triton's python backend says so when the client has gone
        self.responses: list[tuple[_Response, int]] = []
        self.done = threading.Event()

    def is_cancelled(self):
        return self.cancelled

    def send(self, response, flags=0):
        if self.broken:
            raise RuntimeError("the client is gone")
        self.responses.append((response, flags))
        if flags:
            self.done.set()

    def text(self) -> str:
        assert all(r.error is None for r, _ in self.responses), [r.error for r, _ in self.responses]
        return "".join(t.array[0].decode() for r, _ in self.responses for t in r.output_tensors if t.name == "text_output")


class FakeRequest:
    def __init__(self, prompt: str, sender: Sender, **inputs):
        self.inputs = {"text_input": np.array([prompt.encode()], dtype=np.object_), **{
            k: np.array([v]) for k, v in inputs.items()}}
        self.sender = sender

    def get_response_sender(self):
        return self.sender

    def parameters(self):
        return "{}"


def _fake_pb_utils() -> types.ModuleType:
    pb = types.ModuleType("triton_python_backend_utils")
    pb.Tensor, pb.InferenceResponse, pb.TritonError = _Tensor, _Response, _TritonError
    pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    pb.get_input_tensor_by_name = lambda request, name: (
        _Tensor(name, request.inputs[name]) if name in request.inputs else None)
    return pb


@pytest.fixture
def load_model(tiny_generation_artifact, tmp_path, monkeypatch):
    """The generated repository's model.py, initialized with ``max_batch``."""
    repo = tmp_path / "repo"
    r = kiln("triton", str(tiny_generation_artifact), str(repo), "--threads", "1")
    assert r.returncode == 0, r.stderr
    name = model_name(Manifest.load(tiny_generation_artifact))
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", _fake_pb_utils())
    path = repo / name / "1" / "model.py"
    monkeypatch.setattr(sys, "path", list(sys.path))  # model.py puts its snapshot first: undone after the test
    models = []

    def load(max_batch: int, **more: str):
        spec = importlib.util.spec_from_file_location(f"kiln_triton_generate_{len(models)}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        model = module.TritonPythonModel()
        parameters = {"max_batch": {"string_value": str(max_batch)}, "threads": {"string_value": "1"},
                      **{k: {"string_value": v} for k, v in more.items()}}
        model.initialize({"model_config": json.dumps({"parameters": parameters})})
        models.append(model)
        return model

    yield load
    for model in models:
        model.finalize()


def test_the_batch_stays_within_max_batch(load_model):
    model = load_model(max_batch=2)
    widest = []
    engine = model.driver.core.engine
    step = engine.step
    engine.step = lambda tokens: (widest.append(len(tokens)), step(tokens))[1]
    senders = [Sender() for _ in range(6)]
    model.execute([FakeRequest(f"Hello number {i}", s, max_tokens=8, ignore_eos=True) for i, s in enumerate(senders)])
    assert all(s.done.wait(60) for s in senders)
    assert max(widest) == 2, widest


def test_a_response_that_cannot_be_sent_costs_that_request_only(load_model):
    model = load_model(max_batch=4)
    broken, good = Sender(broken=True), Sender()
    model.execute([FakeRequest("The quick brown fox", broken, max_tokens=6, ignore_eos=True),
                   FakeRequest("The quick brown fox", good, max_tokens=6, ignore_eos=True)])
    assert good.done.wait(60) and good.text()
    later = Sender()
    model.execute([FakeRequest("The quick brown fox", later, max_tokens=6, ignore_eos=True)])
    assert later.done.wait(60), "the model's thread ended with the failed send"
    assert later.text() == good.text()


def test_a_client_that_leaves_frees_its_sequence_and_others_go_on(load_model):
    """The Triton model runs the same driver thread as kiln serve: a request whose client has gone
    (its sender says so) is aborted at the next step instead of generating to its end."""
    model = load_model(max_batch=4)
    leaving, staying = Sender(), Sender()
    model.execute([FakeRequest("The quick brown fox", leaving, max_tokens=400, ignore_eos=True, stream=True),
                   FakeRequest("The quick brown fox", staying, max_tokens=40, ignore_eos=True)])
    deadline = time.monotonic() + 60
    while not leaving.responses and time.monotonic() < deadline:
        time.sleep(0.01)
    leaving.cancelled = True
    assert staying.done.wait(60) and staying.text()
    core = model.driver.core
    deadline = time.monotonic() + 10
    while core.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert core.running == 0 and len(leaving.responses) < 400


def test_a_request_past_its_deadline_ends_with_an_error(load_model):
    model = load_model(max_batch=4, timeout_s="0.2")
    sender = Sender()
    slow = model.driver.core.engine.step
    model.driver.core.engine.step = lambda tokens: (time.sleep(0.05), slow(tokens))[1]  # 100 tokens: 5 s
    model.execute([FakeRequest("The quick brown fox", sender, max_tokens=100, ignore_eos=True)])
    assert sender.done.wait(60)
    response, flags = sender.responses[-1]
    assert flags and response.error is not None and "timed out" in str(response.error)


def test_speculation_settings_reach_the_core(load_model, monkeypatch):
    """``kiln triton --speculate ngram --draft-tokens N`` writes them as the model's parameters
    (test_triton_config.py); the model hands them to the core as kiln serve does."""
    from modelkiln.generation.model import TextGenerationModel
    from modelkiln.generation.speculation import SpeculationOptions

    seen = []
    core = TextGenerationModel.core
    monkeypatch.setattr(TextGenerationModel, "core", lambda self, variant=None, options=None, hooks=None: (
        seen.append(options), core(self, variant, options, hooks))[1])
    load_model(max_batch=2)
    load_model(max_batch=2, speculate="ngram", draft_tokens="5")
    assert [o.speculation for o in seen] == [SpeculationOptions(), SpeculationOptions("ngram", 5)]


def test_kiln_triton_writes_the_speculation_settings(tiny_generation_artifact, tmp_path):
    from helpers import assert_one_line_error

    repo = tmp_path / "repo"
    r = kiln("triton", str(tiny_generation_artifact), str(repo), "--speculate", "ngram", "--draft-tokens", "5")
    assert r.returncode == 0, r.stderr
    config = (repo / model_name(Manifest.load(tiny_generation_artifact)) / "config.pbtxt").read_text()
    assert 'key: "speculate" value { string_value: "ngram" }' in config
    assert 'key: "draft_tokens" value { string_value: "5" }' in config
    for method, message in (("draft-model", "draft-model is not offered here"), ("medusa", "must be one of")):
        bad = kiln("triton", str(tiny_generation_artifact), str(tmp_path / method), "--speculate", method)
        assert_one_line_error(bad, message)
        assert not (tmp_path / method).exists()
