"""Sentence embeddings: token states pooled (mean / cls / max) and optionally L2-normalised,
as sentence-transformers configures it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from tokenizers import Encoding

from ..manifest import Pooling
from .tensors import TensorSpec
from . import tensors as t
from .base import Task, TaskInfo, TextInput


# An engine that pools on its device (runtime/torch_encoder.py) returns the pooled, normalised
# vectors under this name (sentence-transformers' own), so the hidden states need not leave it.
POOLED = "sentence_embedding"


def attention_mask(encodings: Sequence[Encoding], width: int) -> np.ndarray:
    mask = np.zeros((len(encodings), width), dtype=np.float32)
    for row, enc in enumerate(encodings):
        mask[row, : len(enc.ids)] = 1.0
    return mask


def pool(hidden: np.ndarray, mask: np.ndarray, pooling: Pooling) -> np.ndarray:
    """hidden [n, seq, d], mask [n, seq] → [n, d]"""
    hidden = hidden.astype(np.float32)
    if pooling.mode == "cls":
        pooled = hidden[:, 0]
    elif pooling.mode == "max":
        pooled = np.where(mask[:, :, None] > 0, hidden, -np.inf).max(axis=1)
    else:  # mean
        summed = np.einsum("nsd,ns->nd", hidden, mask)
        pooled = summed / np.clip(mask.sum(axis=1, keepdims=True), 1e-9, None)
    if pooling.normalize:
        pooled = pooled / np.clip(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12, None)
    return pooled


class SentenceEmbeddings(Task):
    info = TaskInfo("sentence-embeddings", ("last_hidden_state",), truncation="longest_first", per_token=True,
                    pooled=True)
    outputs = (t.EMBEDDINGS,)
    embeds = True

    # -- protocol ----------------------------------------------------------------------------
    def output_specs(self, model_outputs: Mapping[str, Sequence[int]]) -> tuple[TensorSpec, ...]:
        hidden = model_outputs.get("last_hidden_state", (-1,))
        return (TensorSpec(t.EMBEDDINGS, "FP32", (-1, hidden[-1] if hidden else -1)),)

    @classmethod
    def tensors_from_answers(cls, labels: Sequence[str], answers: Sequence[Any]) -> dict[str, np.ndarray]:
        return {t.EMBEDDINGS: np.stack(answers).astype(np.float32, copy=False)}

    @classmethod
    def answers_from_tensors(cls, labels: Sequence[str], tensors: Mapping[str, np.ndarray]) -> list[Any]:
        return list(np.asarray(tensors[t.EMBEDDINGS], dtype=np.float32))

    # -- answers -----------------------------------------------------------------------------

    @property
    def pooling(self) -> Pooling:
        return self.manifest.pooling or Pooling()

    def embed(self, outputs: dict[str, np.ndarray], encodings: Sequence[Encoding]) -> np.ndarray:
        if POOLED in outputs:  # pooled by the engine already, with this artifact's pooling
            return outputs[POOLED]
        hidden = outputs["last_hidden_state"]
        return pool(hidden, attention_mask(encodings, hidden.shape[1]), self.pooling)

    def postprocess(
        self, outputs: dict[str, np.ndarray], encodings: Sequence[Encoding], inputs: Sequence[TextInput]
    ) -> list[np.ndarray]:
        return list(self.embed(outputs, encodings))

    def task_vector(self, outputs: dict[str, np.ndarray], encodings: Sequence[Encoding]) -> list[np.ndarray]:
        return list(self.embed(outputs, encodings))

    def agreement(self, reference: list[np.ndarray], candidate: list[np.ndarray]) -> float:
        """Do both runs rank the pairs of inputs alike? Spearman correlation of all pairwise cosine
        similarities (what retrieval and clustering depend on)."""
        if len(reference) < 3:
            return 1.0

        def pairwise(vectors: list[np.ndarray]) -> np.ndarray:
            m = np.stack(vectors).astype(np.float64)
            m /= np.clip(np.linalg.norm(m, axis=1, keepdims=True), 1e-12, None)
            return (m @ m.T)[np.triu_indices(len(m), k=1)]

        return spearman(pairwise(reference), pairwise(candidate))


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman rank correlation (average ranks for ties)."""
    ra, rb = _ranks(a), _ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denom = np.sqrt((ra**2).sum() * (rb**2).sum())
    return float((ra * rb).sum() / denom) if denom > 0 else 1.0


def _ranks(x: np.ndarray) -> np.ndarray:
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x), dtype=np.float64)
    ranks[order] = np.arange(len(x), dtype=np.float64)
    # average the ranks of tied values
    sorted_x = x[order]
    boundaries = np.flatnonzero(np.diff(sorted_x)) + 1
    for group in np.split(order, boundaries):
        if len(group) > 1:
            ranks[group] = ranks[group].mean()
    return ranks
