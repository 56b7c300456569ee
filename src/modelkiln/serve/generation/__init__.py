"""Text generation in ``kiln serve``: a thread stepping the engine core (scheduler.py; the
scheduling itself is generation/core.py), the served model (model.py), request parameters (params.py),
and the protocol edges: OpenAI (openai_routes.py), Triton's generate extension
(generate_routes.py); OIP infer and gRPC streaming go through the data plane and servicer."""

from __future__ import annotations

from typing import Any

from ...manifest import Manifest
from ...tasks import text_generation


def served_model(spec: Any, settings: Any, metrics: Any) -> Any:
    """The served model for an artifact folder: ``GenerationModel`` for a text-generation
    artifact, the encoder ``ServedModel`` for every other task."""
    from pathlib import Path

    if Manifest.load(Path(spec.path)).task == text_generation.NAME:
        from .model import GenerationModel

        return GenerationModel(spec, settings, metrics)
    from ..model import ServedModel

    return ServedModel(spec, settings, metrics)


def is_generation(model: Any) -> bool:
    return model.task.name == text_generation.NAME
