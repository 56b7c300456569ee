"""Task inputs and answers ⇄ named tensors of the Open Inference Protocol, written once.

``kiln serve`` (its /infer route), the generated Triton models and the clients (tests, benchmarks,
``kiln loadtest``) all use these names and conversions, so one client works with both servers.
Per-example values (a label, a score) are 1-D tensors [n]; Triton's configs give them dims [1],
so the Triton models reshape them to [n, 1] and ``answers_from_tensors`` accepts either.
Only numpy is imported: the Triton python models load this module too."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import InvalidInputError

# --- inputs: BYTES, one element per example ------------------------------------------------------
TEXT = "TEXT"
TEXT_PAIR = "TEXT_PAIR"  # optional second text of a classification pair (NLI, rerankers)
QUESTION = "QUESTION"
CONTEXT = "CONTEXT"

# --- outputs -------------------------------------------------------------------------------------
LABEL = "LABEL"  # BYTES [n]: top label
PROBABILITIES = "PROBABILITIES"  # FP32 [n, labels], in manifest.labels order
SCORE = "SCORE"  # FP32 [n]: top label's probability / answer score
EMBEDDINGS = "EMBEDDINGS"  # FP32 [n, d]: pooled, normalised when the manifest says so
ENTITIES = "ENTITIES"  # BYTES [n]: JSON list of {"entity_group","score","word","start","end"}
ANSWER = "ANSWER"  # BYTES [n]
START = "START"  # INT64 [n]: character offset in CONTEXT
END = "END"  # INT64 [n]

# task → (required inputs, optional inputs)
TASK_INPUTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "text-classification": ((TEXT,), (TEXT_PAIR,)),
    "sentence-embeddings": ((TEXT,), ()),
    "token-classification": ((TEXT,), ()),
    "question-answering": ((QUESTION, CONTEXT), ()),
}

TASK_OUTPUTS: dict[str, tuple[str, ...]] = {
    "text-classification": (LABEL, PROBABILITIES, SCORE),
    "sentence-embeddings": (EMBEDDINGS,),
    "token-classification": (ENTITIES,),
    "question-answering": (ANSWER, START, END, SCORE),
}

# Protocol datatype of each numpy dtype kind we produce.
_DATATYPES = {np.dtype(np.float32): "FP32", np.dtype(np.int64): "INT64", np.dtype(object): "BYTES"}


def datatype(array: np.ndarray) -> str:
    return _DATATYPES[array.dtype]


# --- requests ------------------------------------------------------------------------------------
def text_column(name: str, array: np.ndarray) -> list[str]:
    """A BYTES tensor [n] or [n, 1] → n strings, with a clear 400 for anything else."""
    array = np.asarray(array)
    if array.dtype != object and array.dtype.kind not in "SU":
        raise InvalidInputError(f"input '{name}' must be BYTES")
    if not (array.ndim == 1 or (array.ndim == 2 and array.shape[1] == 1)):
        raise InvalidInputError(f"input '{name}' must have shape [n] or [n, 1], got {list(array.shape)}")
    try:
        return [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in array.ravel()]
    except UnicodeDecodeError:
        raise InvalidInputError(f"input '{name}' is not valid UTF-8") from None


def _zip(a: list[str], b: list[str], na: str, nb: str) -> list[tuple[str, str]]:
    if len(a) != len(b):
        raise InvalidInputError(f"{na} has {len(a)} elements but {nb} has {len(b)}")
    return list(zip(a, b))


def inputs_from_tensors(task: str, tensors: Mapping[str, np.ndarray | None]) -> list[Any]:
    """The request's text tensors → what ``task.prepare`` takes (strings, pairs, (q, c) pairs)."""
    required, optional = TASK_INPUTS[task]
    given = {n: a for n, a in tensors.items() if a is not None}
    extra = sorted(set(given) - set(required) - set(optional))
    if extra:
        raise InvalidInputError(f"unexpected input '{extra[0]}': {task} takes BYTES {' + '.join(required + optional)}")
    missing = [n for n in required if n not in given]
    if missing:
        raise InvalidInputError(f"missing input '{missing[0]}' (BYTES, shape [n]) for {task}")
    columns = {n: text_column(n, a) for n, a in given.items()}
    if task == "question-answering":
        return _zip(columns[QUESTION], columns[CONTEXT], QUESTION, CONTEXT)
    if TEXT_PAIR in columns:
        return _zip(columns[TEXT], columns[TEXT_PAIR], TEXT, TEXT_PAIR)
    return columns[TEXT]


