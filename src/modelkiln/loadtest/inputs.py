"""Where load-test text comes from: real text only (a file, STS-B, SQuAD, or the built-in samples).

An *item* is what one model input is made of: a string, or a (text, pair) / (question, context)
tuple. Selection by length lets a run ask for realistic short inputs (chat lines, STS-B
sentences) or long ones (paragraphs) without writing new text."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Union

from ..errors import KilnError

Item = Union[str, tuple[str, str]]

# Names accepted by ``--inputs`` besides a file path.
SOURCES = ("samples", "sts", "squad")
LENGTHS = ("all", "short", "long")


def load_items(source: str | None = None, *, question_answering: bool = False) -> list[Item]:
    """``samples`` (default), ``sts`` (STS-B sentences), ``squad`` (SQuAD paragraphs; for a QA
    model, its (question, context) pairs), or a text file (one input per line, a tab splits a pair)."""
    from .. import data, samples

    name = (source or "samples").strip()
    if name == "samples":
        return list(samples.SAMPLE_QA) if question_answering else list(samples.SAMPLE_TEXTS)
    if name == "sts":
        return list(data.sts_sentences())
    if name == "squad":
        paragraphs, questions = data.read_squad()
        if question_answering:
            return [(q.question, q.context) for q in questions]
        return list(paragraphs)
    path = Path(name)
    if not path.is_file():
        raise KilnError(f"--inputs must be one of {', '.join(SOURCES)} or a text file; '{name}' is neither")
    return list(data.read_text_file(path))


def item_chars(item: Item) -> int:
    return len(item) if isinstance(item, str) else sum(len(p) for p in item)


def select(items: list[Item], length: str = "all", limit: int | None = None, seed: int = 0) -> list[Item]:
    """``short``: the shorter half (by characters), ``long``: the longer half, ``all``: everything;
    then shuffled with ``seed`` and cut to ``limit``. Shuffled because sources are ordered (STS-B by
    genre: captions are short, forum posts long) and a measurement window sees only part of the
    list: in file order, a 5-second run at 16 clients sent sentences 12% longer than the average.
    Seeded, so runs with the same options send the same sequence."""
    if length not in LENGTHS:
        raise KilnError(f"--length must be one of {', '.join(LENGTHS)}, got '{length}'")
    if not items:
        raise KilnError("no input text")
    if length != "all" and len(items) > 1:
        ordered = sorted(item_chars(i) for i in items)
        median = ordered[len(ordered) // 2]
        items = [i for i in items if (item_chars(i) < median) == (length == "short")] or items
    items = list(items)
    random.Random(seed).shuffle(items)
    if limit is not None and limit > 0:
        items = items[:limit]
    return items


def batches(items: list[Item], batch_size: int, count: int) -> list[list[Item]]:
    """``count`` request payloads of ``batch_size`` items each, cycling through ``items``."""
    if batch_size < 1:
        raise KilnError("--batch must be at least 1")
    out: list[list[Item]] = []
    k = 0
    for _ in range(count):
        out.append([items[(k + j) % len(items)] for j in range(batch_size)])
        k = (k + batch_size) % len(items)
    return out
