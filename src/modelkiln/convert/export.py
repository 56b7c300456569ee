"""PyTorch → ONNX with dynamic batch and sequence axes."""

from __future__ import annotations

import logging
import shutil
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConversionError
from ..manifest import weights_file

log = logging.getLogger(__name__)

OPSET = 17
# Weights above this many bytes go to a file beside the graph (FILE.data), which every variant made
# from it keeps: 0, always. A server's sessions of one variant (its instances, the lone-request session)
# then share one copy of the weights, read once (runtime/onnx.py, shared_weights), where an inline graph
# gives each session its own. Above 2 GiB an inline graph is not even possible (protobuf's limit).
EXTERNAL_DATA_THRESHOLD = 0


class TaskModule:
    """Wraps a transformers model so ONNX export sees positional tensors in, a tuple of the task's
    named outputs out (a plain nn.Module subclass is created lazily to keep torch optional)."""

    def __new__(cls, model: Any, input_names: Sequence[str], output_names: Sequence[str]) -> Any:
        import torch

        class _Wrapped(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.model = model

            def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
                out = self.model(**dict(zip(input_names, tensors)), return_dict=True)
                return tuple(out[name] for name in output_names)

        return _Wrapped().eval()


def parameter_bytes(model: Any) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def export_onnx(
    module: Any,
    sample_feeds: dict[str, np.ndarray],
    input_names: Sequence[str],
    output_names: Sequence[str],
    per_token: bool,
    path: Path,
    external_data_threshold: int = EXTERNAL_DATA_THRESHOLD,
) -> Path:
    """Export ``module`` to ``path``. Weights go to one ``path.name + '.data'`` file beside it when
    they exceed the threshold (EXTERNAL_DATA_THRESHOLD; the exporter would otherwise write one loose
    file per tensor of a model above 2 GiB)."""
    import onnx
    import torch

    args = tuple(torch.from_numpy(sample_feeds[n]) for n in input_names)
    axes = {n: {0: "batch", 1: "sequence"} for n in input_names}
    for name in output_names:
        axes[name] = {0: "batch", 1: "sequence"} if per_token else {0: "batch"}
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".export-") as scratch:
        raw = Path(scratch) / "model.onnx"
        try:
            with warnings.catch_warnings(), torch.inference_mode():
                warnings.simplefilter("ignore")
                # The TorchScript exporter: its graphs are the ones ONNX Runtime's fusions are written for.
                torch.onnx.export(
                    module,
                    args,
                    str(raw),
                    input_names=list(input_names),
                    output_names=list(output_names),
                    dynamic_axes=axes,
                    opset_version=OPSET,
                    do_constant_folding=True,
                    dynamo=False,
                )
        except Exception as exc:  # the exporter raises many kinds; all mean this model did not export
            raise ConversionError(f"ONNX export failed: {str(exc).splitlines()[0]}") from exc
        if parameter_bytes(module) > external_data_threshold:
            save_onnx(onnx.load(str(raw)), path, external_data=True)
        else:
            shutil.move(str(raw), path)
    return path


def save_onnx(proto: Any, path: Path, external_data: bool) -> None:
    import onnx

    if external_data:
        onnx.save_model(
            proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
            location=weights_file(path).name, size_threshold=1024,
        )
    else:
        onnx.save_model(proto, str(path))


def has_external_data(path: Path) -> bool:
    return weights_file(path).is_file()
