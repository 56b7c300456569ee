"""OpenAI's Responses API as clients use it, on a real `kiln serve` of the tiny Llama (and the
tiny Llama with Qwen2.5's chat template for tools; the tiny Llama's own template, which has none,
takes them in the generic format), with the unmodified `openai` client and the
OpenAI Agents SDK: text and item inputs, instructions, JSON formats, function tools and their
outputs, streamed events as the SDK parses them, previous_response_id, and the 400s. Also the
chat route's json_object-with-schema form and a schema past the grammar engine's limits.

The model has random weights: what is checked is what the server guarantees (the shapes, the
constrained answers' validity, the same answer as the chat route gives), not what the text says."""

from __future__ import annotations

import json

import httpx
import openai
import pydantic
import pytest

from servers import Server
from test_serve_generation_openai import QWEN, Pet, qwen_artifact  # noqa: F401 - the fixture

MODEL = "tiny"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
                          "required": ["city"], "additionalProperties": False}}


class WeatherArguments(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    city: str = pydantic.Field(max_length=10)


@pytest.fixture(scope="module")
def server(tiny_generation_artifact, qwen_artifact):  # noqa: F811
    srv = Server([f"{MODEL}={tiny_generation_artifact}", f"{QWEN}={qwen_artifact}", "--variant", "fp32",
                  "--max-batch-size", "8", "--stored-responses", "4"])
    yield srv
    code, err = srv.stop()
    assert code == 0, err[-2000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def respond(client, **kw):
    kw.setdefault("model", MODEL)
    kw.setdefault("max_output_tokens", 8)
    return client.responses.create(**kw)


# --- text, items, instructions: the chat route's answer -----------------------------------------


def test_text_items_and_instructions_answer_as_the_chat_route(client):
    chat = client.chat.completions.create(model=MODEL, max_tokens=8, extra_body={"ignore_eos": True}, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}])
    expected = chat.choices[0].message.content
    as_text = respond(client, instructions="Be brief.", input="Name a colour.", extra_body={"ignore_eos": True})
    as_items = respond(client, input=[
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Name a "},
                                                        {"type": "input_text", "text": "colour."}]}],
        extra_body={"ignore_eos": True})
    for answer in (as_text, as_items):
        assert answer.output_text == expected and answer.object == "response" and answer.id.startswith("resp_")
        assert answer.status == "incomplete" and answer.incomplete_details.reason == "max_output_tokens"
        assert answer.usage.input_tokens == chat.usage.prompt_tokens and answer.usage.output_tokens == 8
        assert answer.usage.total_tokens == answer.usage.input_tokens + 8
        message, = answer.output
        assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    assert as_text.instructions == "Be brief." and as_text.max_output_tokens == 8


def test_kilns_sampling_extensions_pass_through(client):
    kw = dict(input="Hi", temperature=1.0, max_output_tokens=6, extra_body={"seed": 4, "min_p": 0.1, "top_k": 5,
                                                                           "ignore_eos": True})
    first, again = respond(client, **kw), respond(client, **kw)
    assert first.output_text == again.output_text and first.model_extra["seed"] == 4
    with pytest.raises(openai.BadRequestError, match="min_p"):
        respond(client, input="Hi", extra_body={"min_p": 2})


def test_logprobs_when_included(client):
    answer = respond(client, input="Hi", top_logprobs=2, include=["message.output_text.logprobs"], max_output_tokens=4,
                     extra_body={"ignore_eos": True})
    logprobs = answer.output[0].content[0].logprobs
    assert len(logprobs) == 4 and all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in logprobs)


# --- structured outputs -------------------------------------------------------------------------


def test_json_schema_format_and_parse(client):
    schema = {"type": "json_schema", "name": "pet", "schema": Pet.model_json_schema(), "strict": True}
    answer = respond(client, input="A pet?", text={"format": schema}, max_output_tokens=64, temperature=1.0,
                     extra_body={"seed": 3})
    assert answer.status == "completed"
    Pet.model_validate_json(answer.output_text)
    parsed = client.responses.parse(model=MODEL, input="A pet?", text_format=Pet, max_output_tokens=64)
    assert isinstance(parsed.output_parsed, Pet)
    answer = respond(client, input="A pet?", text={"format": {"type": "json_object"}}, max_output_tokens=40)
    assert isinstance(json.loads(answer.output_text), dict)


def test_chat_json_object_with_a_schema_follows_it(client):
    """llama-cpp-python's, Together's and Fireworks' form; before, the schema was silently ignored."""
    for seed in range(3):
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "A pet?"}], max_tokens=64, temperature=1.0, seed=seed,
            response_format={"type": "json_object", "schema": Pet.model_json_schema()})
        Pet.model_validate_json(chat.choices[0].message.content)
    with pytest.raises(openai.BadRequestError, match="'response_format' has 'grammar'"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A pet?"}],
                                       response_format={"type": "json_object", "grammar": "root ::= x"})


