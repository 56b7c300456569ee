"""Extractive question answering: the best (start, end) span inside the context."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from tokenizers import Encoding

from ..errors import InvalidInputError
from .base import Task, TaskInfo, TextInput, softmax

MAX_ANSWER_TOKENS = 30


class QuestionAnswering(Task):
    # The context is the second sequence: truncate it, never the question.
    info = TaskInfo("question-answering", ("start_logits", "end_logits"), truncation="only_second", per_token=True)

    def prepare(self, inputs: Sequence[Any]) -> list[TextInput]:
        if not inputs:
            raise InvalidInputError("no inputs given")
        prepared: list[TextInput] = []
        for i, item in enumerate(inputs):
            if isinstance(item, dict):
                item = (item.get("question"), item.get("context"))
            if not (isinstance(item, (list, tuple)) and len(item) == 2 and all(isinstance(t, str) for t in item)):
                raise InvalidInputError(f"input {i}: question answering needs a (question, context) pair of strings")
            if not item[0].strip() or not item[1].strip():
                raise InvalidInputError(f"input {i}: question and context must not be empty")
            prepared.append((item[0], item[1]))
        return prepared

    @staticmethod
    def _context_range(encoding: Encoding) -> tuple[int, int]:
        """[first, last] token index of the context (sequence 1), special tokens excluded."""
        ids = [t for t, s in enumerate(encoding.sequence_ids) if s == 1]
        if not ids:
            return 0, -1
        return ids[0], ids[-1]

    def best_span(self, start_logits: np.ndarray, end_logits: np.ndarray, encoding: Encoding) -> tuple[int, int, float]:
        first, last = self._context_range(encoding)
        if last < first:
            return 0, 0, 0.0
        start = softmax(start_logits[first : last + 1].astype(np.float64))
        end = softmax(end_logits[first : last + 1].astype(np.float64))
        scores = np.outer(start, end)
        # Keep end >= start and spans no longer than MAX_ANSWER_TOKENS.
        scores = np.triu(scores) - np.triu(scores, MAX_ANSWER_TOKENS)
        flat = int(scores.argmax())
        i, j = divmod(flat, scores.shape[1])
        return first + i, first + j, float(scores[i, j])

    def postprocess(
        self, outputs: dict[str, np.ndarray], encodings: Sequence[Encoding], inputs: Sequence[TextInput]
    ) -> list[dict]:
        answers = []
        for row, enc in enumerate(encodings):
            s, e, score = self.best_span(outputs["start_logits"][row], outputs["end_logits"][row], enc)
            char_start, char_end = enc.offsets[s][0], enc.offsets[e][1]
            context = inputs[row][1]
            answers.append(
                {"answer": context[char_start:char_end], "score": score, "start": int(char_start), "end": int(char_end)}
            )
        return answers

    def task_vector(self, outputs: dict[str, np.ndarray], encodings: Sequence[Encoding]) -> list[np.ndarray]:
        vectors = []
        for row, enc in enumerate(encodings):
            first, last = self._context_range(enc)
            s = softmax(outputs["start_logits"][row, first : last + 1].astype(np.float32))
            e = softmax(outputs["end_logits"][row, first : last + 1].astype(np.float32))
            vectors.append(np.concatenate([s, e]))
        return vectors

    def agreement(self, reference: list[dict], candidate: list[dict]) -> float:
        same = [(r["start"], r["end"]) == (c["start"], c["end"]) for r, c in zip(reference, candidate)]
        return float(np.mean(same))
