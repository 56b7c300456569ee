"""The OpenAI API as clients use it, on a real `kiln serve` of the tiny Llama, with the unmodified
`openai` client: n answers, lists of prompts, echo, structured outputs, logit_bias, penalties,
logprobs, tools (through Qwen2.5's real chat template, and the generic format on the tiny Llama's
template, which has no tools), /tokenize and /detokenize."""

from __future__ import annotations

import json
import shutil
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from servers import Server
from helpers import TESTS

MODEL, QWEN = "tiny", "qwen"
PROMPT = "The quick brown fox"
ROWS = 8
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def qwen_artifact(tiny_generation_artifact, tmp_path_factory):
    """The tiny Llama with Qwen2.5-Instruct's chat template (which takes tools)."""

    out = tmp_path_factory.mktemp("qwen") / "qwen"
    shutil.copytree(tiny_generation_artifact, out)
    manifest = json.loads((out / "kiln.json").read_text())
    template = (TESTS / "chat_templates" / "qwen2.5-instruct.jinja").read_text()
    manifest["generation"]["chat_template"] = template
    (out / "kiln.json").write_text(json.dumps(manifest))
    return out


@pytest.fixture(scope="module")
def server(tiny_generation_artifact, qwen_artifact):
    srv = Server([f"{MODEL}={tiny_generation_artifact}", f"{QWEN}={qwen_artifact}", "--variant", "fp32",
                  "--max-batch-size", str(ROWS)])
    yield srv
    code, err = srv.stop()
    assert code == 0, err[-2000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def complete(client, prompt=PROMPT, **kw):
    kw.setdefault("max_tokens", 8)
    kw.setdefault("extra_body", {"ignore_eos": True})
    return client.completions.create(model=MODEL, prompt=prompt, **kw)


# --- n and lists of prompts --------------------------------------------------------------------


def test_n_answers_are_reproducible_and_the_first_is_the_single_answer(client):
    answer = complete(client, n=3, temperature=1.0, seed=11)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    texts = [c.text for c in answer.choices]
    assert texts == [c.text for c in complete(client, n=3, temperature=1.0, seed=11).choices]
    assert texts[0] == complete(client, temperature=1.0, seed=11).choices[0].text
    assert texts[1] == complete(client, temperature=1.0, seed=12).choices[0].text  # vLLM's seed + index
    assert len(set(texts)) > 1
    assert answer.usage.completion_tokens == 24 and answer.usage.prompt_tokens == complete(client).usage.prompt_tokens


def test_n_streamed_chat_reassembles_per_index(client):
    messages = [{"role": "user", "content": "Name a colour."}]
    kw = dict(model=MODEL, messages=messages, max_tokens=6, temperature=1.0, seed=5, n=2,
              extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw)
    texts: dict[int, str] = {0: "", 1: ""}
    finish = {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert finish == {0: "length", 1: "length"}


def test_a_list_of_prompts_gets_a_choice_per_prompt_and_n(client, server):
    from tokenizers import Tokenizer

    ids = complete(client, prompt="Hello world", max_tokens=1).usage.prompt_tokens
    assert ids
    prompts = [PROMPT, "Hello world"]
    answer = complete(client, prompt=prompts, n=2, temperature=0)
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    alone = [complete(client, prompt=p, temperature=0).choices[0].text for p in prompts]
    assert [c.text for c in answer.choices] == [alone[0], alone[0], alone[1], alone[1]]
    token_ids = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": PROMPT}).json()["tokens"]
    as_ids = complete(client, prompt=[token_ids, token_ids], temperature=0)
    assert [c.text for c in as_ids.choices] == [alone[0], alone[0]]
    del Tokenizer


def test_more_answers_than_rows_is_refused(client):
    with pytest.raises(openai.BadRequestError, match=rf"'n' must be in \[1, {ROWS}\]"):
        complete(client, n=ROWS + 1)
    with pytest.raises(openai.BadRequestError, match=f"runs at most {ROWS} at once"):
        complete(client, prompt=[PROMPT] * 3, n=3)
    with pytest.raises(openai.BadRequestError, match="'best_of' is not supported"):
        complete(client, n=1, best_of=2)


def test_echo_puts_the_prompt_first(client):
    plain = complete(client, temperature=0).choices[0].text
    assert complete(client, temperature=0, echo=True).choices[0].text == PROMPT + plain
    streamed = complete(client, temperature=0, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == PROMPT + plain


# --- structured outputs ------------------------------------------------------------------------


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    kind: Literal["cat", "dog"]
    age: int = pydantic.Field(ge=0, le=30)


def chat(client, **kw):
    kw.setdefault("max_tokens", 48)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A pet?"}], **kw)


def test_structured_output_requests_are_accepted_and_bad_ones_refused_before_compute(client):
    assert chat(client, response_format={"type": "json_object"}).choices[0].finish_reason in ("stop", "length")
    schema = {"name": "pet", "schema": Pet.model_json_schema(), "strict": True}
    assert chat(client, response_format={"type": "json_schema", "json_schema": schema}).choices
    assert complete(client, extra_body={"guided_regex": "[ab]+"}, max_tokens=4).choices
    for body, message in [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "the JSON schema cannot be used"),
        ({"response_format": {"type": "yaml"}}, "'response_format' must be"),
        ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}}, "one constraint at most"),
        ({"extra_body": {"structured_outputs": {"regex": "(unclosed"}}}, "the regex cannot be used"),
    ]:
        with pytest.raises(openai.BadRequestError, match=message):
            chat(client, **body)