def test_a_schema_past_the_grammar_engines_limits_is_a_400_before_any_compute(client):
    """3,000 optional properties with patterns: the parser's row after '{' holds 12,000 items, past
    llguidance's 2,000 (this answered 500 after prefilling the prompt)."""
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 5 + 1}}}$"}
                                               for i in range(3000)}}
    with pytest.raises(openai.BadRequestError, match="too complex for the grammar engine: .*Current row has"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A?"}],
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "big", "schema": schema}})
    with pytest.raises(openai.BadRequestError, match="too complex for the grammar engine"):
        respond(client, input="A?", text={"format": {"type": "json_schema", "name": "big", "schema": schema}})


# --- tools ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", [QWEN, MODEL])
def test_required_and_named_tool_choice_make_function_calls(client, model):
    """A call takes at least 65 of the tiny tokenizer's tokens; "required" allows several calls, and
    one begun with fewer tokens left than that is cut (as on the chat route): hence 300."""
    for tool_choice in ("required", {"type": "function", "name": "get_weather"}):
        answer = respond(client, model=model, input="Weather in Oslo?", tools=[WEATHER], tool_choice=tool_choice,
                         max_output_tokens=300, temperature=1.0, extra_body={"seed": 2})
        assert answer.status == "completed" and answer.output
        for call in answer.output:
            assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
            WeatherArguments.model_validate_json(call.arguments)


@pytest.mark.parametrize("model", [QWEN, MODEL])
def test_a_function_call_output_follows_up(client, model):
    first = respond(client, model=model, input="Weather in Oslo?", tools=[WEATHER], tool_choice="required",
                    parallel_tool_calls=False, max_output_tokens=120)
    call, = first.output
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "-3 degrees"}
    # the generic format's "auto" is a grammar, which ignore_eos cannot go with: "none" there
    kw = dict(model=model, tools=[WEATHER], tool_choice="auto" if model == QWEN else "none", max_output_tokens=6,
              extra_body={"ignore_eos": True})
    continued = respond(client, previous_response_id=first.id, input=[output], **kw)
    # the same conversation sent whole: the same prompt, the same (greedy) answer
    spelled = respond(client, input=[{"role": "user", "content": "Weather in Oslo?"},
                                     call.model_dump(exclude_none=True), output], **kw)
    assert continued.output_text == spelled.output_text and continued.usage.input_tokens == spelled.usage.input_tokens
    alone = respond(client, input="Weather in Oslo?", **kw)
    # the call and its output are in the prompt
    assert continued.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    assert continued.previous_response_id == first.id


# --- streaming ----------------------------------------------------------------------------------


MESSAGE_EVENTS = ["response.output_item.added", "response.content_part.added", "response.output_text.delta",
                  "response.output_text.done", "response.content_part.done", "response.output_item.done"]
CALL_EVENTS = ["response.output_item.added", "response.function_call_arguments.delta",
               "response.function_call_arguments.done", "response.output_item.done"]


def squeeze(types: list[str]) -> list[str]:
    """Runs of the same event type as one."""
    return [t for i, t in enumerate(types) if i == 0 or types[i - 1] != t]


