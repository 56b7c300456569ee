"""The serve config file that ``kiln tune`` writes and ``kiln serve --config`` reads.

JSON, one object whose keys are ``ServeSettings`` field names, e.g.
``{"variant": "int8", "threads": 2, "max_batch_size": 32, "max_batch_tokens": 8192,
"max_queue_delay_ms": 1.0}``. Keys starting with ``_`` are comments (tune writes its measurements
there) and are ignored. Values are checked against the field types here, so a typo fails at
load with the file's name in the message rather than deep inside the server."""

from __future__ import annotations

import json
import types
import typing
from dataclasses import fields
from pathlib import Path
from typing import Any

from ..errors import KilnError

NOT_IN_CONFIG = ("models",)  # given as arguments, not settings


def _settings_types() -> dict[str, Any]:
    from .settings import ServeSettings

    hints = typing.get_type_hints(ServeSettings)
    return {f.name: hints[f.name] for f in fields(ServeSettings) if f.name not in NOT_IN_CONFIG}


def _accepts(kind: Any, value: Any) -> bool:
    """Does ``value`` (from JSON) fit the annotation ``kind`` (int, float, str, bool, X | None)?"""
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        return any(_accepts(k, value) for k in typing.get_args(kind))
    if kind is type(None):
        return value is None
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is str:
        return isinstance(value, str)
    return False


def read_serve_config(path: Path | str) -> dict[str, Any]:
    """Settings from a JSON config file → ``{field: value}`` ready for ``ServeSettings.from_env(**...)``.
    Raises KilnError on a missing file, bad JSON, unknown keys or values of the wrong type."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise KilnError(f"config file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise KilnError(f"cannot read config file {path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise KilnError(f"config file {path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise KilnError(f"config file {path} must hold a JSON object of settings")
    known = _settings_types()
    settings = {k: v for k, v in data.items() if not k.startswith("_")}
    unknown = sorted(set(settings) - set(known))
    if unknown:
        raise KilnError(f"config file {path}: unknown setting(s) {', '.join(unknown)} "
                        f"(known: {', '.join(sorted(known))})")
    for key, value in settings.items():
        if not _accepts(known[key], value):
            raise KilnError(f"config file {path}: '{key}' must be {known[key]}, got {value!r}")
        if known[key] is float and isinstance(value, int):
            settings[key] = float(value)
    return settings


def write_serve_config(path: Path | str, settings: dict[str, Any], notes: dict[str, Any] | None = None) -> None:
    """Write settings (validated by reading them back) plus ``_``-prefixed notes."""
    path = Path(path)
    body = {**{f"_{k}": v for k, v in (notes or {}).items()}, **settings}
    path.write_text(json.dumps(body, indent=2) + "\n", encoding="utf-8")
    read_serve_config(path)