def test_a_constraint_with_ignore_eos_is_refused(client):
    with pytest.raises(openai.BadRequestError, match="'ignore_eos' cannot be used"):
        client.completions.create(model=MODEL, prompt=PROMPT, extra_body={"ignore_eos": True, "guided_regex": "a+"})


def test_json_schema_answers_parse(client):
    for temperature in (0, 1.0):
        parsed = client.beta.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "A pet?"}],
                                                    response_format=Pet, max_tokens=64, temperature=temperature,
                                                    seed=1).choices[0].message.parsed
        assert isinstance(parsed, Pet)


def test_constrained_answers_close_within_max_tokens(client):
    """A random model writes long strings; near max_tokens the grammar's shortest completion closes
    the answer, so every answer, streamed or not, parses and ends with "stop"."""
    for seed in range(4):
        fields = dict(response_format={"type": "json_object"}, max_tokens=40, temperature=1.0, seed=seed)
        choice = chat(client, **fields).choices[0]
        assert choice.finish_reason == "stop" and isinstance(json.loads(choice.message.content), dict)
        chunks = [c.choices[0] for c in chat(client, stream=True, **fields) if c.choices]
        assert "".join(c.delta.content or "" for c in chunks) == choice.message.content
        assert chunks[-1].finish_reason == "stop"
        parsed = client.beta.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "A pet?"}],
                                                    response_format=Pet, max_tokens=40, temperature=1.0, seed=seed)
        assert isinstance(parsed.choices[0].message.parsed, Pet) and parsed.choices[0].finish_reason == "stop"


# --- penalties, logit_bias, logprobs -----------------------------------------------------------


def test_logit_bias_outside_the_vocabulary_is_refused(client):
    with pytest.raises(openai.BadRequestError, match=r"'400' is not a token id of this model's vocabulary"):
        complete(client, logit_bias={"400": 10})
    assert complete(client, logit_bias={"5": -100}, temperature=0).choices


def test_logit_bias_forces_a_token(client, server):
    first = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": complete(
        client, temperature=0, max_tokens=1).choices[0].text, "add_special_tokens": False}).json()["tokens"][0]
    forced = 7 if first != 7 else 8
    text = complete(client, temperature=0, max_tokens=1, logit_bias={str(forced): 100}).choices[0].text
    assert httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": text,
                                                      "add_special_tokens": False}).json()["tokens"] == [forced]


def test_frequency_penalty_changes_a_repetitive_answer(client):
    plain = complete(client, temperature=0, max_tokens=40).choices[0].text
    assert len(set(plain.split())) < len(plain.split()), "the greedy answer repeats itself"
    assert complete(client, temperature=0, max_tokens=40, frequency_penalty=2.0).choices[0].text != plain


