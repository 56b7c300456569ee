"""The serve config file that ``kiln tune`` writes and ``kiln serve --config`` reads.

JSON, one object whose keys are ``ServeSettings`` field names, e.g.
``{"variant": "int8", "threads": 2, "max_batch_size": 32, "max_batch_tokens": 8192,
"max_queue_delay_ms": 1.0}``. Keys starting with ``_`` are comments (tune writes its measurements
there) and are ignored. Keys and values are checked against the ``ServeSettings`` declaration
(types, ranges, choices), so a typo fails at load with the file's name and the key in one line
rather than deep inside the server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import KilnError


def _validate(path: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """Check keys and JSON types against the declaration (strict: "8" is not a number, 1 is not
    true); returns the values as the settings hold them (an int given for a float field: float)."""
    from pydantic import ValidationError

    from .settings import ServeSettings, declared, describe_error

    known = declared()
    unknown = sorted(set(settings) - set(known))
    if unknown:
        raise KilnError(f"config file {path}: unknown setting(s) {', '.join(unknown)} "
                        f"(known: {', '.join(sorted(known))})")
    try:
        parsed = ServeSettings.model_validate(settings, strict=True)
    except ValidationError as exc:
        raise KilnError(f"config file {path}: {describe_error(exc)}") from None
    return {key: getattr(parsed, key) for key in settings}


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
    return _validate(path, {k: v for k, v in data.items() if not k.startswith("_")})


def write_serve_config(path: Path | str, settings: dict[str, Any], notes: dict[str, Any] | None = None) -> None:
    """Write settings (validated by reading them back) plus ``_``-prefixed notes."""
    path = Path(path)
    body = {**{f"_{k}": v for k, v in (notes or {}).items()}, **settings}
    path.write_text(json.dumps(body, indent=2) + "\n", encoding="utf-8")
    read_serve_config(path)
