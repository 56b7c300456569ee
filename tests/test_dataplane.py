"""The data plane without a transport: it implements ``types.InferenceService`` exactly."""

from __future__ import annotations

import inspect

from modelkiln.serve.dataplane import DataPlane
from modelkiln.serve.types import InferenceService


def test_dataplane_implements_the_inference_service_protocol():
    wanted = [n for n, v in vars(InferenceService).items() if inspect.isfunction(v) and not n.startswith("_")]
    assert len(wanted) == 10
    for name in wanted:
        contract, ours = getattr(InferenceService, name), getattr(DataPlane, name)
        assert inspect.signature(ours) == inspect.signature(contract), name
        assert inspect.iscoroutinefunction(ours) == inspect.iscoroutinefunction(contract), name


def test_a_bug_logs_its_traceback_at_most_once_a_minute_per_place(caplog):
    """A client that can trigger a 500 must not be able to flood the log with tracebacks."""
    import logging

    import orjson

    from modelkiln.serve.errors import LogThrottle, bug_key, error_response

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