def test_chat_logprobs(client):
    answer = chat(client, logprobs=True, top_logprobs=2, max_tokens=5, extra_body={"ignore_eos": True})
    content = answer.choices[0].logprobs.content
    assert len(content) == 5 and all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    assert all(isinstance(c.token, str) and all(0 <= b < 256 for b in c.bytes) for c in content)


def test_completion_logprobs_with_echo(client):
    answer = complete(client, logprobs=3, echo=True, temperature=0)
    logprobs = answer.choices[0].logprobs
    prompt_tokens = answer.usage.prompt_tokens
    assert len(logprobs.tokens) == prompt_tokens + 8 and logprobs.token_logprobs[0] is None
    assert all(isinstance(x, float) for x in logprobs.token_logprobs[1:])


# --- tools -------------------------------------------------------------------------------------


def generic_calls(choice) -> list[tuple[str, dict]]:
    """A choice's calls, each checked: an id, WEATHER's name, arguments valid against its schema."""
    calls = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and calls and choice.message.content is None
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


def streamed_calls(chunks) -> tuple[list[tuple[str, dict]], str, str]:
    """The calls, content and finish reason of a streamed chat answer, joined as clients join them."""
    calls: dict[int, dict[str, str]] = {}
    content, finish = "", None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for piece in choice.delta.tool_calls or ():
                call = calls.setdefault(piece.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += piece.id or ""
                call["name"] += piece.function.name or ""
                call["arguments"] += piece.function.arguments or ""
    assert all(c["id"].startswith("call_") for c in calls.values())
    return [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())], content, finish


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.7, "top_p": 0.95, "seed": 7}],
                         ids=["greedy", "sampled"])
