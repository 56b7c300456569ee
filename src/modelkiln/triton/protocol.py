"""Task inputs and answers ⇄ Triton tensors, written once for the generated Triton models
(server side) and for clients (tests, benchmarks, ``kiln loadtest``).

Every tensor has the batch as its first axis: scalars per example travel as shape [n, 1]
(the models have ``max_batch_size`` > 0 and dims [1])."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from . import names


def _texts(array: np.ndarray) -> list[str]:
    """A BYTES tensor [n] or [n, 1] → n Python strings."""
    return [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in np.asarray(array, dtype=object).reshape(-1)]


def _bytes(values: Sequence[str]) -> np.ndarray:
    return np.array([v.encode("utf-8") for v in values], dtype=np.object_).reshape(-1, 1)


# --- requests ------------------------------------------------------------------------------------
def inputs_from_tensors(task: str, tensors: Mapping[str, np.ndarray | None]) -> list[Any]:
    """The request's tensors → the inputs ``task.prepare`` takes (strings, pairs, (q, c) pairs)."""
    if task == "question-answering":
        return list(zip(_texts(tensors[names.QUESTION]), _texts(tensors[names.CONTEXT])))  # type: ignore[arg-type]
    texts = _texts(tensors[names.TEXT])  # type: ignore[arg-type]
    pair = tensors.get(names.TEXT_PAIR)
    if task == "text-classification" and pair is not None:
        return list(zip(texts, _texts(pair)))
    return texts


def tensors_from_inputs(task: str, inputs: Sequence[Any]) -> dict[str, np.ndarray]:
    """Client side: inputs as ``kiln serve`` / the pipeline take them → request tensors."""
    if task == "question-answering":
        pairs = [(i["question"], i["context"]) if isinstance(i, dict) else i for i in inputs]
        return {names.QUESTION: _bytes([q for q, _ in pairs]), names.CONTEXT: _bytes([c for _, c in pairs])}
    if task == "text-classification" and inputs and not isinstance(inputs[0], str):
        return {names.TEXT: _bytes([a for a, _ in inputs]), names.TEXT_PAIR: _bytes([b for _, b in inputs])}
    return {names.TEXT: _bytes(list(inputs))}


# --- answers -------------------------------------------------------------------------------------
def tensors_from_answers(task: str, labels: Sequence[str], answers: Sequence[Any]) -> dict[str, np.ndarray]:
    """``task.postprocess`` answers → the ensemble's output tensors."""
    if task == "text-classification":
        index = {label: j for j, label in enumerate(labels)}
        scores = np.zeros((len(answers), len(labels)), dtype=np.float32)
        for row, ranked in enumerate(answers):
            for item in ranked:
                scores[row, index[item["label"]]] = item["score"]
        return {names.LABEL: _bytes([ranked[0]["label"] for ranked in answers]), names.SCORES: scores}
    if task == "sentence-embeddings":
        return {names.EMBEDDING: np.stack(answers).astype(np.float32)}
    if task == "token-classification":
        return {names.ENTITIES: _bytes([json.dumps(entities) for entities in answers])}
    if task == "question-answering":
        return {
            names.ANSWER: _bytes([a["answer"] for a in answers]),
            names.START: np.array([[a["start"]] for a in answers], dtype=np.int64),
            names.END: np.array([[a["end"]] for a in answers], dtype=np.int64),
            names.SCORE: np.array([[a["score"]] for a in answers], dtype=np.float32),
        }
    raise ValueError(f"unknown task '{task}'")


def answers_from_tensors(task: str, labels: Sequence[str], tensors: Mapping[str, np.ndarray]) -> list[Any]:
    """Client side: the ensemble's output tensors → answers shaped like the pipeline's."""
    if task == "text-classification":
        answers = []
        for row in np.asarray(tensors[names.SCORES], dtype=np.float32):
            order = np.argsort(-row, kind="stable")  # the order TextClassification.postprocess uses
            answers.append([{"label": labels[j], "score": float(row[j])} for j in order])
        return answers
    if task == "sentence-embeddings":
        return list(np.asarray(tensors[names.EMBEDDING], dtype=np.float32))
    if task == "token-classification":
        return [json.loads(t) for t in _texts(tensors[names.ENTITIES])]
    if task == "question-answering":
        return [
            {"answer": a, "score": float(s), "start": int(b), "end": int(e)}
            for a, s, b, e in zip(
                _texts(tensors[names.ANSWER]),
                np.asarray(tensors[names.SCORE]).reshape(-1),
                np.asarray(tensors[names.START]).reshape(-1),
                np.asarray(tensors[names.END]).reshape(-1),
            )
        ]
    raise ValueError(f"unknown task '{task}'")
