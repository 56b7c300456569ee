"""Chat templates rendered with jinja2 alone, as transformers renders them (same environment
settings and helpers), so an artifact needs no transformers to build a chat prompt; and the roles
a message may have (OpenAI's, as far as the template knows them)."""

from __future__ import annotations

import json
import re
from datetime import datetime
from functools import lru_cache
from typing import Any

from ...errors import InvalidInputError


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


# OpenAI's message roles: "developer" is its newer name for the system message, "tool" carries a tool's answer.
ROLES = ("system", "developer", "user", "assistant", "tool")


def template_roles(template: str) -> dict[str, str]:
    """The role each of OpenAI's roles is rendered as by ``template``. Most templates write whatever
    role they are given ("<|im_start|>" + role), so a role the model never saw would reach it as
    text: "developer" is rendered as "system" unless the template names it, and "tool" is taken
    only when the template names it."""
    def named(role: str) -> bool:
        return re.search(rf"""['"]{role}['"]""", template) is not None

    roles = {"system": "system", "developer": "developer" if named("developer") else "system",
             "user": "user", "assistant": "assistant"}
    if named("tool"):
        roles["tool"] = "tool"
    return roles


def template_messages(messages: list[dict[str, Any]], roles: dict[str, str]) -> list[dict[str, Any]]:
    """``messages`` with their roles as the template takes them (``template_roles``); an unknown
    role, or one the template has not, is an ``InvalidInputError`` that names the allowed ones."""
    out = []
    for i, message in enumerate(messages):
        role = message.get("role")
        if role not in ROLES:
            raise InvalidInputError(f"message {i}: unknown role {role!r}; a message's role is one of "
                                    f"{', '.join(ROLES)}")
        if role not in roles:
            raise InvalidInputError(f"message {i}: this model's chat template has no {role!r} role "
                                    f"(its roles: {', '.join(roles)})")
        out.append({**message, "role": roles[role]})
    return out


def chat_messages(prompt: str, system: str | None = None) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": system}] if system else []
    return [*messages, {"role": "user", "content": prompt}]


def render_chat(template: str, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                tools: list[dict[str, Any]] | None = None, **special_tokens: str) -> str:
    """The prompt text for ``messages`` (``special_tokens``: bos_token, eos_token... as the template
    expects; ``tools``: OpenAI's tool list, for templates that show the model its tools)."""
    if not template:
        raise InvalidInputError("this model has no chat template (generate without --chat)")
    return _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                     **special_tokens)