def test_tools_on_a_template_without_them_take_the_generic_format(client, sampling):
    """The tiny Llama's template (as SmolLM2's) cannot show tools: kiln describes them in a system
    message and the grammar makes the answer a valid call ("required", a named function)."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    for tool_choice, parallel in (("required", None), (named, None), ("required", False)):
        kw = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER],
                  tool_choice=tool_choice, max_tokens=300, **sampling)
        if parallel is not None:
            kw["parallel_tool_calls"] = parallel
        whole = client.chat.completions.create(**kw)
        calls = generic_calls(whole.choices[0])
        if tool_choice != "required" or parallel is False:
            assert len(calls) == 1
        streamed, content, finish = streamed_calls(client.chat.completions.create(stream=True, **kw))
        assert finish == "tool_calls" and content == "" and streamed == calls  # the same answer, streamed


def test_generic_auto_answers_text_or_a_valid_call_and_none_shows_no_tools(client):
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    for seed in range(3):
        choice = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=80,
                                                temperature=1.0, seed=seed).choices[0]
        if choice.finish_reason == "tool_calls":
            generic_calls(choice)
        else:
            assert not choice.message.tool_calls and not choice.message.content.lstrip().startswith("{")
    shown = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=1)
    hidden = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none",
                                            max_tokens=1)
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert hidden.usage.prompt_tokens == plain.usage.prompt_tokens < shown.usage.prompt_tokens
    # a response format: the non-call answer follows it (under "required" the answer is the call: a 400)
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=120, seed=1,
                                            temperature=1.0, response_format={"type": "json_object"}).choices[0]
    assert answer.finish_reason == "tool_calls" or isinstance(json.loads(answer.message.content), dict)
    with pytest.raises(openai.BadRequestError, match="cannot be asked for together"):
        client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="required",
                                       response_format={"type": "json_object"})
    with pytest.raises(openai.BadRequestError, match="a JSON object or schema only"):
        client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                       extra_body={"guided_regex": "[a-z]+"})


def test_generic_conversations_render_calls_and_results_as_text(client, server):
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 degrees"}]
    for tool_choice in ("auto", "none"):  # a template without a tool role takes the conversation either way
        assert client.chat.completions.create(model=MODEL, messages=conversation, tools=[WEATHER], max_tokens=4,
                                              tool_choice=tool_choice).choices
    rendered = httpx.post(server.url + "/tokenize", json={"model": MODEL, "messages": conversation, "tools": [WEATHER]})
    text = httpx.post(server.url + "/detokenize", json={"model": MODEL, "tokens": rendered.json()["tokens"]}).json()
    assert text["prompt"].startswith("<|im_start|>system\nBe brief.\n\nYou can call these functions.")
    assert '{"name": "get_weather", "parameters": {"type": "object"' in text["prompt"]
    assert ('<|im_start|>assistant\n{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}'
            '<|im_end|>') in text["prompt"]
    assert '<|im_start|>user\n{"tool_response": {"name": "get_weather", "content": "-3 degrees"}}' in text["prompt"]


def tool_chat(client, **kw):
    kw.setdefault("max_tokens", 40)
    kw.setdefault("tools", [WEATHER])
    return client.chat.completions.create(model=QWEN, messages=[{"role": "user", "content": "Weather in Oslo?"}], **kw)


def test_tools_through_qwens_template(client, server):
    assert tool_chat(client, tool_choice="auto").choices[0].finish_reason in ("stop", "length", "tool_calls")
    for kw, message in [({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "names the function"),
                        ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "needs a 'name'")]:
        with pytest.raises(openai.BadRequestError, match=message):
            tool_chat(client, **kw)
    conversation = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 degrees"}]
    assert client.chat.completions.create(model=QWEN, messages=conversation, tools=[WEATHER], max_tokens=4).choices
    rendered = httpx.post(server.url + "/tokenize", json={"model": QWEN, "messages": conversation, "tools": [WEATHER]})
    text = httpx.post(server.url + "/detokenize", json={"model": QWEN, "tokens": rendered.json()["tokens"]}).json()
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text["prompt"]
    assert "<tool_response>\n-3 degrees\n</tool_response>" in text["prompt"] and '"name": "get_weather"' in text["prompt"]


def test_a_named_tool_choice_always_calls_it(client):
    for stream in (False, True):
        kw = dict(tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=1.0, seed=3,
                  max_tokens=300)
        if not stream:
            choice = tool_chat(client, **kw).choices[0]
            assert choice.finish_reason == "tool_calls"
            call = choice.message.tool_calls[0]
        else:
            pieces = [c.choices[0] for c in tool_chat(client, stream=True, **kw) if c.choices]
            assert pieces[-1].finish_reason == "tool_calls"
            call = [p.delta.tool_calls[0] for p in pieces if p.delta.tool_calls][0]
        assert call.function.name == "get_weather" and call.id.startswith("call_")


# --- /tokenize, /detokenize ----------------------------------------------------------------------


def test_tokenize_and_detokenize_in_vllm_and_llama_server_shapes(server):
    url = server.url
    vllm = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": PROMPT, "return_token_strs": True}).json()
    assert vllm["count"] == len(vllm["tokens"]) == len(vllm["token_strs"]) and vllm["max_model_len"] == 1024
    back = httpx.post(url + "/detokenize", json={"model": MODEL, "tokens": vllm["tokens"]}).json()
    assert back["prompt"].endswith(PROMPT) and back["content"] == back["prompt"]
    llama = httpx.post(url + "/tokenize", json={"model": MODEL, "content": PROMPT, "with_pieces": True}).json()
    assert "".join(p["piece"] for p in llama["tokens"]) == PROMPT
    chat_ids = httpx.post(url + "/tokenize", json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}).json()
    chat_text = httpx.post(url + "/detokenize", json={"model": MODEL, "tokens": chat_ids["tokens"]}).json()["prompt"]
    assert chat_text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    for path, body in [("/detokenize", {"model": MODEL, "tokens": [400]}), ("/tokenize", {"model": MODEL}),
                       ("/tokenize", {"model": MODEL, "prompt": "x", "add_special_tokens": "yes"})]:
        response = httpx.post(url + path, json=body)
        assert response.status_code == 400, response.text


def test_triton_generate_takes_the_new_parameters(server):
    body = {"text_input": PROMPT, "parameters": {"max_tokens": 4, "response_format": '{"type": "json_object"}'}}
    assert httpx.post(f"{server.url}/v2/models/{MODEL}/generate", json=body, timeout=30).status_code == 200
    body["parameters"]["response_format"] = "{not json"
    answer = httpx.post(f"{server.url}/v2/models/{MODEL}/generate", json=body, timeout=30)
    assert answer.status_code == 400 and "must be JSON" in answer.text
