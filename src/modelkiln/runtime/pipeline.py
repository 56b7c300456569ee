"""text → task.prepare → tokenizer → engine → task.postprocess: one call for bench and tests.
(The server runs the same stages, split across its queue and batcher.)"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..manifest import Manifest, Variant
from ..tasks import Task, make_task
from .engine import Engine, Runner
from .registry import open_encoder
from .tokenizer import TextEncoder


class Pipeline:
    def __init__(self, task: Task, encoder: TextEncoder, engine: Runner):
        self.task = task
        self.encoder = encoder
        self.engine = engine

    def __call__(self, inputs: Sequence[Any]) -> list[Any]:
        prepared = self.task.prepare(inputs)
        feeds, encodings = self.encoder.encode(prepared)
        outputs = self.engine.run(feeds)
        return self.task.postprocess(outputs, encodings, prepared)


def load_encoder(folder: Path | str, manifest: Manifest) -> TextEncoder:
    return TextEncoder.from_folder(folder, manifest.tokenizer, manifest.input_names, manifest.max_length)


def load_variant(folder: Path | str, manifest: Manifest, variant: Variant, threads: int | None = None,
                 memory_arena: bool = True) -> Engine:
    """The engine the variant names (runtime/registry.py): an ONNX Runtime session, or the torch engine."""
    return open_encoder(folder, manifest, variant, threads, memory_arena)


def load_pipeline(
    folder: Path | str, variant: str | None = None, device: str = "cpu", threads: int | None = None
) -> Pipeline:
    """Load an artifact (no torch, no transformers for an ONNX variant). ``variant`` None → fastest
    kept on ``device``."""
    manifest = Manifest.load(folder)
    chosen = manifest.variant(variant) if variant else manifest.fastest_variant(device)
    return Pipeline(make_task(manifest), load_encoder(folder, manifest), load_variant(folder, manifest, chosen, threads))
