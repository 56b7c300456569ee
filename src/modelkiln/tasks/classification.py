"""Text classification: single texts, and text pairs (NLI models, cross-encoder rerankers)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from tokenizers import Encoding

from ..errors import InvalidInputError
from ..samples import SAMPLE_PAIRS, SAMPLE_TEXTS
from .tensors import TensorSpec
from . import tensors as t
from .base import Task, TaskInfo, TextInput, sigmoid, softmax


class TextClassification(Task):
    info = TaskInfo("text-classification", ("logits",), truncation="longest_first", per_token=False, labelled=True)
    sample_inputs = (*SAMPLE_TEXTS, *SAMPLE_PAIRS)
    optional_inputs = (t.TEXT_PAIR,)  # the second text of a pair (NLI, cross-encoder rerankers)
    outputs = (t.LABEL, t.PROBABILITIES, t.SCORE)

    @classmethod
    def calibration_inputs(cls, questions_and_contexts: Sequence[tuple[str, str]]) -> list[TextInput]:
        """Single texts and pairs, as a classifier may be asked either (an NLI model, a reranker): each
        question, its context, then the two as a pair."""
        return [item for pair in questions_and_contexts for item in (*pair, pair)]

    # -- protocol ----------------------------------------------------------------------------
    def output_specs(self, model_outputs: Mapping[str, Sequence[int]]) -> tuple[TensorSpec, ...]:
        return (TensorSpec(t.LABEL, "BYTES", (-1,)), TensorSpec(t.PROBABILITIES, "FP32", (-1, len(self.labels))),
                TensorSpec(t.SCORE, "FP32", (-1,)))

    @classmethod
    def inputs_from_tensors(cls, tensors: Mapping[str, np.ndarray | None]) -> list[Any]:
        columns = t.text_columns(cls.info.name, cls.inputs, cls.optional_inputs, tensors)
        if t.TEXT_PAIR in columns:
            return t.zip_columns(columns[t.TEXT], columns[t.TEXT_PAIR], t.TEXT, t.TEXT_PAIR)
        return columns[t.TEXT]

    @classmethod
    def tensors_from_inputs(cls, inputs: Sequence[Any]) -> dict[str, np.ndarray]:
        if inputs and not isinstance(inputs[0], str):
            return {t.TEXT: t.bytes_tensor([a for a, _ in inputs]), t.TEXT_PAIR: t.bytes_tensor([b for _, b in inputs])}
        return super().tensors_from_inputs(inputs)

    @classmethod
    def tensors_from_answers(cls, labels: Sequence[str], answers: Sequence[Any]) -> dict[str, np.ndarray]:
        index = {label: j for j, label in enumerate(labels)}
        probabilities = np.zeros((len(answers), len(labels)), dtype=np.float32)
        for row, ranked in enumerate(answers):
            for item in ranked:
                probabilities[row, index[item["label"]]] = item["score"]
        return {
            t.LABEL: t.bytes_tensor([ranked[0]["label"] for ranked in answers]),
            t.PROBABILITIES: probabilities,
            t.SCORE: np.array([ranked[0]["score"] for ranked in answers], dtype=np.float32),
        }

    @classmethod
    def answers_from_tensors(cls, labels: Sequence[str], tensors: Mapping[str, np.ndarray]) -> list[Any]:
        answers = []
        for row in np.asarray(tensors[t.PROBABILITIES], dtype=np.float32):
            order = np.argsort(-row, kind="stable")  # the order postprocess uses
            answers.append([{"label": labels[j], "score": float(row[j])} for j in order])
        return answers

    def apply_parameters(self, answers: list[Any], parameters: Mapping[str, Any]) -> list[Any]:
        top_k = parameters.get("top_k")
        if top_k is None:
            return answers
        if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
            raise InvalidInputError("top_k must be a positive integer")
        return [a[:top_k] for a in answers]

    # -- inputs and answers --------------------------------------------------------------------

    def prepare(self, inputs: Sequence[Any]) -> list[TextInput]:
        if not inputs:
            raise InvalidInputError("no inputs given")
        prepared: list[TextInput] = []
        for i, item in enumerate(inputs):
            if isinstance(item, str):
                prepared.append(item)
            elif isinstance(item, (list, tuple)) and len(item) == 2 and all(isinstance(t, str) for t in item):
                prepared.append((item[0], item[1]))
            else:
                raise InvalidInputError(f"input {i}: expected a string or a pair of strings")
        return prepared

    @property
    def labels(self) -> list[str]:
        return self.manifest.labels or []

    def scores(self, logits: np.ndarray) -> np.ndarray:
        """Logits → probabilities. One output (rerankers, regression) or multi-label: sigmoid."""
        if logits.shape[-1] == 1 or self.manifest.problem_type == "multi_label_classification":
            return sigmoid(logits)
        return softmax(logits)

    def postprocess(
        self, outputs: dict[str, np.ndarray], encodings: Sequence[Encoding], inputs: Sequence[TextInput]
    ) -> list[list[dict]]:
        probs = self.scores(outputs["logits"].astype(np.float32))
        answers = []
        for row in probs:
            order = np.argsort(-row, kind="stable")
            answers.append([{"label": self.labels[j], "score": float(row[j])} for j in order])
        return answers

    def task_vector(self, outputs: dict[str, np.ndarray], encodings: Sequence[Encoding]) -> list[np.ndarray]:
        return list(self.scores(outputs["logits"].astype(np.float32)))

    def agreement(self, reference: list[list[dict]], candidate: list[list[dict]]) -> float:
        same = [r[0]["label"] == c[0]["label"] for r, c in zip(reference, candidate)]
        return float(np.mean(same))
