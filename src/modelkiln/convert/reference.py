"""The PyTorch model an artifact came from, as an engine: bench's baseline and eval's reference."""

from __future__ import annotations

from typing import Any

from ..errors import KilnError
from ..manifest import Manifest
from ..runtime.torch_engine import TorchEngine
from . import source as src
from .export import TaskModule


def reference_module(manifest: Manifest) -> Any:
    model_ref = manifest.source.get("model")
    if not model_ref:
        raise KilnError(f"artifact '{manifest.name}' does not record its source model")
    try:
        source = src.load_source(model_ref)
    except KilnError as exc:
        raise KilnError(f"the source model of '{manifest.name}' is not available ({exc}); pass --no-reference") from exc
    model = src.load_torch_model(source, manifest.task)
    return TaskModule(model, manifest.input_names, manifest.output_names)


def reference_engine(manifest: Manifest, threads: int | None = None, device: str = "cpu", half: bool = False) -> TorchEngine:
    return TorchEngine(reference_module(manifest), manifest.input_names, manifest.output_names, threads, device, half)
