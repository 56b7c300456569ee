"""OpenAI's Responses API request (``POST /v1/responses``) as the chat route's request.

Its input items, ``instructions``, function tools, ``tool_choice``, ``text.format`` and sampling
fields become a chat body, which ``openai_routes.start_chat`` answers as it answers
``/v1/chat/completions``: the model's chat template, the same grammars for JSON and tool calls,
the same tool-call parsing. There is one path from a conversation to an answer; this module only
translates (no I/O), and responses_output.py translates the answer back.

- input: a string (one user message) or items: messages (role system, developer, user or
  assistant; content a string or ``input_text``/``output_text`` parts), ``function_call`` items
  (an assistant's call: joined to the assistant message before it, as chat's ``tool_calls``) and
  ``function_call_output`` items (chat's ``tool`` messages). ``instructions`` is a system message
  before them all. ``previous_response_id``: the stored conversation (its input and output items)
  comes before this input; its instructions do not (OpenAI's rule).
- tools: OpenAI's flat ``{"type": "function", "name", "description", "parameters", "strict"}``,
  ``strict`` true unless set to false (the Responses API's default, where chat's is false).
  With ``tool_choice`` "required" or a named function the answer is the call, so ``text.format``
  does not apply to it (OpenAI allows both; the chat route, where both would be one grammar,
  refuses them together).
- Refused with a 400 naming them, rather than ignored, because they would change the answer and
  a self-hosted model cannot give them: built-in tools (``web_search``, ``file_search``...),
  ``background``, stored ``prompt`` templates, ``conversation``, ``reasoning`` effort or summary,
  ``truncation: "auto"``, ``max_tool_calls``, ``include`` values for data kiln does not make,
  image, file and audio parts, and any parameter this server does not know (as OpenAI does).
- Accepted without effect: ``user``, ``safety_identifier``, ``prompt_cache_key`` and the other
  caching hints, ``service_tier``, ``stream_options``; ``metadata`` is kept with the response.
- Extensions, as the chat route takes them: ``seed``, ``stop``, ``top_k``, ``min_p``, penalties,
  ``logit_bias``, ``ignore_eos``, ``stop_token_ids``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...errors import InvalidInputError

# What a request may hold besides the fields read below: no effect on the answer.
_NO_EFFECT = ("user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options",
              "service_tier", "stream_options")
_READ = ("model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "top_logprobs", "text",
         "tools", "tool_choice", "parallel_tool_calls", "stream", "store", "previous_response_id", "include",
         "metadata", "reasoning", "truncation", "background")
# kiln's and vLLM's sampling settings (the Responses API has none of them), passed on to the chat body
EXTENSIONS = ("seed", "stop", "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias",
              "ignore_eos", "stop_token_ids")
# OpenAI's platform features: a 400 when set
_UNSUPPORTED = {
    "conversation": "the Conversations API is not served: send 'previous_response_id', or the conversation as 'input'",
    "prompt": "stored prompt templates are not served: send 'instructions' and 'input'",
    "max_tool_calls": "'max_tool_calls' is not supported ('parallel_tool_calls': false allows one call)",
    "context_management": "'context_management' (server-side compaction) is not supported",
    "moderation": "'moderation' is not supported by this server",
    "image": "'image' is not supported by this server",
    "access_programs": "'access_programs' is not supported by this server",
    "background_options": "background responses are not supported",
}
LOGPROBS = "message.output_text.logprobs"
# include values kiln honours; "reasoning.encrypted_content": kiln writes no reasoning items, so
# there is none to include (the OpenAI Agents SDK asks for it with store false)
_INCLUDES = (LOGPROBS, "reasoning.encrypted_content")
_ROLES = ("system", "developer", "user", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")
_FUNCTION_KEYS = ("type", "name", "description", "parameters", "strict")
_FORMAT_KEYS = {"text": ("type",), "json_object": ("type", "schema"),
                "json_schema": ("type", "name", "description", "schema", "strict")}


@dataclass
class ResponsesRequest:
    """A Responses request translated: the chat body to answer, the conversation as items (the
    stored one, then this input: what a follow-up continues), and what the response repeats."""

    chat: dict[str, Any]
    items: list[dict[str, Any]]
    echo: dict[str, Any]
    stream: bool
    store: bool


def responses_request(body: Mapping[str, Any], context: list[dict[str, Any]]) -> ResponsesRequest:
    """``body`` checked and translated; ``context``: the items of the response it continues."""
    _check_fields(body)
    items = context + _input_items(body.get("input"))
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidInputError("'instructions' must be a string")
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + \
        chat_messages(items, first=len(context))
    if not messages:
        raise InvalidInputError("'input' is empty: give a string or a list of items")
    include = body.get("include") or []
    if not isinstance(include, list) or not all(isinstance(i, str) for i in include):
        raise InvalidInputError("'include' must be a list of strings")
    for value in include:
        if value not in _INCLUDES:
            raise InvalidInputError(f"'include' value {value!r} asks for data this server does not make "
                                    f"(it honours {', '.join(map(repr, _INCLUDES))})")
    chat: dict[str, Any] = {
        "messages": messages, "max_output_tokens": body.get("max_output_tokens"), "temperature": body.get("temperature"),
        "top_p": body.get("top_p"), "tools": chat_tools(body.get("tools")),
        "tool_choice": chat_tool_choice(body.get("tool_choice")), "parallel_tool_calls": body.get("parallel_tool_calls"),
        "response_format": chat_response_format(body.get("text"))}
    if chat["tool_choice"] not in (None, "auto", "none"):
        # the answer is the call: text.format applies to text, which this answer has none of (the
        # OpenAI Agents SDK sends both on a turn that must call a tool; chat's route refuses both)
        chat["response_format"] = None
    top = body.get("top_logprobs")
    if LOGPROBS in include or top is not None:
        chat.update(logprobs=True, top_logprobs=top)
    chat.update({name: body[name] for name in EXTENSIONS if body.get(name) is not None})
    for flag in ("stream", "store"):
        if not isinstance(body.get(flag, False), (bool, type(None))):
            raise InvalidInputError(f"'{flag}' must be true or false")
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise InvalidInputError("'metadata' must be an object of strings")
    echo = {"instructions": instructions, "max_output_tokens": body.get("max_output_tokens"),
            "metadata": metadata or {}, "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
            "previous_response_id": body.get("previous_response_id"),
            "text": body.get("text") or {"format": {"type": "text"}}, "tool_choice": body.get("tool_choice") or "auto",
            "tools": body.get("tools") or [], "top_logprobs": top, "user": body.get("user")}
    return ResponsesRequest({k: v for k, v in chat.items() if v is not None}, items, echo,
                            bool(body.get("stream")), body.get("store") is not False)


def _check_fields(body: Mapping[str, Any]) -> None:
    for name, value in body.items():
        if name in _UNSUPPORTED and value is not None:
            raise InvalidInputError(_UNSUPPORTED[name])
        if name not in _READ and name not in _NO_EFFECT and name not in EXTENSIONS and name not in _UNSUPPORTED:
            raise InvalidInputError(f"unknown parameter {name!r} (this server's Responses API does not read it)")
    if body.get("background"):
        raise InvalidInputError("background responses are not supported: wait for the answer, or stream it")
    if body.get("truncation") not in (None, "disabled"):
        raise InvalidInputError("'truncation' \"auto\" (dropping the conversation's start to fit) is not supported: "
                                "a conversation longer than the context is a 400")
    reasoning = body.get("reasoning")
    if reasoning is not None:
        asked = {k: v for k, v in reasoning.items() if v is not None} if isinstance(reasoning, dict) else reasoning
        if asked not in ({}, {"effort": "none"}):
            raise InvalidInputError(f"'reasoning' {asked!r} is not supported: this server's models do not reason "
                                    "apart from their answer (leave 'reasoning' out, or effort \"none\")")


def _input_items(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise InvalidInputError("'input' must be a string or a list of input items (objects)")
    return list(value)


def chat_messages(items: list[dict[str, Any]], first: int = 0) -> list[dict[str, Any]]:
    """Input items as chat messages; ``first``: the index of this request's first item (errors
    name the request's own ``input[i]``; the items before it were checked when stored)."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i - first}]"
        kind = item.get("type", "message")  # OpenAI's EasyInputMessage has no type
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise InvalidInputError(f"{where}: 'role' must be one of {', '.join(_ROLES)}, got {role!r}")
            messages.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            name, call_id, arguments = item.get("name"), item.get("call_id"), item.get("arguments")
            if not all(isinstance(v, str) for v in (name, call_id, arguments)):
                raise InvalidInputError(f"{where}: a function_call item needs 'call_id', 'name' and 'arguments' "
                                        "(JSON text)")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            if messages and messages[-1]["role"] == "assistant":  # the same turn: its text, then its calls
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise InvalidInputError(f"{where}: a function_call_output item needs the 'call_id' it answers")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": _text(item.get("output"), where)})
        else:
            raise InvalidInputError(f"{where}: items of type {kind!r} are not supported (message, function_call, "
                                    "function_call_output)")
    return messages


