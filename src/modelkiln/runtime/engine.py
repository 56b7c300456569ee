"""What every backend implements: named numpy tensors in, named numpy tensors out.

The engine knows nothing about text, tasks or HTTP (see tasks/ and serve/)."""

from __future__ import annotations

from typing import Protocol

import numpy as np


class Runner(Protocol):
    """What running takes, and all that the gate, the bench and ``Pipeline`` ask of an engine (the
    PyTorch reference engine, runtime/torch_engine.py, is one and no more)."""

    name: str  # e.g. "onnxruntime-cpu int8", "pytorch fp32"
    input_names: list[str]
    output_names: list[str]

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...


class Engine(Runner, Protocol):
    """A variant's engine (runtime/registry.py opens it): it also says its outputs' shapes."""

    output_shapes: dict[str, tuple[int, ...]]  # the model's outputs, -1 where dynamic
