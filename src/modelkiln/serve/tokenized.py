"""Pre-tokenized requests: integer ``input_ids`` (+ ``attention_mask``, ``token_type_ids``)
instead of text, as Triton clients send to an ONNX model.

Every value is checked here, on the event loop, before it can join a batch: an id outside the
vocabulary reaches onnxruntime's Gather and fails the whole batch, so one bad client used to fail
its neighbours (issue 15: 2 such clients among 16 good ones got 102 good requests a 500 in 15 s)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidInputError

TOKEN_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


@dataclass(slots=True)
class TokenRow:
    """A pre-tokenized input row, shaped like ``tokenizers.Encoding`` for ``TextEncoder.collate``."""

    ids: np.ndarray
    attention_mask: np.ndarray
    type_ids: np.ndarray


@dataclass(frozen=True)
class TokenLimits:
    """What a model accepts, from its tokenizer and manifest."""

    input_names: Sequence[str]  # the ONNX model's inputs (a subset of TOKEN_INPUTS)
    vocab_size: int  # ids in [0, vocab_size)
    max_type_id: int  # token_type_ids in [0, max_type_id]: the largest the tokenizer itself produces
    max_length: int
    max_inputs: int
    truncate: bool


def is_tokenized(tensors: Mapping[str, np.ndarray]) -> bool:
    return "input_ids" in tensors


def token_rows(tensors: Mapping[str, np.ndarray], limits: TokenLimits, model_name: str) -> list[TokenRow]:
    """Check a pre-tokenized request and cut it into rows of real tokens (right padding)."""
    extra = [n for n in tensors if n not in limits.input_names]
    if extra:
        raise InvalidInputError(f"unexpected input {extra[0]!r}: model '{model_name}' takes {', '.join(limits.input_names)}")
    ids = tensors["input_ids"]
    if ids.ndim != 2 or ids.dtype.kind not in "iu":
        raise InvalidInputError("input_ids must be an integer tensor of shape [n, seq]")
    if ids.shape[0] > limits.max_inputs:
        raise InvalidInputError(f"{ids.shape[0]} inputs in one request; the limit is {limits.max_inputs}")
    if ids.shape[0] == 0 or ids.shape[1] == 0:
        raise InvalidInputError(f"input_ids of shape {list(ids.shape)} holds no tokens")
    arrays = {}
    for name in TOKEN_INPUTS:
        a = tensors.get(name)
        if a is None:
            a = np.ones_like(ids) if name == "attention_mask" else np.zeros_like(ids)
        if a.shape != ids.shape or a.dtype.kind not in "iu":
            raise InvalidInputError(f"{name} must be an integer tensor shaped like input_ids {list(ids.shape)}")
        arrays[name] = a
    _check_range(arrays["input_ids"], 0, limits.vocab_size - 1, "input_ids", f"the vocabulary has {limits.vocab_size} tokens")
    _check_range(arrays["token_type_ids"], 0, limits.max_type_id, "token_type_ids", f"the model's types are 0..{limits.max_type_id}")
    _check_range(arrays["attention_mask"], 0, 1, "attention_mask", "the mask is 0 or 1")
    rows = []
    for r in range(ids.shape[0]):
        mask = arrays["attention_mask"][r]
        n = int(mask.sum())
        if n == 0:
            raise InvalidInputError(f"input {r} has no tokens (attention_mask is all zero)")
        if not mask[:n].all():
            raise InvalidInputError(f"input {r}: attention_mask must be right-padded (its 1s first, then 0s)")
        if n > limits.max_length:
            if not limits.truncate:
                raise InvalidInputError(f"input {r} has {n} tokens; model '{model_name}' takes at most {limits.max_length}")
            n = limits.max_length
        rows.append(TokenRow(*(arrays[k][r, :n].astype(np.int64, copy=False) for k in TOKEN_INPUTS)))
    return rows


def _check_range(array: np.ndarray, low: int, high: int, name: str, why: str) -> None:
    # min/max on the integer array itself: a uint64 beyond int64 is caught before any cast
    lo, hi = int(array.min()), int(array.max())
    if lo < low or hi > high:
        bad = lo if lo < low else hi
        raise InvalidInputError(f"{name} holds {bad}, outside {low}..{high} ({why})")


def raw_tensors(rows: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Per-row raw model outputs (trimmed to each row's tokens) → padded [n, seq, ...] FP32."""
    out = {}
    width = max(next(iter(r.values())).shape[0] for r in rows)
    for name in rows[0]:
        first = rows[0][name]
        array = np.zeros((len(rows), width, *first.shape[1:]), dtype=np.float32)
        for i, r in enumerate(rows):
            array[i, : r[name].shape[0]] = r[name]
        out[name] = array
    return out
