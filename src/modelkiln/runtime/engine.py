"""What every backend implements: named numpy tensors in, named numpy tensors out.

The engine knows nothing about text, tasks or HTTP (see tasks/ and serve/)."""

from __future__ import annotations

from typing import Protocol

import numpy as np


class Engine(Protocol):
    name: str  # e.g. "onnxruntime-cpu int8", "pytorch fp32"
    input_names: list[str]
    output_names: list[str]
    output_shapes: dict[str, tuple[int, ...]]  # the model's outputs, -1 where dynamic

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...