def _text(content: Any, where: str) -> str:
    """A message's (or a call output's) content: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidInputError(f"{where}: 'content' must be a string or a list of text parts")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        text = part.get("refusal" if kind == "refusal" else "text") if isinstance(part, dict) else None
        if kind not in (*_TEXT_PARTS, "refusal") or not isinstance(text, str):
            raise InvalidInputError(f"{where}: content parts of type {kind!r} are not supported (text only: "
                                    "input_text, output_text)")
        texts.append(text)
    return "".join(texts)


def chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Function tools in chat's nested form; any other tool type is a 400 naming it."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise InvalidInputError("'tools' must be a list of {\"type\": \"function\", \"name\": ...} objects")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise InvalidInputError(f"tools[{i}]: {kind!r} tools are not available on this server (OpenAI's "
                                    "built-in tools run on OpenAI's platform): only \"function\" tools")
        _known_keys(f"tools[{i}]", tool, _FUNCTION_KEYS)
        function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        function["strict"] = tool.get("strict") is not False
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: Any) -> Any:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    kind = choice.get("type") if isinstance(choice, dict) else choice
    raise InvalidInputError(f"'tool_choice' {kind!r} is not supported: \"auto\", \"none\", \"required\" or "
                            "{\"type\": \"function\", \"name\": ...}")


def chat_response_format(text: Any) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format`` (the same grammars)."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise InvalidInputError("'text' must be an object: {\"format\": {...}}")
    _known_keys("'text'", text, ("format", "verbosity"))
    if text.get("verbosity") not in (None, "medium"):
        raise InvalidInputError(f"'text.verbosity' {text['verbosity']!r} is not supported (the model's answers are "
                                "as long as it makes them: leave it out, or \"medium\")")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in _FORMAT_KEYS:
        raise InvalidInputError("'text.format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                                "{\"type\": \"json_schema\", \"name\": ..., \"schema\": {...}, \"strict\": ...}")
    _known_keys("'text.format'", fmt, _FORMAT_KEYS[kind])
    if kind != "json_schema":
        return dict(fmt)
    if not isinstance(fmt.get("schema"), (dict, bool)):
        raise InvalidInputError("'text.format' json_schema needs 'schema': a JSON schema object")
    return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}


def _known_keys(name: str, value: Mapping[str, Any], known: tuple[str, ...]) -> None:
    unknown = sorted(k for k, v in value.items() if k not in known and v is not None)
    if unknown:
        raise InvalidInputError(f"{name} has {', '.join(map(repr, unknown))}, which this server does not read "
                                f"(it reads {', '.join(map(repr, known))})")
