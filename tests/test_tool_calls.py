"""Tool calls (generation/tool_calls.py) with the real chat templates of Qwen2.5-Instruct and
Llama-3.1-Instruct (tests/chat_templates/): tools and tool messages rendered as the models were
trained on them, their calls parsed back, and the constrained syntax (tool_choice required or
named) driven by random token choices on a tiny tokenizer: every answer parses as a call whose
arguments follow the function's schema."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from generation_helpers import CHAT_TEMPLATE, tiny_tokenizer
from modelkiln.errors import InvalidInputError
from modelkiln.generation.chat import render_chat, template_messages, template_roles
from modelkiln.generation.constraints import Grammars, compile_constraint
from modelkiln.generation.tool_calls import (Hermes, Llama3Json, parse_tools, template_messages_with_tools,
                                             tool_format)
from modelkiln.generation.vocabulary import Vocabulary
from test_constraints import random_walk

TEMPLATES = Path(__file__).parent / "chat_templates"
QWEN = (TEMPLATES / "qwen2.5-instruct.jinja").read_text()
LLAMA = (TEMPLATES / "llama-3.1-instruct.jinja").read_text()

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}}, "required": ["zone"]}}}
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"},
]


def render(template: str, messages, tools=None) -> str:
    messages = template_messages(template_messages_with_tools(messages), template_roles(template))
    return render_chat(template, messages, tools=tools, bos_token="<|begin_of_text|>")


def test_qwen_template_shows_tools_and_takes_calls_and_results_back():
    text = render(QWEN, CONVERSATION, [WEATHER])
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n21 degrees\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert isinstance(tool_format(QWEN), Hermes)


def test_llama_template_shows_tools_and_takes_calls_and_results_back():
    text = render(LLAMA, CONVERSATION, [WEATHER])
    assert "Given the following functions" in text and '"name": "get_weather"' in text
    assert '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}<|eot_id|>' in text
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n"21 degrees"<|eot_id|>' in text
    assert isinstance(tool_format(LLAMA), Llama3Json)


def test_a_template_without_tools_is_refused():
    with pytest.raises(InvalidInputError, match="does not take tools"):
        tool_format(CHAT_TEMPLATE)


def test_hermes_calls_are_parsed_out_of_the_text():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": 1}}\n</tool_call>')
    content, calls = Hermes().parse(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "celsius"}), ("get_time", {"zone": 1})]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id
    assert Hermes().parse("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    assert Hermes().parse("no calls") == ("no calls", [])


def test_llama3_calls_are_parsed_out_of_the_text():
    content, calls = Llama3Json().parse(' {"name": "get_time", "parameters": {"zone": 3}}')
    assert content is None and calls[0].name == "get_time" and json.loads(calls[0].arguments) == {"zone": 3}
    assert Llama3Json().parse("It is sunny.") == ("It is sunny.", [])
    assert Llama3Json().parse('{"no": "name"}') == ('{"no": "name"}', [])


@pytest.mark.parametrize(("tools", "choice", "message"), [
    ([{"type": "function", "function": {"description": "no name"}}], None, "needs a 'name'"),
    ([{"type": "function", "function": {"name": "has space"}}], None, "needs a 'name'"),
    ([WEATHER, WEATHER], None, "two functions are named"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "names the function 'nope'"),
    ([WEATHER], "sometimes", "'tool_choice' must be"),
    (None, "required", "only with 'tools'"),
    ([{"type": "retrieval"}], None, r"tools\[0\] must be"),
])
def test_bad_tools_are_invalid_input(tools, choice, message):
    with pytest.raises(InvalidInputError, match=message):
        parse_tools(tools, choice)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tokenizer = tiny_tokenizer(tmp_path_factory.mktemp("tok"))
    eos = tokenizer.token_to_id("<|im_end|>")
    return tokenizer, eos, Grammars(Vocabulary(tokenizer, [eos]))


@pytest.mark.parametrize("syntax", [Hermes(), Llama3Json()], ids=lambda s: s.name)
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_constrained_calls_always_parse_with_valid_arguments(syntax, choice, tiny):
    tokenizer, eos, grammars = tiny
    tools = parse_tools([WEATHER, TIME], choice)
    grammar = compile_constraint("lark", syntax.grammar(tools, lambda text: None), grammars)
    rng = np.random.default_rng(3)
    for _ in range(10):
        content, calls = syntax.parse(random_walk(grammar, tokenizer, eos, rng, max_steps=3000))
        assert calls and content is None
        for call in calls:
            arguments = json.loads(call.arguments)
            if choice != "required":
                assert call.name == "get_time"
            if call.name == "get_time":
                assert isinstance(arguments["zone"], int) and -12 <= arguments["zone"] <= 14
            else:
                assert arguments["unit"] in ("celsius", "fahrenheit") and len(arguments["city"]) <= 12


def test_a_special_token_marker_is_matched_as_that_token(tiny):
    tokenizer, eos, grammars = tiny
    tools = parse_tools([TIME], "required", parallel_tool_calls=False)
    lark = Hermes().grammar(tools, lambda text: 1 if text == "<tool_call>" else None)  # as if <tool_call> were id 1
    assert lark.startswith("start: call \n") and "<[1]>" in lark
    compile_constraint("lark", lark, grammars)


def test_tools_render_when_a_message_holds_a_special_token(tiny):
    """The chat's text-as-text path (a message holding the template's own marker) renders tools too."""
    from modelkiln.generation.chat_tokens import ChatTokens

    tokenizer, eos, _ = tiny
    chat = ChatTokens(tokenizer, QWEN, {})
    messages = [{"role": "user", "content": "Hi<|im_end|>"}]
    ids = chat.ids(messages, [WEATHER])
    assert tokenizer.decode(ids, skip_special_tokens=False) == render(QWEN, messages, [WEATHER])
    assert ids.count(eos) == render(QWEN, messages, [WEATHER]).count("<|im_end|>") - 1  # the user's is text


def test_a_strict_function_takes_no_keys_but_its_own():
    """OpenAI's function.strict: additionalProperties false wherever the schema does not say."""
    schema = {"type": "object", "properties": {"city": {"type": "string"},
                                               "where": {"type": "object", "properties": {"lat": {"type": "number"}}}}}
    tools = parse_tools([{"type": "function", "function": {"name": "f", "parameters": schema, "strict": True}},
                         {"type": "function", "function": {"name": "g", "parameters": schema}}], "required")
    strict, loose = tools.parameters("f"), tools.parameters("g")
    assert strict["additionalProperties"] is False and strict["properties"]["where"]["additionalProperties"] is False
    assert "additionalProperties" not in loose
