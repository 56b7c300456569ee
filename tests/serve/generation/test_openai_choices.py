"""OpenAI's choice objects (serve/generation/openai_choices.py) built from deltas, streamed and
whole: log-probabilities in chat's and completions' shapes, the completion's echo, tool calls split
out of a streamed answer whatever the token boundaries.

The deltas here are stubs carrying the log-probability fields the engine puts on each delta
(``logprob``, ``top_logprobs``, ``prompt_logprobs``), so the formatting is checked before the
engine fills them."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pytest

from generation_helpers import tiny_tokenizer
from modelkiln.generation.chat.tool_calls import Generic, Hermes, Llama3Json
from modelkiln.generation.structured_output.vocabulary import Vocabulary
from modelkiln.serve.generation.openai_choices import ChatChoice, CompletionChoice


@dataclass
class StubDelta:
    token_id: int
    text: str
    finish_reason: str | None = None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    prompt_logprobs: Any = None


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def vocabulary(tokenizer):
    return Vocabulary(tokenizer, [tokenizer.token_to_id("<|im_end|>")])


def deltas(tokenizer, text: str, finish: str = "stop") -> list[StubDelta]:
    ids = tokenizer.encode(text).ids
    other = tokenizer.token_to_id("<|endoftext|>")  # a runner-up no answer here contains
    out = [StubDelta(i, tokenizer.decode([i]), None, -0.5 - k, [(i, -0.5 - k), (other, -3.0)])
           for k, i in enumerate(ids)]
    out[-1].finish_reason = finish
    return out


def test_chat_logprobs_streamed_and_whole(tokenizer, vocabulary):
    answer = deltas(tokenizer, "The fox")
    streamed = ChatChoice(0, vocabulary, logprobs=True)
    pieces = [p for d in answer for p in streamed.feed(d)]
    whole = ChatChoice(0, vocabulary, logprobs=True, stream=False)
    for d in answer:
        assert whole.feed(d) == []
    choice = whole.whole()
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == [vocabulary.token_text(d.token_id) for d in answer]
    assert [c["logprob"] for c in content] == [d.logprob for d in answer]
    assert all(bytes(c["bytes"]) == vocabulary.token_bytes(d.token_id) for c, d in zip(content, answer))
    assert content[0]["top_logprobs"] == [{"token": content[0]["token"], "logprob": -0.5, "bytes": content[0]["bytes"]},
                                          {"token": "<|endoftext|>", "logprob": -3.0,
                                           "bytes": list(b"<|endoftext|>")}]
    assert [e for p in pieces for e in p["logprobs"]["content"]] == content
    assert choice["message"] == {"role": "assistant", "content": "The fox"} and choice["finish_reason"] == "stop"


def test_a_token_without_text_sends_its_logprob_with_the_next_chunk(tokenizer, vocabulary):
    choice = ChatChoice(0, vocabulary, logprobs=True)
    assert choice.feed(StubDelta(5, "", None, -1.0)) == []  # half a character: nothing to send yet
    piece, = choice.feed(StubDelta(6, "é", "stop", -2.0))
    assert [e["logprob"] for e in piece["logprobs"]["content"]] == [-1.0, -2.0]


def test_completion_logprobs_with_echo(tokenizer, vocabulary):
    prompt = "The quick"
    prompt_ids = tokenizer.encode(prompt).ids
    answer = deltas(tokenizer, " brown fox", "length")
    answer[0].prompt_logprobs = [None] + [(-1.5, [(t, -1.5)]) for t in prompt_ids[1:]]
    choice = CompletionChoice(2, vocabulary, logprobs=True, echo=prompt, prompt_ids=prompt_ids, stream=False)
    for d in answer:
        choice.feed(d)
    out = choice.whole()
    assert out["index"] == 2 and out["text"] == "The quick brown fox" and out["finish_reason"] == "length"
    logprobs = out["logprobs"]
    n = len(prompt_ids)
    assert logprobs["tokens"][:n] == [vocabulary.token_text(t) for t in prompt_ids]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:n] == [-1.5] * (n - 1)
    assert logprobs["token_logprobs"][n:] == [d.logprob for d in answer]
    assert logprobs["text_offset"] == [len("".join(logprobs["tokens"][:k])) for k in range(len(logprobs["tokens"]))]
    assert logprobs["top_logprobs"][n] == {vocabulary.token_text(answer[0].token_id): -0.5, "<|endoftext|>": -3.0}


def test_streamed_completion_echoes_first(tokenizer, vocabulary):
    choice = CompletionChoice(0, None, logprobs=False, echo="Hi")
    pieces = [p for d in deltas(tokenizer, " there") for p in choice.feed(d)]
    assert "".join(p["text"] for p in pieces) == "Hi there" and pieces[0]["text"].startswith("Hi")


def stream_chat(syntax, chunks: list[str]) -> tuple[str, list[dict[str, Any]], str]:
    choice = ChatChoice(0, None, logprobs=False, tool_format=syntax)
    pieces = []
    for k, text in enumerate(chunks):
        pieces += choice.feed(StubDelta(0, text, "stop" if k == len(chunks) - 1 else None))
    content = "".join(p["delta"].get("content", "") for p in pieces)
    assert all(len(p["delta"].get("tool_calls", ())) <= 1 for p in pieces)  # one piece a chunk, as OpenAI's
    assert all(p["finish_reason"] is None for p in pieces[:-1])
    calls = [c for p in pieces for c in p["delta"].get("tool_calls", [])]
    return content, calls, pieces[-1]["finish_reason"]


def assemble(calls: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """What the openai client's stream helpers do: join the pieces of each index."""
    joined: dict[int, dict[str, str]] = {}
    for piece in calls:
        call = joined.setdefault(piece["index"], {"name": "", "arguments": "", "id": ""})
        call["id"] += piece.get("id", "")
        call["name"] += piece["function"].get("name", "")
        call["arguments"] += piece["function"].get("arguments", "")
    assert all(c["id"].startswith("call_") for c in joined.values())
    return [(c["name"], json.loads(c["arguments"])) for _, c in sorted(joined.items())]


