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
