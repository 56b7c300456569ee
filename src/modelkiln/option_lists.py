"""Comma-separated option values (``--batch 1,8,32``, ``--instances 1,2``), parsed the same way by
every command."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .errors import KilnError


def split_list(value: str | None) -> list[str] | None:
    return [v.strip() for v in value.split(",") if v.strip()] if value else None


def number_list(value: str, option: str, cast: Callable[[str], Any] = int, auto: bool = False) -> list[Any]:
    """Numbers from ``"1,2,4"``; with ``auto``, the word ``auto`` stands for "the default" (None)."""
    out: list[Any] = []
    for v in split_list(value) or []:
        if auto and v == "auto":
            out.append(None)
            continue
        try:
            out.append(cast(v))
        except ValueError:
            kind = "whole numbers" if cast is int else "numbers"
            raise KilnError(f"{option} takes comma-separated {kind}{' or auto' if auto else ''}, got '{value}'") from None
    return out
