"""The contract between "what a task does" and "what an engine runs".

A task turns user inputs into tokenizer inputs (``prepare``), and model outputs back into
answers (``postprocess``). It also says how to compare two runs of the same model (``task_vector``
and ``agreement``), which is what conversion's validation gate uses. Conversion, bench, the
server and the generated Triton models all call these same methods, so answers cannot drift."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from tokenizers import Encoding

from ..errors import InvalidInputError
from ..manifest import Manifest

TextInput = str | tuple[str, str]


@dataclass(frozen=True)
class TaskInfo:
    """What conversion needs to know about a task before a model exists."""

    name: str
    output_names: tuple[str, ...]
    truncation: str  # tokenizers' truncation strategy for pairs
    per_token: bool  # outputs have a sequence axis (so padded positions must be ignored when comparing)


class Task(ABC):
    info: ClassVar[TaskInfo]

    def __init__(self, manifest: Manifest):
        self.manifest = manifest

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def output_names(self) -> tuple[str, ...]:
        return self.info.output_names

    # -- inputs ----------------------------------------------------------------------------
    def prepare(self, inputs: Sequence[Any]) -> list[TextInput]:
        """Check user inputs and return what the tokenizer takes. Raises InvalidInputError."""
        if not inputs:
            raise InvalidInputError("no inputs given")
        for i, item in enumerate(inputs):
            if not isinstance(item, str):
                raise InvalidInputError(f"input {i}: expected a string for {self.name}, got {type(item).__name__}")
        return list(inputs)

    # -- outputs ---------------------------------------------------------------------------
    @abstractmethod
    def postprocess(
        self, outputs: dict[str, np.ndarray], encodings: Sequence[Encoding], inputs: Sequence[TextInput]
    ) -> list[Any]:
        """Model outputs for a padded batch → one answer per input (JSON-friendly).
        ``inputs`` are the prepared texts the encodings came from (for character spans)."""

    @abstractmethod
    def task_vector(self, outputs: dict[str, np.ndarray], encodings: Sequence[Encoding]) -> list[np.ndarray]:
        """Per input, the numbers the task's answer is made of (probabilities, pooled embedding...).
        Validation compares these with cosine similarity."""

    @abstractmethod
    def agreement(self, reference: list[Any], candidate: list[Any]) -> float:
        """Fraction of inputs whose task-level answer is the same (label, span, entity tags)."""


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    shifted = x - np.max(x, axis=axis, keepdims=True)
    e = np.exp(shifted)
    return e / np.sum(e, axis=axis, keepdims=True)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))
