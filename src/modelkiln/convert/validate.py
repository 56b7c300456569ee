"""The validation gate: a variant is kept only if its outputs stay close to PyTorch's on real text,
and if its answer for a text does not depend on what the text is batched with."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from ..manifest import Validation
from ..runtime.engine import Engine, Runner
from ..runtime.tokenizer import TextEncoder
from ..tasks import Task, TextInput

BATCH = 8  # validation batch: big enough to exercise padding, small enough for long texts


@dataclass(frozen=True)
class Tolerance:
    max_abs_diff: float  # on raw model outputs, real (unpadded) positions only
    min_cosine: float  # lowest per-input cosine similarity of the task output
    min_mean_cosine: float  # mean over inputs of that cosine similarity
    min_agreement: float  # fraction of inputs with the same label / span / entity tags


DEFAULT_TOLERANCES = {
    # 0.999 rather than 1: for embeddings agreement is a rank correlation, and two near-equal
    # similarities may swap under float noise; for labels and spans it still means "all agree".
    "fp32": Tolerance(max_abs_diff=1e-3, min_cosine=0.9999, min_mean_cosine=0.9999, min_agreement=0.999),
    # fp16 keeps ~3 significant digits; hidden states of magnitude ~10 move by ~1e-2.
    "fp16": Tolerance(max_abs_diff=5e-2, min_cosine=0.999, min_mean_cosine=0.999, min_agreement=0.95),
    # bf16 (the torch engine) keeps 8 significant bits, fp16 11: eight times fp16's differences.
    "bf16": Tolerance(max_abs_diff=0.4, min_cosine=0.995, min_mean_cosine=0.998, min_agreement=0.95),
    # int8 moves raw values a lot; what matters is the task output and the decision. Very short
    # texts ("ok") move most, hence a looser floor for the worst text than for the mean.
    # (all-MiniLM-L6-v2 per-row int8: mean 0.995, worst 0.981; ORT's dynamic int8 was 0.989 / 0.947.)
    "int8": Tolerance(max_abs_diff=math.inf, min_cosine=0.9, min_mean_cosine=0.98, min_agreement=0.9),
}


# Batch invariance: a text's answer alone and inside a padded batch of other texts may differ by
# float noise only (summation order changes with the shape), never by what the neighbours contain.
# Dynamic int8 with one activation scale per tensor fails this (all-MiniLM-L6-v2: cosine 0.95-0.99).
BATCH_MIN_COSINE = 0.99999
BATCH_MIN_AGREEMENT = 0.999  # labels, spans, entities all the same (embeddings: rank correlation)


@dataclass
class Reference:
    """PyTorch's outputs on the validation texts, computed once and compared with every variant."""

    batches: list[tuple[dict[str, np.ndarray], list, list[TextInput]]]  # feeds, encodings, inputs
    outputs: list[dict[str, np.ndarray]]

    @property
    def inputs(self) -> list[TextInput]:
        """The validation texts, prepared, in order."""
        return [text for _, _, chunk in self.batches for text in chunk]


def run_reference(engine: Runner, encoder: TextEncoder, task: Task, texts: Sequence[TextInput]) -> Reference:
    prepared = task.prepare(list(texts))
    batches, outputs = [], []
    for i in range(0, len(prepared), BATCH):
        chunk = prepared[i : i + BATCH]
        feeds, encodings = encoder.encode(chunk)
        batches.append((feeds, encodings, chunk))
        outputs.append(engine.run(feeds))
    return Reference(batches, outputs)


def _max_abs_diff(task: Task, ref: dict[str, np.ndarray], cand: dict[str, np.ndarray], mask: np.ndarray) -> float:
    worst = 0.0
    for name in task.output_names:
        diff = np.abs(ref[name].astype(np.float64) - cand[name].astype(np.float64))
        if task.info.per_token:
            # Padded positions carry no meaning and differ freely between runtimes.
            diff = diff[mask.astype(bool)]
        worst = max(worst, float(diff.max()) if diff.size else 0.0)
    return worst


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    denom = np.linalg.norm(a) * np.linalg.norm(b)
    return float(a @ b / denom) if denom > 0 else float(np.array_equal(a, b))


