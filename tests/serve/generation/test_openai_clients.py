"""The OpenAI clients people use, unmodified, against a real `kiln serve`: instructor (every mode
that needs no vendor), LangChain's ChatOpenAI (structured output by every method, bind_tools,
streaming) and LiteLLM (plain, streamed, response_format, tools). One server for the module.

Two models: the tiny Llama with its own chat template, which cannot show tools (as SmolLM2's), so
tools take kiln's generic format; and the same weights with Qwen2.5's template, which shows them
(hermes). Both greedy and sampled (temperature 0.7, top_p 0.95, a seed). The weights are random,
so the answers are nonsense: what is checked is what the server guarantees, the parsed objects
and tool calls valid against their schemas. Where a mode sends the schema only as prompt text
(instructor's JSON and MD_JSON, LangChain's json_mode), no server can make a random model follow
it: those check what does reach the server (a JSON object for json_object)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from servers import Server
from test_serve_generation_openai import QWEN, qwen_artifact  # noqa: F401 - the fixture

GENERIC = "tiny"  # the tiny Llama's template has no tools: the generic format
MODELS = [GENERIC, QWEN]
SAMPLINGS = {"greedy": {"temperature": 0}, "sampled": {"temperature": 0.7, "top_p": 0.95, "seed": 7}}
sampling = pytest.mark.parametrize("sampling", list(SAMPLINGS.values()), ids=list(SAMPLINGS))
models = pytest.mark.parametrize("model", MODELS)


class Pet(pydantic.BaseModel):
    """A pet."""

    name: str = pydantic.Field(max_length=8)
    kind: Literal["cat", "dog"]
    age: int = pydantic.Field(ge=0, le=30)


PET_SCHEMA = Pet.model_json_schema()
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 10}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def server(tiny_generation_artifact, qwen_artifact):  # noqa: F811
    srv = Server([f"{GENERIC}={tiny_generation_artifact}", f"{QWEN}={qwen_artifact}", "--variant", "fp32",
                  "--max-batch-size", "8"])
    yield srv
    code, err = srv.stop()
    assert code == 0, err[-2000:]


@pytest.fixture(scope="module")
def openai_client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def valid_call(name: str, arguments: str | dict, schema: dict) -> dict:
    """A call's arguments, checked against its function's schema."""
    value = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(value, schema)
    return value


def open_brace(server: Server) -> str:
    """logit_bias that makes a random model start its answer with "{": the first character of a
    call in both formats' JSON (a random model never chooses to call under tool_choice "auto")."""
    token, = httpx.post(server.url + "/tokenize", json={"model": GENERIC, "prompt": "{",
                                                       "add_special_tokens": False}).json()["tokens"]
    return str(token)


# --- instructor ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def instructor():
    return pytest.importorskip("instructor")


@models
@sampling
@pytest.mark.parametrize("mode", ["TOOLS", "TOOLS_STRICT", "FUNCTIONS", "JSON_SCHEMA", "JSON_O1"])
def test_instructor_modes_that_send_the_schema_always_validate(instructor, openai_client, model, sampling, mode):
    client = instructor.from_openai(openai_client, mode=instructor.Mode[mode])
    pet, completion = client.chat.completions.create_with_completion(
        model=model, response_model=Pet, max_retries=0, max_tokens=200,
        messages=[{"role": "user", "content": "A pet?"}], **sampling)
    assert isinstance(pet, Pet)
    message = completion.choices[0].message
    if message.tool_calls:  # the tool modes: a call of Pet whose arguments follow its schema
        call, = message.tool_calls
        assert call.function.name == "Pet" and completion.choices[0].finish_reason == "tool_calls"
        valid_call("Pet", call.function.arguments, PET_SCHEMA)
    else:
        jsonschema.validate(json.loads(message.content), PET_SCHEMA)


@models
@sampling
def test_instructor_responses_tools(instructor, openai_client, model, sampling):
    """RESPONSES_TOOLS over the Responses API (a named function; the seed goes in extra_body: the
    Responses API has none)."""
    seed = sampling.get("seed")
    kw = {k: v for k, v in sampling.items() if k != "seed"}
    for mode in ("RESPONSES_TOOLS", "RESPONSES_TOOLS_WITH_INBUILT_TOOLS"):
        client = instructor.from_openai(openai_client, mode=instructor.Mode[mode])
        pet = client.responses.create(model=model, response_model=Pet, max_retries=0, max_output_tokens=200,
                                      input="A pet?", extra_body={"seed": seed} if seed is not None else None, **kw)
        assert isinstance(pet, Pet)


