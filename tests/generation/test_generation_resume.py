"""Resuming a cut stream through a real `kiln serve`: a client reads part of a streamed answer
(with ``return_token_ids``), drops the connection, and sends the same request again from another
connection with ``resume_token_ids`` and the answer's ``seed``; what it gets then is exactly the
rest of the uninterrupted answer (text, token ids, finish reason, usage), greedy and sampled, over
OpenAI chat, OpenAI completions and Triton's generate_stream. And the requests it refuses."""

from __future__ import annotations

import json

import httpx
import pytest

from servers import Server

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "Tell me about the quick brown fox."}]
SAMPLED = {"temperature": 0.9, "top_p": 0.95, "repetition_penalty": 1.1}


@pytest.fixture(scope="module")
def server(tiny_generation_artifact):
    srv = Server([f"{MODEL}={tiny_generation_artifact}", "--variant", "fp32"])
    yield srv
    srv.stop()


class Route:
    """One streaming route: its URL, how a request names its prompt, and how to read an event."""

    def __init__(self, path: str, prompt: dict):
        self.path, self.prompt = path, prompt

    def body(self, **fields) -> dict:
        body = {**self.prompt, **fields, "return_token_ids": True, "stream": True}
        return body if self.path.startswith("/v1") else {k: v for k, v in body.items() if k != "stream"}

    def piece(self, event: dict) -> tuple[str, list[int], str | None]:
        """(text, token ids, finish reason) of one event."""
        if "choices" not in event:  # Triton's generate_stream
            return event["text_output"], event["token_ids"], event.get("finish_reason")
        if not event["choices"]:  # the usage chunk
            return "", [], None
        choice = event["choices"][0]
        text = choice["delta"].get("content", "") if "delta" in choice else choice["text"]
        return text, choice.get("token_ids", []), choice["finish_reason"]


