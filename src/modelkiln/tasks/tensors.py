"""Task inputs and answers ⇄ named tensors of the Open Inference Protocol, written once.

``kiln serve`` (its /infer route), the generated Triton models and the clients (tests, benchmarks,
``kiln loadtest``) all use these names and conversions, so one client works with both servers.
Per-example values (a label, a score) are 1-D tensors [n]; Triton's configs give them dims [1],
so the Triton models reshape them to [n, 1] and ``answers_from_tensors`` accepts either.
Only numpy is imported here. Which tensors a task takes and gives, and how its inputs and answers
map onto them, is the task class's (``Task.input_specs``, ``tensors_from_answers``...); the
functions at the end look a task class up by name, for clients that have no artifact."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import InvalidInputError


@dataclass(frozen=True)
class TensorSpec:
    """One input or output of a model as metadata shows it (shape -1 = any size)."""

    name: str
    datatype: str  # OIP datatype: BYTES, FP32, INT64, ...
    shape: tuple[int, ...]
    optional: bool = False


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


def zip_columns(a: list[str], b: list[str], na: str, nb: str) -> list[tuple[str, str]]:
    if len(a) != len(b):
        raise InvalidInputError(f"{na} has {len(a)} elements but {nb} has {len(b)}")
    return list(zip(a, b))


def text_columns(task: str, required: Sequence[str], optional: Sequence[str],
                 tensors: Mapping[str, np.ndarray | None]) -> dict[str, list[str]]:
    """A task's text tensors, checked (no unexpected or missing ones) and decoded to strings."""
    given = {n: a for n, a in tensors.items() if a is not None}
    extra = sorted(set(given) - set(required) - set(optional))
    if extra:
        raise InvalidInputError(f"unexpected input '{extra[0]}': {task} takes BYTES {' + '.join([*required, *optional])}")
    missing = [n for n in required if n not in given]
    if missing:
        raise InvalidInputError(f"missing input '{missing[0]}' (BYTES, shape [n]) for {task}")
    return {n: text_column(n, a) for n, a in given.items()}


def bytes_tensor(values: Sequence[str | bytes]) -> np.ndarray:
    """Strings → a BYTES tensor [n] (an object array of UTF-8 bytes)."""
    array = np.empty(len(values), dtype=object)
    array[:] = [v.encode("utf-8") if isinstance(v, str) else v for v in values]
    return array


# --- by task name: for code that has a name but no artifact (clients, tests, benchmarks) ----------
# Each task class owns its conversions (``modelkiln.tasks``); these look the class up by name.
def inputs_from_tensors(task: str, tensors: Mapping[str, np.ndarray | None]) -> list[Any]:
    """The request's text tensors → what ``task.prepare`` takes (strings, pairs, (q, c) pairs)."""
    return _task(task).inputs_from_tensors(tensors)


def tensors_from_inputs(task: str, inputs: Sequence[Any]) -> dict[str, np.ndarray]:
    """Client side: inputs as the pipeline takes them → request tensors."""
    return _task(task).tensors_from_inputs(inputs)


def tensors_from_answers(task: str, labels: Sequence[str], answers: Sequence[Any]) -> dict[str, np.ndarray]:
    """``task.postprocess`` answers → the output tensors."""
    return _task(task).tensors_from_answers(labels, answers)


def answers_from_tensors(task: str, labels: Sequence[str], tensors: Mapping[str, np.ndarray]) -> list[Any]:
    """Client side: output tensors → answers shaped like the pipeline's."""
    return _task(task).answers_from_tensors(labels, tensors)


def _task(name: str) -> Any:
    from . import task_class  # the registry imports this module: look it up when called

    return task_class(name)


def __getattr__(name: str) -> Any:
    """``TASK_INPUTS`` (task → (required, optional) input names) and ``TASK_OUTPUTS`` (task →
    output names), derived from the task classes."""
    if name not in ("TASK_INPUTS", "TASK_OUTPUTS"):  # other lookups (dataclasses asks while this module loads)
        raise AttributeError(name)
    from . import TASKS

    if name == "TASK_INPUTS":
        return {n: (cls.inputs, cls.optional_inputs) for n, cls in TASKS.items()}
    if name == "TASK_OUTPUTS":
        return {n: cls.outputs for n, cls in TASKS.items()}
    raise AttributeError(name)