@sampling
def test_instructor_parallel_tools(instructor, openai_client, server, sampling):
    """PARALLEL_TOOLS sends tool_choice "auto"; a random model is made to call with logit_bias on
    "{" (a real one chooses to). On the generic format "auto" is a grammar, so what follows the "{"
    is a valid call; a template's own syntax leaves "auto" free, so the Qwen template is not tried.
    Every call validates. (One function: the tiny model's context is 1,024 tokens, and its
    tokenizer spends about one a character on the tools in the prompt.)"""
    client = instructor.from_openai(openai_client, mode=instructor.Mode.PARALLEL_TOOLS)
    answers = list(client.chat.completions.create(
        model=GENERIC, response_model=Iterable[Pet], max_retries=0, max_tokens=160,
        messages=[{"role": "user", "content": "Two pets?"}], logit_bias={open_brace(server): 100}, **sampling))
    assert answers and all(isinstance(a, Pet) for a in answers)


@models
@sampling
def test_instructor_streams_partial_objects(instructor, openai_client, model, sampling):
    for mode in ("TOOLS", "JSON_SCHEMA"):
        client = instructor.from_openai(openai_client, mode=instructor.Mode[mode])
        partials = list(client.chat.completions.create_partial(
            model=model, response_model=Pet, max_retries=0, max_tokens=200,
            messages=[{"role": "user", "content": "A pet?"}], **sampling))
        assert partials and Pet.model_validate(partials[-1].model_dump())


@sampling
def test_instructor_modes_that_only_prompt_with_the_schema(instructor, openai_client, sampling):
    """JSON sends response_format json_object and the schema as prompt text; MD_JSON asks in text
    for a ```json block. A random model follows neither prompt, so instructor's validation fails
    (with a real model it passes); the server's part holds: a JSON object for JSON mode."""
    from instructor.core import exceptions as errors
    for mode in ("JSON", "MD_JSON"):
        client = instructor.from_openai(openai_client, mode=instructor.Mode[mode])
        try:
            pet = client.chat.completions.create(model=GENERIC, response_model=Pet, max_retries=0, max_tokens=64,
                                                 messages=[{"role": "user", "content": "A pet?"}], **sampling)
        except (errors.InstructorRetryException, errors.IncompleteOutputException) as error:  # the model's fault
            completion = error.last_completion
            if mode == "JSON":
                assert isinstance(json.loads(completion.choices[0].message.content), dict)
            else:  # text, whatever the random model wrote
                assert isinstance(completion.choices[0].message.content, str)
        else:
            assert isinstance(pet, Pet)


# --- LangChain ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_openai(server):
    langchain_openai = pytest.importorskip("langchain_openai")

    def make(model: str, sampling: dict, max_tokens: int = 200):
        return langchain_openai.ChatOpenAI(model=model, base_url=server.url + "/v1", api_key="none", max_retries=0,
                                           max_tokens=max_tokens, **sampling)
    return make


@models
@sampling
def test_langchain_structured_output_by_every_method(chat_openai, model, sampling):
    llm = chat_openai(model, sampling)
    for method in ("function_calling", "json_schema"):
        out = llm.with_structured_output(Pet, method=method, include_raw=True).invoke("A pet?")
        assert out["parsing_error"] is None and isinstance(out["parsed"], Pet), (method, out)
        if method == "function_calling":
            call, = out["raw"].tool_calls
            valid_call(call["name"], call["args"], PET_SCHEMA)
    # json_mode sends no schema (response_format json_object): any JSON object is what it guarantees
    parsed = llm.with_structured_output(PET_SCHEMA, method="json_mode").invoke("A pet? Answer in JSON.")
    assert isinstance(parsed, dict)


