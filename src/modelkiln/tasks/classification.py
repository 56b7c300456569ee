"""Text classification: single texts, and text pairs (NLI models, cross-encoder rerankers)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from tokenizers import Encoding

from ..errors import InvalidInputError
from .base import Task, TaskInfo, TextInput, sigmoid, softmax


class TextClassification(Task):
    info = TaskInfo("text-classification", ("logits",), truncation="longest_first", per_token=False)

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
