"""The contract between "what a task does" and "what an engine runs".

A task turns user inputs into tokenizer inputs (``prepare``), and model outputs back into
answers (``postprocess``). It also says how to compare two runs of the same model (``task_vector``
and ``agreement``), which is what conversion's validation gate uses. Conversion, bench, the
server and the generated Triton models all call these same methods, so answers cannot drift.

A task also owns its Open Inference Protocol contract: which BYTES tensors it takes
(``input_specs``), which answer tensors it gives (``output_specs``), and the conversions between
the two and its inputs and answers (``inputs_from_tensors``, ``tensors_from_answers``, and for
clients ``tensors_from_inputs`` / ``answers_from_tensors``). The server's model metadata, its
data plane and the Triton configs are derived from these, so none of them names a task."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from tokenizers import Encoding

from ..errors import InvalidInputError
from ..manifest import Manifest
from ..samples import SAMPLE_TEXTS
from .tensors import TensorSpec
from . import tensors as t

TextInput = str | tuple[str, str]


@dataclass(frozen=True)
class TaskInfo:
    """What conversion needs to know about a task before a model exists."""

    name: str
    output_names: tuple[str, ...]
    truncation: str  # tokenizers' truncation strategy for pairs
    per_token: bool  # outputs have a sequence axis (so padded positions must be ignored when comparing)
    labelled: bool = False  # answers name the model's labels (its config's id2label)
    pooled: bool = False  # answers pool the encoder's hidden states: any encoder can, no trained head needed


class Task(ABC):
    info: ClassVar[TaskInfo]
    # -- the protocol contract (see the module docstring) --
    inputs: ClassVar[tuple[str, ...]] = (t.TEXT,)  # required BYTES tensors, one element per example
    optional_inputs: ClassVar[tuple[str, ...]] = ()
    outputs: ClassVar[tuple[str, ...]]  # answer tensors, in the order metadata lists them
    # Answers made of character spans (entities, answer spans) need the text: pre-tokenized
    # requests, which carry none, get the model's raw outputs instead.
    answers_need_text: ClassVar[bool] = False
    embeds: ClassVar[bool] = False  # answers are vectors (served on OpenAI's /v1/embeddings too)
    # Built-in inputs of this task: the server's warm-up at load, and conversion's validation and
    # calibration set when no texts are given.
    sample_inputs: ClassVar[tuple[Any, ...]] = SAMPLE_TEXTS

    def __init__(self, manifest: Manifest):
        self.manifest = manifest

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def output_names(self) -> tuple[str, ...]:
        return self.info.output_names

    # -- protocol: tensors ⇄ inputs and answers -----------------------------------------------
    def input_specs(self) -> tuple[TensorSpec, ...]:
        return tuple(TensorSpec(n, "BYTES", (-1,), optional=n in self.optional_inputs)
                     for n in (*self.inputs, *self.optional_inputs))

    @abstractmethod
    def output_specs(self, model_outputs: Mapping[str, Sequence[int]]) -> tuple[TensorSpec, ...]:
        """The answer tensors, batch axis first (-1). ``model_outputs``: the ONNX model's output
        shapes (-1 where dynamic), for sizes only the model knows (an embedding's width)."""

    @classmethod
    def inputs_from_tensors(cls, tensors: Mapping[str, np.ndarray | None]) -> list[Any]:
        """The request's text tensors → what ``prepare`` takes (strings by default)."""
        return t.text_columns(cls.info.name, cls.inputs, cls.optional_inputs, tensors)[t.TEXT]

    @classmethod
    def tensors_from_inputs(cls, inputs: Sequence[Any]) -> dict[str, np.ndarray]:
        """Client side: inputs as the pipeline takes them → request tensors."""
        return {t.TEXT: t.bytes_tensor(list(inputs))}

    @classmethod
    @abstractmethod
    def tensors_from_answers(cls, labels: Sequence[str], answers: Sequence[Any]) -> dict[str, np.ndarray]:
        """``postprocess`` answers → the output tensors (``labels``: the manifest's)."""

    @classmethod
    @abstractmethod
    def answers_from_tensors(cls, labels: Sequence[str], tensors: Mapping[str, np.ndarray]) -> list[Any]:
        """Client side: output tensors → answers shaped like ``postprocess``'s."""

    def answer_tensors(self, answers: Sequence[Any]) -> dict[str, np.ndarray]:
        return self.tensors_from_answers(self.manifest.labels or [], answers)

    def apply_parameters(self, answers: list[Any], parameters: Mapping[str, Any]) -> list[Any]:
        """Request parameters that shape answers (``/predict``'s ``top_k`` for classification)."""
        return answers

    # -- inputs ----------------------------------------------------------------------------
    @classmethod
    def input_around(cls, text: str) -> Any:
        """One input of this task built around ``text`` (QA: as the context), for timing runs."""
        return text

    @classmethod
    def calibration_inputs(cls, questions_and_contexts: Sequence[tuple[str, str]]) -> list[TextInput]:
        """Real text in the form this task's model reads, for static quantization to measure its
        activations' ranges on when the user gives no texts: each question and each context alone."""
        return [text for pair in questions_and_contexts for text in pair]

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
