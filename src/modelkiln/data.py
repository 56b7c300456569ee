"""Readers for the real text the tool measures with, and for user text files.

STS Benchmark dev and a SQuAD 2.0 subset ship inside the package (``datasets/``, with their
licences), so the gate, ``kiln eval``, ``kiln bench`` and ``kiln loadtest`` work on any machine.
Nothing is downloaded. ``KILN_DATA_DIR`` (a folder with the same layout) or an explicit path
overrides the packaged copy."""

from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass
from pathlib import Path

from .errors import KilnError

DATA_ENV = "KILN_DATA_DIR"
PACKAGED_DATA = Path(__file__).resolve().parent / "datasets"
STS_DEV = Path("stsbenchmark") / "sts-dev.csv"
SQUAD_SUBSET = Path("squad") / "squad-v2-dev-subset.json"


def data_dir() -> Path:
    """Where the STS-B and SQuAD files are read from: ``$KILN_DATA_DIR``, else the packaged copy."""
    return Path(os.environ[DATA_ENV]) if os.environ.get(DATA_ENV) else PACKAGED_DATA


def _data_file(path: Path | str | None, default: Path, what: str) -> Path:
    found = Path(path) if path else data_dir() / default
    if not found.is_file():
        hint = f" (from ${DATA_ENV})" if not path and os.environ.get(DATA_ENV) else ""
        raise KilnError(f"{what} file not found: {found}{hint}")
    return found


@dataclass(frozen=True)
class StsPair:
    sentence1: str
    sentence2: str
    score: float


def read_sts(path: Path | str | None = None) -> list[StsPair]:
    """STS Benchmark: tab-separated genre, file, year, id, score, sentence1, sentence2[, ...]."""
    path = _data_file(path, STS_DEV, "STS Benchmark")
    pairs = []
    with path.open(encoding="utf-8") as f:
        for row in csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE):
            if len(row) >= 7:
                pairs.append(StsPair(row[5], row[6], float(row[4])))
    return pairs


def sts_sentences(path: Path | str | None = None) -> list[str]:
    """The distinct STS-B sentences, in file order: realistic short inputs."""
    seen: dict[str, None] = {}
    for pair in read_sts(path):
        seen.setdefault(pair.sentence1)
        seen.setdefault(pair.sentence2)
    return list(seen)


@dataclass(frozen=True)
class SquadQuestion:
    question: str
    context: str
    answers: tuple[str, ...]


def read_squad(path: Path | str | None = None) -> tuple[list[str], list[SquadQuestion]]:
    """SQuAD json → (paragraphs, questions)."""
    path = _data_file(path, SQUAD_SUBSET, "SQuAD")
    data = json.loads(path.read_text(encoding="utf-8"))
    paragraphs, questions = [], []
    for article in data["data"]:
        for para in article["paragraphs"]:
            paragraphs.append(para["context"])
            for qa in para["qas"]:
                answers = tuple(a["text"] for a in qa.get("answers", []))
                questions.append(SquadQuestion(qa["question"], para["context"], answers))
    return paragraphs, questions


def read_text_file(path: Path | str) -> list[str | tuple[str, str]]:
    """One input per line; a tab splits a line into a pair (text, text_pair) or (question, context)."""
    path = Path(path)
    if not path.is_file():
        raise KilnError(f"text file not found: {path}")
    items: list[str | tuple[str, str]] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        if "\t" in line:
            a, b = line.split("\t", 1)
            items.append((a, b))
        else:
            items.append(line)
    if not items:
        raise KilnError(f"{path} holds no text")
    return items
