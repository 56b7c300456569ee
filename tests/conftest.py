from __future__ import annotations

import os
from pathlib import Path

import pytest

# Tests never reach a hub: everything is built locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Servers started by tests open no gRPC port unless a test asks for one (--grpc-port): several
# servers run at once, and gRPC's default port 8001 would collide.
os.environ.setdefault("KILN_GRPC_PORT", "0")

from tiny_models import make_model  # noqa: E402
# Defined here, not imported by each test module: a session fixture imported into a module is a
# fixture of that module, so six modules built the tiny generation artifact six times.
from generation_helpers import (tiny_generation_artifact, tiny_kiln_attention_graph,  # noqa: E402,F401
                                tiny_kiln_attention_graph_f16, tiny_torch_artifact)


class TinyZoo:
    """Builds tiny models and converts them once per test session, on demand."""

    def __init__(self, root: Path):
        self.root = root
        self._models: dict[tuple, Path] = {}
        self._artifacts: dict[tuple, Path] = {}

    def model(self, arch: str, task: str, **kwargs) -> Path:
        key = (arch, task, tuple(sorted(kwargs.items())))
        if key not in self._models:
            name = "-".join([arch, task, *(f"{k}={v}" for k, v in sorted(kwargs.items()))])
            self._models[key] = make_model(arch, task, self.root / "models" / name, **kwargs)
        return self._models[key]

    def artifact(self, arch: str, task: str, precisions: tuple[str, ...] = ("fp32", "optimized", "int8"), **kwargs) -> Path:
        from modelkiln.convert.pipeline import ConvertConfig, convert

        key = (arch, task, precisions, tuple(sorted(kwargs.items())))
        if key not in self._artifacts:
            name = "-".join([arch, task, *precisions, *(f"{k}={v}" for k, v in sorted(kwargs.items()))])
            out = self.root / "artifacts" / name
            convert(ConvertConfig(model=str(self.model(arch, task, **kwargs)), out=out, precisions=precisions,
                                  threads=1, timing_seconds=0.02))
            self._artifacts[key] = out
        return self._artifacts[key]


@pytest.fixture(scope="session")
def zoo(tmp_path_factory) -> TinyZoo:
    return TinyZoo(tmp_path_factory.mktemp("zoo"))


@pytest.fixture(scope="session")
def encoder_server(zoo):
    """A real `kiln serve` of the tiny classifier (``cls``) and QA model (``qa``), fp32, HTTP and gRPC:
    the server both loadtest test modules measure, started once."""
    from servers import GrpcServer

    srv = GrpcServer([f"cls={zoo.artifact('bert', 'text-classification')}",
                      f"qa={zoo.artifact('bert', 'question-answering')}",
                      "--variant", "fp32", "--max-inputs-per-request", "8"])
    yield srv
    code, err = srv.stop()
    assert code == 0, err[-2000:]
