"""Tool calls (generation/chat/tool_calls.py) with the real chat templates of Qwen2.5-Instruct and
Llama-3.1-Instruct (tests/chat_templates/): tools and tool messages rendered as the models were
trained on them, their calls parsed back, and the constrained syntax (tool_choice required or
named) driven by random token choices on a tiny tokenizer: every answer parses as a call whose
arguments follow the function's schema. A template without tools (the tiny models', as
SmolLM2's) gets the generic format (chat/tool_prompt.py): the tools in a system message, calls and
results as text, and a grammar under "auto" too."""

from __future__ import annotations

import json

import numpy as np
import pytest

from generation_helpers import CHAT_TEMPLATE, tiny_tokenizer
from modelkiln.errors import InvalidInputError
from modelkiln.generation.chat.templates import render_chat, template_messages, template_roles
from modelkiln.generation.structured_output.grammars import Grammars, compile_constraint
from modelkiln.generation.chat.tool_calls import (Generic, Hermes, Llama3Json, parse_tools, template_messages_with_tools,
                                             tool_format)
from modelkiln.generation.chat.tool_prompt import template_chat
from modelkiln.generation.structured_output.vocabulary import Vocabulary
from generation_helpers import allowed, random_walk
from helpers import TESTS

TEMPLATES = TESTS / "chat_templates"
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


def test_a_template_without_tools_gets_the_generic_format():
    assert isinstance(tool_format(CHAT_TEMPLATE), Generic) and isinstance(tool_format(None), Generic)
    unknown = "{% for t in tools %}[AVAILABLE_TOOLS]{{ t | tojson }}{% endfor %}{{ messages[0]['content'] }}"
    assert isinstance(tool_format(unknown), Generic)  # it shows tools, in a call syntax not parsed here


def generic(messages, tools=None, template=CHAT_TEMPLATE, answer_format=False) -> str:
    shown, template_tools = template_chat(template, template_messages_with_tools(messages), tools,
                                          tool_format(template), answer_format)
    assert template_tools is None  # the template is never given the tools: it cannot show them
    return render_chat(template, template_messages(shown, template_roles(template)))


def test_the_generic_format_shows_the_tools_after_the_users_system_message():
    tools = parse_tools([WEATHER, TIME], "auto")
    text = generic([{"role": "system", "content": "Be brief."}, *CONVERSATION], tools)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\nYou can call these functions.")
    assert json.dumps({"name": "get_weather", **{k: WEATHER["function"][k] for k in ("description", "parameters")}}) \
        in system and '{"name": "get_time", "parameters": {"type": "object"' in system
    assert '{"tool_calls": [{"name": "<function name>", "arguments": {<its arguments>}}]}' in system
    assert "otherwise answer in plain text" in system and "List several calls" in system
    assert ('<|im_start|>assistant\n{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris", '
            '"unit": "celsius"}}]}<|im_end|>') in text
    assert '<|im_start|>user\n{"tool_response": {"name": "get_weather", "content": "21 degrees"}}<|im_end|>' in text
    assert text.count("<|im_start|>system") == 1 and text.endswith("<|im_start|>assistant\n")
    alone = generic(CONVERSATION[:1], parse_tools([TIME], {"type": "function", "function": {"name": "get_time"}}))
    assert alone.startswith("<|im_start|>system\nYou can call these functions.") and "Answer with a call of get_time" in alone
    assert "Make one call at a time." in alone and "tool_response" not in alone


def test_the_generic_format_renders_calls_and_results_without_tools_too():
    """tool_choice "none" (or no tools) on a follow-up: nothing about tools is shown, but the
    conversation's calls and results still render, as text."""
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": "get_time", "arguments": f'{{"zone": {i}}}'}}
             for i in (1, 2)]
    text = generic([{"role": "user", "content": "Time?"}, {"role": "assistant", "content": "Checking.", "tool_calls": calls},
                    {"role": "tool", "tool_call_id": "call_1", "content": "10:00"},
                    {"role": "tool", "tool_call_id": "call_2", "content": "11:00"}, {"role": "user", "content": "And?"}])
    assert "system" not in text and "You can call" not in text
    assert ('<|im_start|>assistant\nChecking.\n{"tool_calls": [{"name": "get_time", "arguments": {"zone": 1}}, '
            '{"name": "get_time", "arguments": {"zone": 2}}]}<|im_end|>') in text
    assert ('<|im_start|>user\n{"tool_response": {"name": "get_time", "content": "10:00"}}\n'
            '{"tool_response": {"name": "get_time", "content": "11:00"}}<|im_end|>\n<|im_start|>user\nAnd?') in text