ROUTES = {"chat": Route("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES}),
          "completions": Route("/v1/completions", {"model": MODEL, "prompt": "The quick brown fox"}),
          "generate_stream": Route(f"/v2/models/{MODEL}/generate_stream", {"text_input": "The quick brown fox"})}


def stream(server, route: Route, cut_after: int | None = None, **fields) -> dict:
    """Stream one answer; with ``cut_after``, drop the connection once that many of its tokens have come."""
    texts, ids, finish, seed, usage, events = [], [], None, None, None, 0
    body = route.body(**fields)
    if route.path.startswith("/v1"):
        body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", server.url + route.path, json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            assert "error" not in event, event
            seed = event.get("seed", seed)
            usage = event.get("usage") or usage
            if event.get("finish_reason") is not None:  # Triton's last event counts the answer
                usage = {"completion_tokens": event["completion_tokens"]}
            text, token_ids, reason = route.piece(event)
            texts.append(text)
            ids += token_ids
            finish = reason or finish
            events += len(token_ids)  # tokens, not text events: a sampled answer's tokens may carry no text
            if cut_after is not None and events >= cut_after:
                break  # leaving the block closes the connection mid-answer
    return {"text": "".join(texts), "ids": ids, "finish": finish, "seed": seed, "usage": usage}


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("sampling", ["greedy", "seeded", "server's seed"])
def test_a_cut_stream_resumed_elsewhere_is_the_uninterrupted_answer(server, route, sampling):
    route_ = ROUTES[route]
    fields = {"max_tokens": 40, "ignore_eos": True}
    if sampling == "seeded":
        fields |= {**SAMPLED, "seed": 1234}
    elif sampling == "server's seed":
        fields |= SAMPLED  # the client learns the seed from the answer's first event
    for cut_after in (1, 7, 20):
        cut = stream(server, route_, cut_after=cut_after, **fields)
        assert cut["seed"] is not None and 0 < len(cut["ids"]) < 40 and cut["finish"] is None
        whole = stream(server, route_, **{**fields, "seed": cut["seed"]})  # the uninterrupted answer
        assert whole["seed"] == cut["seed"] and len(whole["ids"]) == 40 and whole["finish"] == "length"
        assert whole["ids"][:len(cut["ids"])] == cut["ids"] and whole["text"].startswith(cut["text"])
        rest = stream(server, route_, resume_token_ids=cut["ids"], **{**fields, "seed": cut["seed"]})
        assert cut["ids"] + rest["ids"] == whole["ids"], (cut_after, cut, rest)
        assert cut["text"] + rest["text"] == whole["text"]
        assert rest["finish"] == whole["finish"] and rest["usage"]["completion_tokens"] == 40
        if sampling == "greedy":  # no seed needed to resume a greedy answer
            again = stream(server, route_, resume_token_ids=cut["ids"], **fields)
            assert again["ids"] == rest["ids"]


def test_a_resumed_answer_stops_where_the_uninterrupted_one_does(server):
    """Stop strings span the cut: the text held back as a possible stop string at the cut is
    replayed, so the resumed stream ends, and ends its text, exactly where the whole answer did."""
    route = ROUTES["completions"]
    fields = {"max_tokens": 40, "ignore_eos": True, **SAMPLED, "seed": 7}
    free = stream(server, route, **fields)
    stop = free["text"][len(free["text"]) // 2:][:3]  # a string that first appears in the answer's second half
    whole = stream(server, route, stop=[stop], **fields)
    assert whole["finish"] == "stop" and stop not in whole["text"] and len(whole["ids"]) < 40
    for cut_after in range(1, len(whole["ids"])):
        cut = stream(server, route, cut_after=cut_after, stop=[stop], **fields)
        if cut["finish"] is not None:
            break  # the answer ended before this many tokens
        rest = stream(server, route, resume_token_ids=cut["ids"], stop=[stop], **fields)
        assert cut["ids"] + rest["ids"] == whole["ids"] and cut["text"] + rest["text"] == whole["text"]
        assert rest["finish"] == "stop"


def test_whole_answers_report_their_seed_and_token_ids(server):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 12, "ignore_eos": True, **SAMPLED,
            "return_token_ids": True}
    first = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
    assert isinstance(first["seed"], int) and len(first["choices"][0]["token_ids"]) == 12
    again = httpx.post(server.url + "/v1/chat/completions", json={**body, "seed": first["seed"]}, timeout=60).json()
    assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    rest = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        **body, "seed": first["seed"], "resume_token_ids": first["choices"][0]["token_ids"][:5]}).json()
    assert first["choices"][0]["token_ids"][:5] + rest["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    assert rest["usage"]["completion_tokens"] == 12
    triton = httpx.post(f"{server.url}/v2/models/{MODEL}/generate", timeout=60, json={
        "text_input": "The quick brown fox", "max_tokens": 6, "return_token_ids": True}).json()
    assert isinstance(triton["seed"], int) and len(triton["token_ids"]) == triton["completion_tokens"]


@pytest.mark.parametrize("fields, message", [
    ({"resume_token_ids": [1, 2], **SAMPLED}, "needs the 'seed'"),
    ({"resume_token_ids": [1] * 8}, "nothing is left to generate"),
    ({"resume_token_ids": "1,2"}, "list of token ids"),
    ({"resume_token_ids": [10**9]}, "list of token ids"),
    ({"return_token_ids": "yes"}, "true or false"),
])
def test_resume_requests_that_cannot_be_answered_are_400(server, fields, message):
    for path, body in (("/v1/completions", {"model": MODEL, "prompt": "Hello"}),
                       (f"/v2/models/{MODEL}/generate_stream", {"text_input": "Hello"})):
        r = httpx.post(server.url + path, json={**body, "max_tokens": 8, **fields}, timeout=60)
        assert r.status_code == 400 and message in r.text, (path, r.text)


def test_resuming_past_the_end_of_the_answer_is_400(server):
    whole = stream(server, ROUTES["completions"], max_tokens=30)  # greedy, ends at an end-of-sequence token or 30
    if whole["finish"] == "stop":
        r = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "The quick brown fox", "max_tokens": 30, "resume_token_ids": whole["ids"]})
        assert r.status_code == 400 and "already ends the answer" in r.text
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "The quick brown fox", "max_tokens": 30, "resume_token_ids": whole["ids"] + [5]})
    assert r.status_code == 400