def test_streamed_events_parse_as_the_sdks_and_come_in_order(client):
    with client.responses.stream(model=MODEL, input="A pet?", text_format=Pet, max_output_tokens=64) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert squeeze(types) == ["response.created", "response.in_progress", *MESSAGE_EVENTS, "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text and isinstance(final.output_parsed, Pet)
    whole = client.responses.parse(model=MODEL, input="A pet?", text_format=Pet, max_output_tokens=64)
    assert whole.output_text == final.output_text  # a whole answer is written by the same code

    with client.responses.stream(model=QWEN, input="Weather in Oslo?", tools=[WEATHER], max_output_tokens=120,
                                 tool_choice={"type": "function", "name": "get_weather"}) as stream:
        types = [e.type for e in stream]
        final = stream.get_final_response()
    assert types == ["response.created", "response.in_progress", *CALL_EVENTS * len(final.output), "response.completed"]
    WeatherArguments.model_validate_json(final.output[0].arguments)

    cut = [e.type for e in client.responses.create(model=MODEL, input="Hi", max_output_tokens=3, stream=True,
                                                   extra_body={"ignore_eos": True})]
    assert squeeze(cut) == ["response.created", "response.in_progress", *MESSAGE_EVENTS, "response.incomplete"]


def sdk_event(data: dict):
    """``data`` validated as the openai SDK's own event class for its type (every field checked:
    the SDK's stream builds its events without validating them)."""
    from typing import get_args

    from openai.types.responses import ResponseStreamEvent

    classes = {c.model_fields["type"].annotation.__args__[0]: c for c in get_args(get_args(ResponseStreamEvent)[0])}
    return classes[data["type"]].model_validate(data)


def test_every_event_and_response_validates_as_the_sdks_types(server):
    from openai.types.responses import Response

    url = server.url + "/v1/responses"
    for body in [{"model": MODEL, "input": "Hi", "max_output_tokens": 4, "top_logprobs": 1},
                 {"model": QWEN, "input": "Weather?", "tools": [WEATHER], "tool_choice": "required",
                  "max_output_tokens": 300}]:
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as answer:
            lines = list(answer.iter_lines())
        events = [sdk_event(json.loads(line[6:])) for line in lines if line.startswith("data: ")]
        assert [line for line in lines if line.startswith("event: ")] == [f"event: {e.type}" for e in events]
        Response.model_validate(events[-1].response.model_dump())
        Response.model_validate(httpx.post(url, json=body, timeout=60).json())


def test_a_failure_midway_is_an_error_event_then_response_failed():
    from modelkiln.errors import GrammarLimitError
    from modelkiln.generation.sequence import Delta
    from modelkiln.serve.generation.responses_output import ResponseWriter, new_response

    writer = ResponseWriter(new_response(MODEL, {"tools": [], "tool_choice": "auto", "parallel_tool_calls": True},
                                         1.0, 1.0, True), prompt_tokens=3)
    events = writer.start() + writer.feed(Delta(5, "Hi")) + writer.fail(GrammarLimitError("too complex"))
    events = [sdk_event(e) for e in events]
    assert [e.type for e in events][-2:] == ["error", "response.failed"]
    assert events[-2].message == "too complex" and events[-1].response.status == "failed"


# --- stored responses -----------------------------------------------------------------------------


def test_previous_response_id_continues_and_stored_responses_are_kept_bounded(client, server):
    first = respond(client, input="My name is Ada.")
    second = respond(client, previous_response_id=first.id, input="What is my name?")
    spelled = respond(client, input=[{"role": "user", "content": "My name is Ada."},
                                     *[item.model_dump(exclude_none=True) for item in first.output],
                                     {"role": "user", "content": "What is my name?"}])
    assert second.output_text == spelled.output_text and second.usage.input_tokens == spelled.usage.input_tokens
    assert client.responses.retrieve(second.id).output_text == second.output_text
    assert client.responses.delete(second.id) is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    with pytest.raises(openai.BadRequestError, match="'previous_response_id': no response"):
        respond(client, previous_response_id=second.id, input="Again?")
    unstored = respond(client, input="Hi", store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    for _ in range(4):  # --stored-responses 4: the least recently used goes first
        respond(client, input="Hi", max_output_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    assert httpx.delete(f"{server.url}/v1/responses/resp_nope").status_code == 404


# --- what is refused ------------------------------------------------------------------------------


@pytest.mark.parametrize(("fields", "message"), [
    ({"tools": [{"type": "web_search"}]}, "'web_search' tools are not available"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["x"]}]}, "'file_search' tools are not available"),
    ({"background": True}, "background responses are not supported"),
    ({"reasoning": {"effort": "high"}}, "'reasoning'"),
    ({"truncation": "auto"}, "'truncation' \"auto\""),
    ({"include": ["file_search_call.results"]}, "asks for data this server does not make"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "'input_image' are not"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "'item_reference' are not supported"),
    ({"input": [{"role": "tool", "content": "x"}]}, "'role' must be one of"),
    ({"prompt": {"id": "pmpt_1"}}, "stored prompt templates are not served"),
    ({"conversation": "conv_1"}, "the Conversations API is not served"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "needs 'schema'"),
    ({"text": {"format": {"type": "json_object", "indent": 2}}}, "'text.format' has 'indent'"),
    ({"tool_choice": {"type": "web_search_preview"}}, "'tool_choice' 'web_search_preview' is not supported"),
    ({"extra_body": {"frobnicate": 1}}, "unknown parameter 'frobnicate'"),
    ({"input": []}, "'input' is empty"),
    ({"max_output_tokens": 5000}, "'max_output_tokens' is 5000"),
])
def test_unsupported_requests_are_400s_naming_what(client, fields, message):
    fields = {"input": "Hi", **fields}
    with pytest.raises(openai.BadRequestError, match=message):
        respond(client, **fields)


# --- the OpenAI Agents SDK ------------------------------------------------------------------------


class Report(pydantic.BaseModel):
    summary: str = pydantic.Field(max_length=20)


@pytest.mark.parametrize("name", [QWEN, MODEL])
def test_an_agent_calls_its_tool_and_answers(server, name):
    """An agent with one function tool over the Responses API. A random model cannot choose to call
    a tool, so the first turn must (tool_choice "required"; the SDK then resets it to "auto"); its
    final answer is a structured output, which the grammar closes within max_tokens (free text from
    a random model runs to max_tokens, which the SDK treats as a failed turn)."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    cities = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        cities.append(city)
        return f"-3 degrees in {city}"

    model = agents.OpenAIResponsesModel(model=name, openai_client=openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key="none", max_retries=0))
    agent = agents.Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather],
                         output_type=Report, model=model,
                         model_settings=agents.ModelSettings(tool_choice="required", max_tokens=120, temperature=0))
    result = agents.Runner.run_sync(agent, "Weather in Oslo?", max_turns=3)
    assert len(cities) == 1 and isinstance(result.final_output, Report)
    assert [type(item).__name__ for item in result.new_items] == ["ToolCallItem", "ToolCallOutputItem",
                                                                   "MessageOutputItem"]
    first, last = result.raw_responses
    assert last.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens  # the tool's output too