def test_the_generic_format_on_templates_with_a_tool_role_or_without_system_messages():
    tools = parse_tools([TIME], "required")
    with_tool_role = ("{% for m in messages %}{% if m['role'] == 'tool' %}<result>{{ m['content'] }}</result>"
                      "{% else %}<{{ m['role'] }}>{{ m['content'] }}{% endif %}{% endfor %}")
    text = generic(CONVERSATION, tools, with_tool_role)
    assert "<result>21 degrees</result>" in text and text.startswith("<system>You can call") and "Answer with a call now" in text
    no_system = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}"
                 "{% endif %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
    text = generic(CONVERSATION[:1], tools, no_system)
    assert text.startswith("<user>You can call these functions.") and text.endswith("\n\nWeather in Paris?")


def test_generic_calls_are_parsed_out_of_the_answer():
    content, calls = Generic().parse('{"tool_calls": [{"name": "get_time", "arguments": {"zone": 3}}, '
                                     '{"name": "get_weather", "arguments": {"city": "Oslo"}}]}')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_time", {"zone": 3}), ("get_weather", {"city": "Oslo"})]
    assert all(c.id.startswith("call_") for c in calls)
    for text in ("It is sunny.", '{"answer": 1}', '{"tool_calls": []}', '{"tool_calls": [{"name": "f"}]}',
                 '{"tool_calls": [{"name": "f", "arguments": {}}], "more": 1}', '{"tool_calls": [{"name": '):
        assert Generic().parse(text) == (text, [])


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


@pytest.mark.parametrize("syntax", [Hermes(), Llama3Json(), Generic()], ids=lambda s: s.name)
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
    from modelkiln.generation.chat.tokens import ChatTokens

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


def walk_from(grammar, tokenizer, eos, rng, first: str) -> str:
    """A random walk whose first token is ``first``'s, where the grammar allows it."""
    matcher, words = grammar.matcher(), np.zeros(16, dtype=np.int32)
    token = tokenizer.token_to_id(first)
    matcher.fill_bitmask(words)
    assert token in allowed(words)
    assert matcher.accept(token)

    class Started:  # the walk goes on from the matcher's state after the first token
        def matcher(self):
            return matcher

    return first + random_walk(Started(), tokenizer, eos, rng, max_steps=3000)


def test_generic_auto_answers_are_text_or_valid_calls(tiny):
    """Under "auto" the generic grammar lets the answer be text (never starting with "{") or a
    call; a call is always well-formed, with arguments that follow the function's schema."""
    tokenizer, eos, grammars = tiny
    tools = parse_tools([WEATHER, TIME], "auto", parallel_tool_calls=False)
    grammar = compile_constraint("lark", Generic().grammar(tools), grammars)
    rng = np.random.default_rng(5)
    for _ in range(5):
        text = random_walk(grammar, tokenizer, eos, rng, max_steps=3000)
        assert not text.lstrip().startswith("{") and Generic().parse(text) == (text or None, [])
    for _ in range(5):
        content, calls = Generic().parse(walk_from(grammar, tokenizer, eos, rng, "{"))
        assert content is None and len(calls) == 1 and calls[0].name in ("get_weather", "get_time")


def test_generic_auto_with_a_response_format_answers_calls_or_that_json(tiny):
    tokenizer, eos, grammars = tiny
    answer = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    grammar = compile_constraint("lark", Generic().grammar(parse_tools([TIME], "auto"), answer=answer), grammars)
    rng = np.random.default_rng(6)
    kinds = set()
    for _ in range(12):
        text = walk_from(grammar, tokenizer, eos, rng, "{")
        content, calls = Generic().parse(text)
        if calls:
            kinds.add("call")
            assert all(c.name == "get_time" and -12 <= json.loads(c.arguments)["zone"] <= 14 for c in calls)
        else:
            kinds.add("answer")
            assert 0 <= json.loads(content)["n"] <= 9 and set(json.loads(content)) == {"n"}
    assert kinds == {"call", "answer"}