@models
@sampling
def test_langchain_bind_tools_by_name_and_required_whole_and_streamed(chat_openai, model, sampling):
    llm = chat_openai(model, sampling, max_tokens=180)  # the tiny context: 1,024 tokens, the prompt about 820
    schemas = {"Pet": PET_SCHEMA, "get_weather": WEATHER["function"]["parameters"]}
    for tool_choice in ("get_weather", "Pet", "required"):
        bound = llm.bind_tools([WEATHER, Pet], tool_choice=tool_choice)
        message = bound.invoke("A pet, and the weather in Oslo?")
        assert message.tool_calls and message.response_metadata["finish_reason"] == "tool_calls"
        for call in message.tool_calls:
            assert call["id"].startswith("call_") and (tool_choice == "required" or call["name"] == tool_choice)
            valid_call(call["name"], call["args"], schemas[call["name"]])
        chunks = list(bound.stream("A pet, and the weather in Oslo?"))
        joined = chunks[0]
        for chunk in chunks[1:]:
            joined += chunk
        assert [(c["name"], c["args"]) for c in joined.tool_calls] == [(c["name"], c["args"]) for c in message.tool_calls]


@models
def test_langchain_streams_text_and_takes_tool_results_back(chat_openai, model):
    """.stream() gives the answer .invoke() gives; a conversation with a call and its ToolMessage
    (an agent's second turn) renders on either template."""
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    llm = chat_openai(model, SAMPLINGS["sampled"], max_tokens=12)
    assert "".join(chunk.content for chunk in llm.stream("Hi")) == llm.invoke("Hi").content
    call = {"name": "get_weather", "args": {"city": "Oslo"}, "id": "call_1", "type": "tool_call"}
    answer = llm.bind_tools([WEATHER]).invoke([HumanMessage("Weather in Oslo?"), AIMessage("", tool_calls=[call]),
                                               ToolMessage("-3 degrees", tool_call_id="call_1")])
    assert answer.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")


# --- LiteLLM ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def litellm(server):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of the cost map at import
    module = pytest.importorskip("litellm")
    module.suppress_debug_info = True
    return module


def litellm_kw(server, model: str, sampling: dict, max_tokens: int = 200) -> dict:
    return dict(model=f"openai/{model}", api_base=server.url + "/v1", api_key="none", max_tokens=max_tokens,
                messages=[{"role": "user", "content": "A pet?"}], **sampling)


@sampling
def test_litellm_plain_and_streamed(litellm, server, sampling):
    kw = litellm_kw(server, GENERIC, sampling, max_tokens=16)
    whole = litellm.completion(**kw)
    assert whole.choices[0].finish_reason in ("stop", "length") and whole.usage.completion_tokens <= 16
    chunks = list(litellm.completion(stream=True, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content


@models
@sampling
def test_litellm_response_format(litellm, server, model, sampling):
    kw = litellm_kw(server, model, sampling)
    Pet.model_validate_json(litellm.completion(response_format=Pet, **kw).choices[0].message.content)
    schema = {"type": "json_schema", "json_schema": {"name": "Pet", "schema": PET_SCHEMA, "strict": True}}
    Pet.model_validate_json(litellm.completion(response_format=schema, **kw).choices[0].message.content)
    assert isinstance(json.loads(litellm.completion(response_format={"type": "json_object"}, **kw)
                                 .choices[0].message.content), dict)


@models
@sampling
def test_litellm_tools_whole_and_streamed(litellm, server, model, sampling):
    kw = litellm_kw(server, model, sampling, max_tokens=300)
    parameters = WEATHER["function"]["parameters"]
    for tool_choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        choice = litellm.completion(tools=[WEATHER], tool_choice=tool_choice, **kw).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.id.startswith("call_") and call.function.name == "get_weather"
            valid_call("get_weather", call.function.arguments, parameters)
        chunks = list(litellm.completion(tools=[WEATHER], tool_choice=tool_choice, stream=True, **kw))
        built = litellm.stream_chunk_builder(chunks).choices[0].message.tool_calls
        assert [json.loads(c.function.arguments) for c in built] == \
            [json.loads(c.function.arguments) for c in choice.message.tool_calls]
    auto = litellm.completion(tools=[WEATHER], **kw).choices[0]  # "auto": text, or a valid call
    for call in auto.message.tool_calls or ():
        valid_call("get_weather", call.function.arguments, parameters)
