"""Which optional install extra a command needs, checked before the command imports it.

``pip install 'modelkiln[serve]'`` leaves out torch and transformers; a command that needs them
says so in one line (and which extra brings them) instead of ending in a ModuleNotFoundError."""

from __future__ import annotations

import importlib.util

from .errors import KilnError

# The import names each extra brings (the distribution names are in pyproject.toml).
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "convert": ("torch", "transformers", "onnx", "onnxscript"),
    "serve": ("fastapi", "uvicorn", "prometheus_client", "orjson"),
    "loadtest": ("prometheus_client", "matplotlib"),
    "openvino": ("openvino",),
    "nncf": ("openvino", "nncf"),  # OpenVINO's int8 variant: NNCF calibrates it at convert time
}


class MissingExtraError(KilnError):
    """A command needs an optional extra that is not installed (exit 2 in the CLI)."""


def missing_modules(extra: str) -> list[str]:
    """The modules of ``extra`` that cannot be imported here."""
    missing = []
    for module in EXTRA_MODULES[extra]:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a parent package missing, or a module whose spec is unset
            found = False
        if not found:
            missing.append(module)
    return missing


def has_extra(extra: str) -> bool:
    return not missing_modules(extra)


def install_hint(extra: str) -> str:
    return f"pip install 'modelkiln[{extra}]'"


def require_extra(extra: str, what: str, alternative: str = "") -> None:
    """Raise ``MissingExtraError`` when ``extra`` is incomplete: "WHAT needs modelkiln[EXTRA] (torch is not
    installed): pip install 'modelkiln[EXTRA]'", plus ``alternative`` (e.g. "or pass --no-reference")."""
    missing = missing_modules(extra)
    if missing:
        verb = "is" if len(missing) == 1 else "are"
        hint = install_hint(extra) + (f", {alternative}" if alternative else "")
        raise MissingExtraError(f"{what} needs modelkiln[{extra}] ({', '.join(missing)} {verb} not installed): {hint}")
