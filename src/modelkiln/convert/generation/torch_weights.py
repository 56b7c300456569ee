"""A torch variant's file: the model's weights in one safetensors file, under transformers' own
names, in the variant's precision (the artifact's ``config.json`` says what model they belong to).
The torch engines read it (generation/engines/torch/engine.py, runtime/torch_encoder.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

TORCH_PRECISIONS = ("fp32", "bf16", "fp16")


def torch_dtype(precision: str) -> Any:
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def variant_name(precision: str) -> str:
    """``torch-fp32``, ``torch-bf16``, ``torch-fp16``: a torch variant's name in kiln.json."""
    return f"torch-{precision}"


def weights_file(precision: str) -> str:
    return f"model.torch-{precision}.safetensors"


def save_weights(model: Any, path: Path, precision: str) -> Path:
    """The module's parameters and persistent buffers cast to ``precision``; a tensor shared by two
    names (tied embeddings) is written once, under the first name (the loaders tie it again)."""
    from safetensors.torch import save_file

    dtype = torch_dtype(precision)
    tensors, seen = {}, set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        tensors[name] = (tensor.to(dtype) if tensor.is_floating_point() else tensor).detach().contiguous()
    save_file(tensors, str(path), metadata={"format": "pt", "precision": precision})
    return path
