"""PyTorch reference engine (conversion's validation and bench's baseline). Imports torch, so it
is never imported by the serving path."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


class TorchEngine:
    def __init__(self, module: Any, input_names: Sequence[str], output_names: Sequence[str],
                 threads: int | None = None, device: str = "cpu", half: bool = False):
        import torch

        if threads:
            torch.set_num_threads(threads)
        self._torch = torch
        self.device = device
        self.module = module.to(device)
        if half:
            self.module = self.module.half()
        self.name = f"pytorch {'fp16' if half else 'fp32'}"
        self.input_names = list(input_names)
        self.output_names = list(output_names)

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        torch = self._torch
        with torch.inference_mode():
            tensors = [torch.from_numpy(feeds[n]).to(self.device) for n in self.input_names]
            outputs = self.module(*tensors)
        return {n: o.float().cpu().numpy() for n, o in zip(self.output_names, outputs)}