def tensors_from_inputs(task: str, inputs: Sequence[Any]) -> dict[str, np.ndarray]:
    """Client side: inputs as the pipeline takes them → request tensors."""
    if task == "question-answering":
        pairs = [(i["question"], i["context"]) if isinstance(i, dict) else i for i in inputs]
        return {QUESTION: _bytes([q for q, _ in pairs]), CONTEXT: _bytes([c for _, c in pairs])}
    if task == "text-classification" and inputs and not isinstance(inputs[0], str):
        return {TEXT: _bytes([a for a, _ in inputs]), TEXT_PAIR: _bytes([b for _, b in inputs])}
    return {TEXT: _bytes(list(inputs))}


def _bytes(values: Sequence[str]) -> np.ndarray:
    return np.array([v.encode("utf-8") if isinstance(v, str) else v for v in values], dtype=object)


# --- answers -------------------------------------------------------------------------------------
def tensors_from_answers(task: str, labels: Sequence[str], answers: Sequence[Any]) -> dict[str, np.ndarray]:
    """``task.postprocess`` answers → the output tensors."""
    if task == "text-classification":
        index = {label: j for j, label in enumerate(labels)}
        probabilities = np.zeros((len(answers), len(labels)), dtype=np.float32)
        for row, ranked in enumerate(answers):
            for item in ranked:
                probabilities[row, index[item["label"]]] = item["score"]
        return {
            LABEL: _bytes([ranked[0]["label"] for ranked in answers]),
            PROBABILITIES: probabilities,
            SCORE: np.array([ranked[0]["score"] for ranked in answers], dtype=np.float32),
        }
    if task == "sentence-embeddings":
        return {EMBEDDINGS: np.stack(answers).astype(np.float32, copy=False)}
    if task == "token-classification":
        return {ENTITIES: _bytes([json.dumps(entities) for entities in answers])}
    if task == "question-answering":
        return {
            ANSWER: _bytes([a["answer"] for a in answers]),
            START: np.array([a["start"] for a in answers], dtype=np.int64),
            END: np.array([a["end"] for a in answers], dtype=np.int64),
            SCORE: np.array([a["score"] for a in answers], dtype=np.float32),
        }
    raise ValueError(f"unknown task '{task}'")


def answers_from_tensors(task: str, labels: Sequence[str], tensors: Mapping[str, np.ndarray]) -> list[Any]:
    """Client side: output tensors → answers shaped like the pipeline's."""
    if task == "text-classification":
        answers = []
        for row in np.asarray(tensors[PROBABILITIES], dtype=np.float32):
            order = np.argsort(-row, kind="stable")  # the order TextClassification.postprocess uses
            answers.append([{"label": labels[j], "score": float(row[j])} for j in order])
        return answers
    if task == "sentence-embeddings":
        return list(np.asarray(tensors[EMBEDDINGS], dtype=np.float32))
    if task == "token-classification":
        return [json.loads(t) for t in text_column(ENTITIES, tensors[ENTITIES])]
    if task == "question-answering":
        return [
            {"answer": a, "score": float(s), "start": int(b), "end": int(e)}
            for a, s, b, e in zip(
                text_column(ANSWER, tensors[ANSWER]),
                np.asarray(tensors[SCORE]).reshape(-1),
                np.asarray(tensors[START]).reshape(-1),
                np.asarray(tensors[END]).reshape(-1),
            )
        ]
    raise ValueError(f"unknown task '{task}'")
