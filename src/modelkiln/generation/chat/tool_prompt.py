"""A chat as its template renders it when tools are involved: the template's own way where it
shows tools (chat/tool_calls.py's hermes, llama3_json), else the generic format's.

A template that cannot show tools (SmolLM2's) gets, as llama.cpp's server gives it:
- the tools in a system message: each function as one JSON line (name, description, the JSON
  schema of its arguments), then the call syntax and what ``tool_choice`` asks for; after the
  user's own system (or developer) message when there is one, else as a system message of its
  own, else (a template that drops system messages) before the first user message;
- an assistant's earlier calls as the text it would have written, ``{"tool_calls": [...]}``, after
  its content if it had any;
- tool results as a user message ``{"tool_response": {"name": ..., "content": ...}}`` (one per
  result, consecutive results joined in one message), unless the template has a ``tool`` role.

The calls and results are rendered so whether or not the request has tools (a follow-up with
``tool_choice`` "none" still carries the conversation's calls)."""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from .templates import render_chat, template_roles
from .tool_calls import Generic, ToolFormat, Tools

RESULT_KEY = "tool_response"


def template_chat(template: str | None, messages: list[dict[str, Any]], tools: Tools | None,
                  syntax: ToolFormat, answer_format: bool = False) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and tools to render ``template`` with. ``messages``: OpenAI's, with calls'
    arguments as objects (``template_messages_with_tools``); ``tools``: those shown to the model
    (None: none, as with ``tool_choice`` "none"); ``answer_format``: the request asks for a
    response format, which a non-call answer follows (generic format, "auto")."""
    if syntax.in_template:
        return messages, (tools.tools if tools is not None else None)
    tool_role = "tool" in template_roles(template or "")
    results = not tool_role and any(m.get("role") == "tool" for m in messages)
    messages = calls_as_text(messages, tool_role)
    if tools is not None:
        messages = _with_system(messages, tools_message(tools, answer_format, results), template)
    return messages, None


def calls_as_text(messages: list[dict[str, Any]], tool_role: bool = False) -> list[dict[str, Any]]:
    """Assistant calls as the generic format writes them; tool results as user messages (or kept
    as ``tool`` messages where the template has that role)."""
    names: dict[Any, str] = {}  # call id -> function name: OpenAI's tool messages carry only the id
    out: list[dict[str, Any]] = []
    results = False  # the last message out is tool results
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            names.update((c.get("id"), c["function"]["name"]) for c in calls)
            text = json.dumps({Generic.KEY: [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                                             for c in calls]}, ensure_ascii=False)
            content = message.get("content") or ""
            message = {k: v for k, v in message.items() if k != "tool_calls"}
            message["content"] = f"{content}\n{text}" if content.strip() else text
        elif message.get("role") == "tool" and not tool_role:
            name = message.get("name") or names.get(message.get("tool_call_id"))
            result = {**({"name": name} if name else {}), "content": message.get("content") or ""}
            text = json.dumps({RESULT_KEY: result}, ensure_ascii=False)
            if results:
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + text}
                continue
            message, results = {"role": "user", "content": text}, True
            out.append(message)
            continue
        results = False
        out.append(message)
    return out


def tools_message(tools: Tools, answer_format: bool = False, results: bool = False) -> str:
    """The system message that shows the model its tools and how to call them."""
    lines = ["You can call these functions. Each is given as JSON: its name, what it does and the JSON schema "
             "of its arguments."]
    for tool in tools.tools:
        function = tool["function"]
        lines.append(json.dumps({"name": function["name"], **({"description": function["description"]}
                                                               if function.get("description") else {}),
                                 "parameters": function.get("parameters") or {"type": "object", "properties": {}}},
                                ensure_ascii=False))
    several = tools.parallel and tools.choice in ("auto", "required")
    lines += ["", "To call functions, answer with only this JSON object, nothing before or after it:",
              '{"tool_calls": [{"name": "<function name>", "arguments": {<its arguments>}}]}',
              "List several calls in \"tool_calls\" to make them at once." if several else
              "Make one call at a time."]
    if tools.choice == "auto":
        lines.append("Call a function only when it helps; otherwise answer "
                     + ("in the JSON format asked for." if answer_format else "in plain text."))
    elif tools.choice == "required":
        lines.append("Answer with a call now.")
    else:
        lines.append(f"Answer with a call of {tools.choice} now.")
    if results:
        lines.append(f'The results of calls come back as {{"{RESULT_KEY}": {{"name": ..., "content": ...}}}}.')
    return "\n".join(lines)


def _with_system(messages: list[dict[str, Any]], text: str, template: str | None) -> list[dict[str, Any]]:
    if messages and messages[0].get("role") in ("system", "developer"):
        content = messages[0].get("content") or ""
        return [{**messages[0], "content": f"{content}\n\n{text}" if content else text}, *messages[1:]]
    if takes_system(template):
        return [{"role": "system", "content": text}, *messages]
    first = next((i for i, m in enumerate(messages) if m.get("role") == "user"), 0)
    out = list(messages)
    out[first] = {**out[first], "content": f"{text}\n\n{out[first].get('content') or ''}"}
    return out


@lru_cache(maxsize=8)
def takes_system(template: str | None) -> bool:
    """Whether ``template`` renders a system message's text (some drop it, or refuse it)."""
    if not template:
        return False
    mark = "\ue000tools\ue001"
    try:
        return mark in render_chat(template, [{"role": "system", "content": mark}, {"role": "user", "content": "x"}])
    except Exception:  # noqa: BLE001 - a template may raise anything for a role it refuses
        return False
