"""Extractive question answering: the best (start, end) span inside the context."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from tokenizers import Encoding

from ..errors import InvalidInputError
from ..samples import SAMPLE_QA
from .tensors import TensorSpec
from . import tensors as t
from .base import Task, TaskInfo, TextInput, softmax

MAX_ANSWER_TOKENS = 30


class QuestionAnswering(Task):
    # The context is the second sequence: truncate it, never the question.
    info = TaskInfo("question-answering", ("start_logits", "end_logits"), truncation="only_second", per_token=True)
    inputs = (t.QUESTION, t.CONTEXT)
    outputs = (t.ANSWER, t.START, t.END, t.SCORE)
    answers_need_text = True  # the answer is a span of the context's characters
    sample_inputs = SAMPLE_QA

    @classmethod
    def input_around(cls, text: str) -> Any:
        return (SAMPLE_QA[0][0], text)

    @classmethod
    def calibration_inputs(cls, questions_and_contexts: Sequence[tuple[str, str]]) -> list[TextInput]:
        return list(questions_and_contexts)

    # -- protocol ----------------------------------------------------------------------------
    def output_specs(self, model_outputs: Mapping[str, Sequence[int]]) -> tuple[TensorSpec, ...]:
        return (TensorSpec(t.ANSWER, "BYTES", (-1,)), TensorSpec(t.START, "INT64", (-1,)),
                TensorSpec(t.END, "INT64", (-1,)), TensorSpec(t.SCORE, "FP32", (-1,)))

    @classmethod
    def inputs_from_tensors(cls, tensors: Mapping[str, np.ndarray | None]) -> list[Any]:
        columns = t.text_columns(cls.info.name, cls.inputs, cls.optional_inputs, tensors)
        return t.zip_columns(columns[t.QUESTION], columns[t.CONTEXT], t.QUESTION, t.CONTEXT)

    @classmethod
    def tensors_from_inputs(cls, inputs: Sequence[Any]) -> dict[str, np.ndarray]:
        pairs = [(i["question"], i["context"]) if isinstance(i, dict) else i for i in inputs]
        return {t.QUESTION: t.bytes_tensor([q for q, _ in pairs]), t.CONTEXT: t.bytes_tensor([c for _, c in pairs])}

    @classmethod
    def tensors_from_answers(cls, labels: Sequence[str], answers: Sequence[Any]) -> dict[str, np.ndarray]:
        return {
            t.ANSWER: t.bytes_tensor([a["answer"] for a in answers]),
            t.START: np.array([a["start"] for a in answers], dtype=np.int64),
            t.END: np.array([a["end"] for a in answers], dtype=np.int64),
            t.SCORE: np.array([a["score"] for a in answers], dtype=np.float32),
        }

    @classmethod
    def answers_from_tensors(cls, labels: Sequence[str], tensors: Mapping[str, np.ndarray]) -> list[Any]:
        return [
            {"answer": a, "score": float(s), "start": int(b), "end": int(e)}
            for a, s, b, e in zip(
                t.text_column(t.ANSWER, tensors[t.ANSWER]),
                np.asarray(tensors[t.SCORE]).reshape(-1),
                np.asarray(tensors[t.START]).reshape(-1),
                np.asarray(tensors[t.END]).reshape(-1),
            )
        ]

    # -- inputs and answers --------------------------------------------------------------------

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
