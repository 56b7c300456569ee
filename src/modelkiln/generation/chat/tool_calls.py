"""Tool calls as the model's own chat template asks for them: the tools checked, the syntax the
template teaches the model, parsed back out of its answer, and (for ``tool_choice`` required or a
named function) a grammar that makes the answer a well-formed call whose arguments follow the
function's JSON schema (structured_output/grammars.py compiles it).

Two syntaxes are known, picked from the template's text:
- ``hermes``: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per call
  (Qwen2.5, Hermes, and the templates written after them);
- ``llama3_json``: the answer is one JSON object ``{"name": ..., "parameters": {...}}`` (Llama 3.1,
  3.2 and 3.3's templates, whose system prompt asks for exactly that).

A template that never mentions ``tools`` (SmolLM2's), or writes calls in a syntax not known here,
gets the ``generic`` format, as llama.cpp's server does for such templates: kiln tells the model of
its tools in a system message (chat/tool_prompt.py) and the whole answer is either plain text or
``{"tool_calls": [{"name": ..., "arguments": {...}}]}``, always under a grammar (``auto`` too),
since the model never learned the syntax."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from ...errors import InvalidInputError
from ..structured_output.grammars import JSON_OPTIONS, strict_schema

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for a function's name


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it


def call_id() -> str:
    return "call_" + os.urandom(12).hex()


@dataclass(frozen=True)
class Tools:
    """A request's tools and its ``tool_choice``: ``choice`` is "none", "auto", "required" or a
    function's name; ``parallel``: more than one call may be made (OpenAI's parallel_tool_calls)."""

    tools: list[dict[str, Any]]  # OpenAI's [{"type": "function", "function": {...}}], as the template takes them
    choice: str
    parallel: bool = True

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    @property
    def constrained(self) -> bool:
        return self.choice not in ("none", "auto")

    def parameters(self, name: str) -> dict[str, Any]:
        """The function's parameters schema; under OpenAI's ``strict: true``, with no keys but the
        listed ones (``constraints.strict_schema``)."""
        function = next(t["function"] for t in self.tools if t["function"]["name"] == name)
        schema = function.get("parameters") or {"type": "object", "properties": {}}
        return strict_schema(schema) if function.get("strict") is True else schema


def parse_tools(tools: Any, tool_choice: Any, parallel_tool_calls: Any = None) -> Tools | None:
    """OpenAI's ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` checked; None when there are no tools."""
    if tools in (None, []):
        if tool_choice not in (None, "none"):
            raise InvalidInputError("'tool_choice' is allowed only with 'tools'")
        return None
    if not isinstance(tools, list):
        raise InvalidInputError("'tools' must be a list of {\"type\": \"function\", \"function\": {...}} objects")
    seen = set()
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or \
                not isinstance(tool.get("function"), dict):
            raise InvalidInputError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidInputError(f"tools[{i}].function needs a 'name' of 1 to 64 letters, digits, '_' or '-', "
                                    f"got {name!r}")
        if name in seen:
            raise InvalidInputError(f"tools[{i}]: two functions are named {name!r}")
        seen.add(name)
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise InvalidInputError(f"tools[{i}].function.parameters must be a JSON schema object")
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise InvalidInputError("'parallel_tool_calls' must be true or false")
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise InvalidInputError("'tool_choice' as an object is {\"type\": \"function\", \"function\": {\"name\": ...}}")
        if name not in seen:
            raise InvalidInputError(f"'tool_choice' names the function {name!r}, which is not in 'tools' "
                                    f"({', '.join(sorted(seen))})")
        choice = name
    elif choice not in ("none", "auto", "required"):
        raise InvalidInputError(f"'tool_choice' must be \"none\", \"auto\", \"required\" or a named function, got {choice!r}")
    return Tools([{"type": "function", "function": t["function"]} for t in tools], choice,
                 parallel_tool_calls is not False)


class ToolFormat:
    """How one template's model writes tool calls."""

    name = ""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The answer's content (None when it was only calls) and its tool calls."""
        raise NotImplementedError

    # the chat template shows the model its tools (False: chat/tool_prompt.py writes them as a system message)
    in_template = True

    def constrains(self, tools: Tools) -> bool:
        """Whether ``tools.choice`` puts the answer under ``grammar``: "required" and a named
        function; the generic format's "auto" too."""
        return tools.constrained

    def grammar(self, tools: Tools, special_id: Callable[[str], int | None]) -> str:
        """A Lark grammar (llguidance's dialect) whose every sentence is a call of ``tools.choice``
        (a name) or of any tool ("required")."""
        raise NotImplementedError

    def _call_schema(self, tools: Tools, arguments_key: str) -> dict[str, Any]:
        calls = _call_schemas(tools, arguments_key)
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        return {**schema, "x-guidance": JSON_OPTIONS}


class Hermes(ToolFormat):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        calls, kept, end = [], [], 0
        for match in self._BLOCK.finditer(text):
            call = _call(match.group(1))
            if call is None:
                continue  # not a call after all: it stays in the content
            calls.append(call)
            kept.append(text[end:match.start()])
            end = match.end()
        kept.append(text[end:])
        content = "".join(kept).strip() if calls else text
        return (content or None), calls

    def grammar(self, tools: Tools, special_id: Callable[[str], int | None]) -> str:
        def literal(text: str) -> str:
            token = special_id(text)
            return f"<[{token}]>" if token is not None else json.dumps(text)

        many = '("\\n" call)*' if tools.choice == "required" and tools.parallel else ""
        return (f"start: call {many}\n"
                f'call: {literal(self.OPEN)} "\\n" body "\\n" {literal(self.CLOSE)}\n'
                f"body: %json {json.dumps(self._call_schema(tools, 'arguments'))}\n")