HERMES_ANSWER = ('Checking.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": 2}}\n</tool_call>\n'
                 '<tool_call>\n{"name": "get_time", "arguments": {"zone": 3}}\n</tool_call>')


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_hermes_calls_stream_whatever_the_token_boundaries(size):
    chunks = [HERMES_ANSWER[i:i + size] for i in range(0, len(HERMES_ANSWER), size)]
    content, calls, finish = stream_chat(Hermes(), chunks)
    assert content == "Checking." and finish == "tool_calls"
    assert assemble(calls) == [("get_time", {"zone": 2}), ("get_time", {"zone": 3})]
    whole = ChatChoice(0, None, logprobs=False, tool_format=Hermes(), stream=False)
    for k, text in enumerate(chunks):
        whole.feed(StubDelta(0, text, "stop" if k == len(chunks) - 1 else None))
    out = whole.whole()
    assert out["finish_reason"] == "tool_calls" and out["message"]["content"] == "Checking."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in out["message"]["tool_calls"]] \
        == [("get_time", {"zone": 2}), ("get_time", {"zone": 3})]


def test_text_that_only_looks_like_a_call_stays_content():
    content, calls, finish = stream_chat(Hermes(), ["a <tool", "_cal", "l> b", " <tool_call>{bad", "</tool_call>"])
    assert calls == [] and finish == "stop" and content == "a <tool_call> b <tool_call>{bad</tool_call>"
    content, calls, finish = stream_chat(Hermes(), ["a <tool_c"])  # cut off mid-marker: still said
    assert content == "a <tool_c" and finish == "stop"


def test_llama3_calls_stream_at_the_end():
    content, calls, finish = stream_chat(Llama3Json(), [" ", '{"name": "get_time", ', '"parameters": {"zone": 1}}'])
    assert content == "" and finish == "tool_calls" and assemble(calls) == [("get_time", {"zone": 1})]
    content, calls, finish = stream_chat(Llama3Json(), ["It ", "is ", "noon."])
    assert content == "It is noon." and calls == [] and finish == "stop"


def test_generic_calls_stream_at_the_end_and_text_as_it_comes():
    answer = '{"tool_calls": [{"name": "get_time", "arguments": {"zone": 1}}, {"name": "get_time", "arguments": {}}]}'
    content, calls, finish = stream_chat(Generic(), [answer[i:i + 5] for i in range(0, len(answer), 5)])
    assert content == "" and finish == "tool_calls" and assemble(calls) == [("get_time", {"zone": 1}), ("get_time", {})]
    choice = ChatChoice(0, None, logprobs=False, tool_format=Generic())
    assert choice.feed(StubDelta(0, "It ", None))[0]["delta"] == {"content": "It "}  # text is not held back
    content, calls, finish = stream_chat(Generic(), ['{"n": ', "3}"])  # a response format's answer: content
    assert content == '{"n": 3}' and calls == [] and finish == "stop"
