"""The data plane without a transport: it implements ``types.InferenceService`` exactly."""

from __future__ import annotations

import inspect
import re

from modelkiln.serve.dataplane import DataPlane
from modelkiln.serve.types import InferenceService


def test_dataplane_implements_the_inference_service_protocol():
    wanted = [n for n, v in vars(InferenceService).items() if inspect.isfunction(v) and not n.startswith("_")]
    assert len(wanted) == 11
    for name in wanted:
        contract, ours = getattr(InferenceService, name), getattr(DataPlane, name)
        assert inspect.signature(ours) == inspect.signature(contract), name
        assert inspect.iscoroutinefunction(ours) == inspect.iscoroutinefunction(contract), name


def test_a_bug_logs_its_traceback_at_most_once_a_minute_per_place(caplog):
    """A client that can trigger a 500 must not be able to flood the log with tracebacks."""
    import logging

    import orjson

    from modelkiln.serve.http.errors import LogThrottle, bug_key, error_response

    def bug(kind: type[Exception]) -> Exception:
        try:
            raise kind("boom")
        except Exception as exc:  # the same raise site each time
            return exc

    with caplog.at_level(logging.ERROR, logger="modelkiln.serve"):
        answers = [error_response(bug(ValueError), f"r{i}") for i in range(200)]
        error_response(bug(KeyError), "other")  # another type: its own traceback
    assert {(status, orjson.loads(body)["error"]) for status, body, _ in answers} == {
        (500, "internal server error (ValueError)")}
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert [r.exc_info[0] for r in tracebacks] == [ValueError, KeyError]

    clock = [0.0]
    throttle = LogThrottle(every_s=60, clock=lambda: clock[0])
    assert throttle.should_log(bug_key(bug(ValueError))) == (True, 0)
    assert throttle.should_log(bug_key(bug(ValueError))) == (False, 0)
    clock[0] = 61.0  # a minute later: logged again, with the count of the ones skipped
    assert throttle.should_log(bug_key(bug(ValueError))) == (True, 1)


def test_every_transport_neutral_error_case_has_a_typed_request():
    """The cases another transport (gRPC) runs decode into InferRequests it can encode."""
    from error_cases import CASES

    cases = [c for c in CASES if c.route == "infer" and not c.http_only]
    requests = {c.id: c.infer_request() for c in cases}
    assert [i for i, r in requests.items() if r is None] == ["shape-not-filled"]  # a codec-level refusal
    assert all(r.model_name == c.model and r.inputs for c, r in zip(cases, requests.values()) if r is not None)
    assert len(cases) >= 15


def test_the_data_plane_answers_the_error_table_with_typed_errors(zoo):
    """No transport at all: the same cases, as InferRequests, raise errors of the expected kind
    (what the gRPC servicer maps to its status codes)."""
    import asyncio

    import pytest
    from error_cases import CASES

    from modelkiln.errors import KilnError
    from modelkiln.serve.dataplane import build_dataplane
    from modelkiln.serve.settings import ServeSettings, parse_model_arg

    tasks = {"cls": "text-classification", "emb": "sentence-embeddings", "ner": "token-classification",
             "qa": "question-answering"}
    specs = tuple(parse_model_arg(f"{n}={zoo.artifact('bert', t)}", "fp32") for n, t in tasks.items())
    plane = build_dataplane(ServeSettings(max_inputs_per_request=64, threads=1, warmup=False).with_models(specs))

    async def run_all() -> None:  # one event loop: the batchers answer on the loop that submitted first
        for case in CASES:
            if case.route != "infer" or case.http_only or (request := case.infer_request()) is None:
                continue
            with pytest.raises(KilnError) as caught:
                await plane.infer(request)
            assert caught.value.kind == case.kind and case.message in str(caught.value), (case.id, caught.value)

    try:
        asyncio.run(run_all())
    finally:
        plane.stop()


def test_both_model_kinds_implement_the_served_model_protocol():
    """The data plane treats every model alike through ``ServedModel``: each kind must have every
    member, and each method must be async exactly where the protocol's is."""
    from modelkiln.serve.generation.model import GenerationModel
    from modelkiln.serve.model import EncoderModel
    from modelkiln.serve.served import ServedModel

    methods = {n: v for n, v in vars(ServedModel).items() if inspect.isfunction(v) and not n.startswith("_")}
    properties = [n for n, v in vars(ServedModel).items() if isinstance(v, property)]
    attributes = list(ServedModel.__annotations__)
    assert {"infer", "stream_infer", "predict", "metadata", "load", "release"} <= set(methods)
    assert {"full", "queued"} <= set(properties) and {"name", "stats", "in_flight"} <= set(attributes)
    for kind in (EncoderModel, GenerationModel):
        for name, contract in methods.items():
            ours = getattr(kind, name)
            assert inspect.iscoroutinefunction(ours) == inspect.iscoroutinefunction(contract), (kind, name)
            assert inspect.isasyncgenfunction(ours) == (name == "stream_infer"), (kind, name)
            assert list(inspect.signature(ours).parameters) == list(inspect.signature(contract).parameters), (kind, name)
        assert all(isinstance(getattr(kind, n), property) for n in properties), kind
        # instance attributes are set in __init__: read its source rather than load a model
        init = inspect.getsource(kind.__init__)
        missing = [n for n in attributes if not hasattr(kind, n) and not re.search(rf"self\.{n}\b[^=\n]*=", init)]
        assert not missing, (kind, missing)