class Llama3Json(ToolFormat):
    name = "llama3_json"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        stripped = text.strip().removeprefix("<|python_tag|>").strip()
        call = _call(stripped) if stripped.startswith("{") else None
        return (None, [call]) if call is not None else (text or None, [])

    def grammar(self, tools: Tools, special_id: Callable[[str], int | None]) -> str:
        return f"start: body\nbody: %json {json.dumps(self._call_schema(tools, 'parameters'))}\n"


class Generic(ToolFormat):
    """The format for templates that cannot show tools: the answer is plain text (not starting
    with ``{``), or one JSON object ``{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}``. Under
    "auto" the grammar allows either, so a call is never malformed; with a response format, the
    non-call answer follows it instead of being text (llama.cpp's generic format does the same)."""

    name = "generic"
    in_template = False
    KEY = "tool_calls"
    # any text that does not start with "{" (after blanks), the empty answer included
    TEXT = r"/\s*([^{\s][\s\S]*)?/"

    def constrains(self, tools: Tools) -> bool:
        return tools.choice != "none"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        calls = self._calls(text.strip()) if text.lstrip().startswith("{") else None
        return (None, calls) if calls else (text or None, [])

    def _calls(self, text: str) -> list[ToolCall] | None:
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if not isinstance(value, dict) or list(value) != [self.KEY] or not isinstance(value[self.KEY], list):
            return None
        calls = []
        for item in value[self.KEY]:
            call = _call(json.dumps(item)) if isinstance(item, dict) and set(item) == {"name", "arguments"} else None
            if call is None:
                return None
            calls.append(call)
        return calls or None

    def call_schema(self, tools: Tools) -> dict[str, Any]:
        """The JSON schema of a call answer for ``tools.choice`` ("auto" and "required": any tool)."""
        items = _call_schemas(tools, "arguments")
        calls: dict[str, Any] = {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items},
                                 "minItems": 1}
        if not tools.parallel or tools.choice not in ("auto", "required"):
            calls["maxItems"] = 1
        return {"type": "object", "properties": {self.KEY: calls}, "required": [self.KEY],
                "additionalProperties": False, "x-guidance": JSON_OPTIONS}

    def grammar(self, tools: Tools, special_id: Callable[[str], int | None] | None = None,
                answer: dict[str, Any] | None = None) -> str:
        """The call (or, under "auto", the call or else text; ``answer``: else a JSON value of this
        schema, the request's response format)."""
        calls = f"calls: %json {json.dumps(self.call_schema(tools))}\n"
        if tools.choice != "auto":
            return "start: calls\n" + calls
        if answer is None:
            return f"start: calls | text\n{calls}text: {self.TEXT}\n"
        return f"start: calls | answer\n{calls}answer: %json {json.dumps({**answer, 'x-guidance': JSON_OPTIONS})}\n"


def _call_schemas(tools: Tools, arguments_key: str) -> list[dict[str, Any]]:
    """One JSON schema per function ``tools.choice`` allows: {"name": its name, arguments_key: its parameters}."""
    names = tools.names if tools.choice in ("auto", "required") else [tools.choice]
    return [{"type": "object", "properties": {"name": {"const": name}, arguments_key: tools.parameters(name)},
             "required": ["name", arguments_key], "additionalProperties": False} for name in names]


@lru_cache(maxsize=8)
def tool_format(template: str | None) -> ToolFormat:
    """The tool-call syntax of ``template``: its own (hermes, llama3_json) when it shows tools in
    one this server parses, else the generic format."""
    if not template or not re.search(r"\btools\b", template):
        return Generic()
    if Hermes.OPEN in template:
        return Hermes()
    if '"parameters"' in template:
        return Llama3Json()
    return Generic()  # it shows tools, but teaches a call syntax this server does not parse


def _call(text: str) -> ToolCall | None:
    """A call written as {"name": ..., "arguments" or "parameters": {...}}, else None."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(call_id(), value["name"], json.dumps(arguments, ensure_ascii=False))


def template_messages_with_tools(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI's messages as chat templates take them: an assistant's ``tool_calls`` carry their
    arguments as objects (OpenAI sends JSON text; templates write them with ``tojson``)."""
    out = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if calls:
            converted = []
            for j, call in enumerate(calls):
                function = call.get("function") if isinstance(call, dict) else None
                if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                    raise InvalidInputError(f"message {i}: tool_calls[{j}] needs a function with a name")
                arguments = function.get("arguments", "{}")
                if isinstance(arguments, str):
                    try:
                        arguments = json.loads(arguments or "{}")
                    except ValueError:
                        raise InvalidInputError(f"message {i}: tool_calls[{j}].function.arguments is not JSON") from None
                converted.append({**call, "function": {**function, "arguments": arguments}})
            message = {**message, "tool_calls": converted}
        out.append(message)
    return out
