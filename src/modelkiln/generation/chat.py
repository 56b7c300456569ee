"""Chat templates rendered with jinja2 alone, as transformers renders them (same environment
settings and helpers), so an artifact needs no transformers to build a chat prompt."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

from ..errors import InvalidInputError


def _raise(message: str) -> None:
    raise InvalidInputError(f"chat template: {message}")


@lru_cache(maxsize=8)
def _compile(template: str):
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda value, indent=None, **_: json.dumps(value, indent=indent, ensure_ascii=False)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def chat_messages(prompt: str, system: str | None = None) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": system}] if system else []
    return [*messages, {"role": "user", "content": prompt}]


def render_chat(template: str, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                **special_tokens: str) -> str:
    """The prompt text for ``messages`` (``special_tokens``: bos_token, eos_token... as the template expects)."""
    if not template:
        raise InvalidInputError("this model has no chat template (generate without --chat)")
    return _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **special_tokens)
