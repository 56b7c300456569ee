"""Readers for the real text the project measures with (``../shared/data``), and for user text files.

Nothing is downloaded: paths are given, or looked up next to the checkout."""

from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass
from pathlib import Path

from .errors import KilnError

# Where the shared data lives relative to a checkout; overridable for other layouts.
DATA_ENV = "KILN_DATA_DIR"


def shared_data_dir() -> Path:
    if os.environ.get(DATA_ENV):
        return Path(os.environ[DATA_ENV])
    here = Path(__file__).resolve()
    for parent in here.parents:
        candidate = parent.parent / "shared" / "data"
        if (parent / "pyproject.toml").is_file() and candidate.is_dir():
            return candidate
    return Path.cwd().parent / "shared" / "data"


@dataclass(frozen=True)
class StsPair:
    sentence1: str
    sentence2: str
    score: float


def read_sts(path: Path | str | None = None) -> list[StsPair]:
    """STS Benchmark: tab-separated genre, file, year, id, score, sentence1, sentence2[, ...]."""
    path = Path(path) if path else shared_data_dir() / "stsbenchmark" / "sts-dev.csv"
    if not path.is_file():
        raise KilnError(f"STS Benchmark file not found: {path}")
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
    path = Path(path) if path else shared_data_dir() / "squad" / "squad-v2-dev-subset.json"
    if not path.is_file():
        raise KilnError(f"SQuAD file not found: {path}")
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
