"""STS Benchmark accuracy: Spearman ×100 between gold scores and cosine similarities of embeddings."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import ContextManager

import numpy as np

from ..data import read_sts
from ..errors import KilnError
from ..manifest import Manifest
from ..runtime.engine import Runner
from ..runtime.pipeline import Pipeline, load_encoder, load_variant
from ..runtime.registry import BACKEND_LABELS, engine_kind
from ..tasks import make_task
from ..tasks.embeddings import spearman

BATCH = 64


@dataclass(frozen=True)
class Score:
    backend: str
    spearman: float  # ×100
    delta: float | None  # against PyTorch


def sts_spearman(pipeline: Pipeline, pairs: list) -> float:
    def embed(texts: list[str]) -> np.ndarray:
        return np.concatenate([np.stack(pipeline(texts[i : i + BATCH])) for i in range(0, len(texts), BATCH)])

    a, b = embed([p.sentence1 for p in pairs]), embed([p.sentence2 for p in pairs])
    a /= np.linalg.norm(a, axis=1, keepdims=True)
    b /= np.linalg.norm(b, axis=1, keepdims=True)
    return 100.0 * spearman((a * b).sum(axis=1), np.array([p.score for p in pairs]))


def evaluate_sts(artifact: Path, sts: Path | None, threads: int | None, reference: bool,
                 steps: Callable[[str], ContextManager[None]] = lambda d: contextlib.nullcontext()) -> list[Score]:
    manifest = Manifest.load(artifact)
    task = make_task(manifest)
    if not task.embeds:
        raise KilnError(f"STS evaluation needs a sentence-embeddings artifact; '{manifest.name}' is {manifest.task}")
    pairs = read_sts(sts)
    encoder = load_encoder(artifact, manifest)
    engines: list[tuple[str, Callable[[], Runner]]] = []
    if reference:
        from ..convert.reference import reference_engine

        engines.append(("pytorch fp32", lambda: reference_engine(manifest, threads)))
    for v in manifest.kept_variants():
        if v.device == "cpu":
            engines.append((f"{BACKEND_LABELS[engine_kind(v)]} {v.name}", partial(load_variant, artifact, manifest, v, threads)))
    scores: list[Score] = []
    for label, factory in engines:
        with steps(f"STS-B ({len(pairs)} pairs): {label}"):
            value = sts_spearman(Pipeline(task, encoder, factory()), pairs)
        base = scores[0].spearman if reference and scores else None
        scores.append(Score(label, value, None if base is None else value - base))
    return scores
