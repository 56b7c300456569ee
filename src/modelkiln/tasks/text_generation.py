"""Text generation's Open Inference Protocol contract: one BYTES ``text_input`` in, one BYTES
``text_output`` out (the names of Triton's generate extension and of its vLLM / TensorRT-LLM
backends, so the same client code works). Sampling settings travel as request parameters
(``max_tokens``, ``temperature``, ...: ``generation/request/params.py``).

Not a ``Task`` subclass: an encoder task's prepare / postprocess / agreement do not apply to a
decoder. The server's model metadata and its OIP infer route derive from this module, and
``is_generation`` is the one test of whether an artifact holds such a model."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..errors import InvalidInputError
from ..manifest import Manifest
from .tensors import TensorSpec
from . import tensors as t

NAME = "text-generation"
TEXT_INPUT = "text_input"
TEXT_OUTPUT = "text_output"

INPUTS = (TensorSpec(TEXT_INPUT, "BYTES", (1,)),)
OUTPUTS = (TensorSpec(TEXT_OUTPUT, "BYTES", (1,)),)


def is_generation(manifest: Manifest) -> bool:
    """Whether the artifact holds a text-generation model: a decoder that ``generation/`` runs
    (not a ``Task``), with the manifest section it reads (end-of-sequence ids, chat template...)."""
    return manifest.task == NAME and manifest.generation is not None


def prompt_from_tensors(tensors: Mapping[str, np.ndarray]) -> str:
    """The one prompt of an OIP request (a request is one generation: batch several as several requests)."""
    unknown = sorted(set(tensors) - {TEXT_INPUT})
    if unknown:
        raise InvalidInputError(f"unknown input {unknown[0]!r} for a text-generation model (inputs: {TEXT_INPUT})")
    if TEXT_INPUT not in tensors:
        raise InvalidInputError(f"a text-generation request needs the BYTES input '{TEXT_INPUT}'")
    texts = t.text_column(TEXT_INPUT, tensors[TEXT_INPUT])
    if len(texts) != 1:
        raise InvalidInputError(f"'{TEXT_INPUT}' must hold exactly one prompt, got {len(texts)}")
    return texts[0]


def output_tensor(text: str) -> np.ndarray:
    return t.bytes_tensor([text])