def validate(task: Task, reference: Reference, candidate: Engine, tolerance: Tolerance) -> Validation:
    max_diff, cosines, ref_answers, cand_answers = 0.0, [], [], []
    for (feeds, encodings, inputs), ref_out in zip(reference.batches, reference.outputs):
        out = candidate.run(feeds)
        max_diff = max(max_diff, _max_abs_diff(task, ref_out, out, feeds["attention_mask"]))
        for r, c in zip(task.task_vector(ref_out, encodings), task.task_vector(out, encodings)):
            cosines.append(_cosine(r, c))
        ref_answers += task.postprocess(ref_out, encodings, inputs)
        cand_answers += task.postprocess(out, encodings, inputs)
    agreement = task.agreement(ref_answers, cand_answers)
    min_cos, mean_cos = min(cosines), float(np.mean(cosines))
    passed = (
        max_diff <= tolerance.max_abs_diff
        and min_cos >= tolerance.min_cosine
        and mean_cos >= tolerance.min_mean_cosine
        and agreement >= tolerance.min_agreement
        and all(math.isfinite(c) for c in cosines)
    )
    return Validation(
        max_abs_diff=max_diff,
        min_cosine=min_cos,
        mean_cosine=mean_cos,
        agreement=agreement,
        texts=len(cosines),
        passed=passed,
        tolerance={k: v for k, v in asdict(tolerance).items() if math.isfinite(v)},
    )


def mixed_batches(n: int, lengths: Sequence[int], size: int = BATCH) -> list[list[int]]:
    """Indices of ``n`` texts grouped so that every batch spans short to long texts: sorted by
    length, then dealt out like cards. Every text but the longest of its batch is padded."""
    order = sorted(range(n), key=lambda i: lengths[i])
    groups = max(1, -(-n // size))
    return [order[g::groups] for g in range(groups)]


@dataclass(frozen=True)
class BatchInvariance:
    min_cosine: float  # lowest cosine between a text's task output alone and inside a batch
    agreement: float  # fraction of texts with the same answer both ways (see Task.agreement)
    texts: int

    @property
    def passed(self) -> bool:
        return self.min_cosine >= BATCH_MIN_COSINE and self.agreement >= BATCH_MIN_AGREEMENT


def batch_invariance(task: Task, encoder: TextEncoder, engine: Engine, texts: Sequence[TextInput],
                     size: int = BATCH) -> BatchInvariance:
    """Run every text alone (batch 1, no padding), then inside padded batches of mixed lengths, and
    compare the two answers for each text."""
    encodings = encoder.tokenize(list(texts))
    alone_vectors, alone_answers = [], []
    for text, enc in zip(texts, encodings):
        out = engine.run(encoder.collate([enc]))
        alone_vectors += task.task_vector(out, [enc])
        alone_answers += task.postprocess(out, [enc], [text])
    batched_vectors: list = [None] * len(texts)
    batched_answers: list = [None] * len(texts)
    for group in mixed_batches(len(texts), [len(e.ids) for e in encodings], size):
        encs = [encodings[i] for i in group]
        out = engine.run(encoder.collate(encs))
        for i, vector, answer in zip(group, task.task_vector(out, encs),
                                     task.postprocess(out, encs, [texts[i] for i in group])):
            batched_vectors[i], batched_answers[i] = vector, answer
    cosines = [_cosine(a, b) for a, b in zip(alone_vectors, batched_vectors)]
    return BatchInvariance(min_cosine=min(cosines), agreement=task.agreement(alone_answers, batched_answers),
                           texts=len(texts))


def failure_reason(v: Validation) -> str:
    """Why a variant was refused, one clause per failed check ("" if it passed)."""
    tol = v.tolerance
    parts = []
    if "max_abs_diff" in tol and v.max_abs_diff > tol["max_abs_diff"]:
        parts.append(f"max abs diff {v.max_abs_diff:.2e} > {tol['max_abs_diff']:.0e}")
    if v.min_cosine < tol.get("min_cosine", -1) or not math.isfinite(v.min_cosine):
        parts.append(f"min cosine {v.min_cosine:.5f} < {tol['min_cosine']}")
    if v.mean_cosine < tol.get("min_mean_cosine", -1):
        parts.append(f"mean cosine {v.mean_cosine:.5f} < {tol['min_mean_cosine']}")
    if v.agreement < tol.get("min_agreement", 0):
        parts.append(f"agreement {v.agreement:.4f} < {tol['min_agreement']}")
    reasons = ["outside tolerance: " + ", ".join(parts)] if parts else []
    batch = []
    if v.batch_min_cosine is not None and not v.batch_min_cosine >= BATCH_MIN_COSINE:
        batch.append(f"cosine {v.batch_min_cosine:.5f} < {BATCH_MIN_COSINE}")
    if v.batch_agreement is not None and not v.batch_agreement >= BATCH_MIN_AGREEMENT:
        batch.append(f"same answer for {v.batch_agreement:.1%} of texts")
    if batch:
        reasons.append("batch-variant: a text alone vs in a padded batch, " + ", ".join(batch))
    return "; ".join(reasons)
