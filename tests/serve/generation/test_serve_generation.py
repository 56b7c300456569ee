"""`kiln serve` on a text-generation artifact, end to end: a real server process (the tiny Llama
converted by `kiln convert --task text-generation`, fp32) called by real clients: openai (sync,
async, streaming), httpx (Triton's generate / generate_stream SSE), tritonclient (HTTP infer,
gRPC infer and the decoupled stream)."""

from __future__ import annotations

import asyncio
import json
import queue
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest

from servers import GrpcServer, sse_events

PROMPT = "The quick brown fox"
MODEL = "tiny"


@pytest.fixture(scope="module")
def artifact(tiny_generation_artifact):
    return tiny_generation_artifact


@pytest.fixture(scope="module")
def server(artifact):
    srv = GrpcServer([f"{MODEL}={artifact}", "--variant", "fp32", "--max-batch-size", "16"])
    yield srv
    code, err = srv.stop()
    assert code == 0, err[-2000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def greedy(client, prompt: str = PROMPT, **kw) -> openai.types.Completion:
    return client.completions.create(model=MODEL, prompt=prompt, temperature=0, **kw)


def metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    match = re.search(rf'^{re.escape(name)}{{model_name="{MODEL}"}} (\S+)$', text, re.M)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


# --- OpenAI -------------------------------------------------------------------------------------


def test_completion_usage_and_length(client, artifact):
    from tokenizers import Tokenizer

    answer = greedy(client, max_tokens=7, extra_body={"ignore_eos": True})
    choice = answer.choices[0]
    assert choice.finish_reason == "length" and answer.model == MODEL
    prompt_tokens = len(Tokenizer.from_file(str(artifact / "tokenizer.json")).encode(PROMPT).ids)
    assert answer.usage.prompt_tokens == prompt_tokens
    assert answer.usage.completion_tokens == 7 and answer.usage.total_tokens == prompt_tokens + 7
    assert choice.text and greedy(client, max_tokens=7, extra_body={"ignore_eos": True}).choices[0].text == choice.text


def test_streamed_completion_equals_whole_and_reports_usage(client):
    whole = greedy(client, max_tokens=12, extra_body={"ignore_eos": True})
    chunks = list(greedy(client, max_tokens=12, stream=True, stream_options={"include_usage": True},
                         extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_sync_stream_and_async_agree(client, server):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert whole.choices[0].message.role == "assistant" and whole.usage.completion_tokens == 10
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"

    async def run_async() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0) as aclient:
            answers = await asyncio.gather(*[aclient.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
                for _ in range(4)])
        return [a.choices[0].message.content for a in answers]

    assert asyncio.run(run_async()) == [whole.choices[0].message.content] * 4


def test_stop_strings_cut_the_answer(client):
    full = greedy(client, max_tokens=24, extra_body={"ignore_eos": True}).choices[0].text
    stop = full[8:11]
    assert stop.strip(), f"need a visible stop string in {full!r}"
    cut = greedy(client, max_tokens=24, stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[:full.index(stop)]
    streamed = greedy(client, max_tokens=24, stop=stop, stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == cut.text


def test_seeds_reproduce_sampling(client):
    def sample(seed: int) -> str:
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(s) for s in (1, 2, 3, 4)}) > 1  # sampling does sample


def test_openai_errors_are_openai_shaped(client, server):
    with pytest.raises(openai.BadRequestError, match=r"'n' must be in \[1, 16\]"):
        client.completions.create(model=MODEL, prompt=PROMPT, n=17)
    with pytest.raises(openai.BadRequestError, match="context is 1024 tokens"):
        client.completions.create(model=MODEL, prompt="fox " * 2000, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match=r"'frequency_penalty' must be in \[-2, 2\]"):
        client.completions.create(model=MODEL, prompt=PROMPT, frequency_penalty=2.5)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt=PROMPT, temperature=-1)
    with pytest.raises(openai.NotFoundError, match="unknown model"):
        client.completions.create(model="nope", prompt=PROMPT)
    bad = httpx.post(server.url + "/v1/chat/completions", content=b"{not json")
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    listed = {m.id for m in client.models.list()}
    assert MODEL in listed


# --- Triton generate, OIP infer, gRPC -----------------------------------------------------------------


def test_generate_and_generate_stream(server, client):
    reference = greedy(client, max_tokens=9, extra_body={"ignore_eos": True}).choices[0].text
    body = {"text_input": PROMPT, "parameters": {"max_tokens": 9, "temperature": 0, "ignore_eos": True}}
    answer = httpx.post(f"{server.url}/v2/models/{MODEL}/generate", json=body, timeout=30).json()
    assert answer["text_output"] == reference and answer["model_name"] == MODEL and answer["finish_reason"] == "length"
    with httpx.stream("POST", f"{server.url}/v2/models/{MODEL}/generate_stream", json=body, timeout=30) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(e) for e in sse_events(response)]
    assert "".join(e["text_output"] for e in events) == reference
    assert events[-1]["finish_reason"] == "length" and events[-1]["completion_tokens"] == 9
    missing = httpx.post(f"{server.url}/v2/models/{MODEL}/generate", json={"parameters": {}})
    assert missing.status_code == 400 and "text_input" in missing.json()["error"]


def test_oip_infer_http_and_grpc(server, client):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    reference = greedy(client, max_tokens=6, extra_body={"ignore_eos": True}).choices[0].text
    parameters = {"max_tokens": 6, "temperature": "0", "ignore_eos": True}  # tritonclient: no float parameters
    prompt = np.array([PROMPT.encode()], dtype=object)
    http = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    item = httpclient.InferInput("text_input", [1], "BYTES")
    item.set_data_from_numpy(prompt)
    assert http.infer(MODEL, [item], parameters=parameters).as_numpy("text_output")[0].decode() == reference
    meta = http.get_model_metadata(MODEL)
    assert meta["inputs"][0]["name"] == "text_input" and meta["outputs"][0]["name"] == "text_output"
    with grpcclient.InferenceServerClient(server.grpc_url) as g:
        item = grpcclient.InferInput("text_input", [1], "BYTES")
        item.set_data_from_numpy(prompt)
        assert g.infer(MODEL, [item], parameters=parameters).as_numpy("text_output")[0].decode() == reference


def test_grpc_decoupled_stream(server, client):
    import tritonclient.grpc as grpcclient

    reference = greedy(client, max_tokens=8, extra_body={"ignore_eos": True}).choices[0].text
    results: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(server.grpc_url) as g:
        g.start_stream(callback=lambda result, error: results.put((result, error)))
        for request_id in ("a", "b"):
            item = grpcclient.InferInput("text_input", [1], "BYTES")
            item.set_data_from_numpy(np.array([PROMPT.encode()], dtype=object))
            g.async_stream_infer(MODEL, [item], request_id=request_id,
                                 parameters={"sampling_parameters": json.dumps(
                                     {"max_tokens": 8, "temperature": 0, "ignore_eos": True})})
        texts: dict[str, str] = {"a": "", "b": ""}
        finals = 0
        while finals < 2:
            result, error = results.get(timeout=30)
            assert error is None, error
            response = result.get_response()
            texts[response.id] += result.as_numpy("text_output")[0].decode()
            finals += response.parameters["triton_final_response"].bool_param
        # an error ends its own request only, as a response with an error
        item = grpcclient.InferInput("text_input", [1], "BYTES")
        item.set_data_from_numpy(np.array([PROMPT.encode()], dtype=object))
        g.async_stream_infer(MODEL, [item], request_id="bad", parameters={"top_p": "5.0"})
        result, error = results.get(timeout=30)
        assert result is None and "top_p" in str(error)
        g.stop_stream()
    assert texts == {"a": reference, "b": reference}


# --- scheduling -------------------------------------------------------------------------------------


def test_greedy_answers_do_not_depend_on_load(server, client):
    """The same prompt, token for token, alone and among 16 concurrent streams of other prompts
    and lengths (which join and leave the running batch at different steps)."""
    prompts = [PROMPT, "Hello there", "A longer prompt about " * 3, "x", "Numbers 1 2 3 4 5"]
    jobs = [(prompts[i % len(prompts)], (40, 23)[i % 2]) for i in range(16)]

    def answer(job: tuple[str, int]) -> str:
        prompt, n = job
        return greedy(client, prompt, max_tokens=n, extra_body={"ignore_eos": True}).choices[0].text

    alone = {job: answer(job) for job in set(jobs)}
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(answer, jobs))
    assert together == [alone[job] for job in jobs]


def test_metrics_count_tokens_and_latency(server, client):
    before = metric(server, "vllm:generation_tokens_total")
    greedy(client, max_tokens=5, extra_body={"ignore_eos": True})
    assert metric(server, "vllm:generation_tokens_total") - before == 5
    text = httpx.get(server.url + "/metrics").text
    for name in ("vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total", "vllm:num_requests_running",
                 "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert name in text, name
    assert metric(server, "vllm:num_requests_running") == 0


@pytest.fixture(scope="module")
def one_slot(artifact):
    """One running sequence and one waiting request at most."""
    srv = GrpcServer([f"{MODEL}={artifact}", "--variant", "fp32", "--max-batch-size", "1", "--max-queue-size", "1"])
    yield srv
    code, err = srv.stop()
    assert code == 0, err[-2000:]


def _long_stream(srv, max_tokens: int = 900):
    return httpx.stream("POST", srv.url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "stream": True})


def test_disconnect_mid_stream_frees_the_sequence(one_slot):
    before = metric(one_slot, "vllm:generation_tokens_total")
    with _long_stream(one_slot) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")  # generating
    deadline = time.monotonic() + 10
    while metric(one_slot, "vllm:num_requests_running") != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(one_slot, "vllm:num_requests_running") == 0
    generated = metric(one_slot, "vllm:generation_tokens_total") - before
    assert generated < 900, "the abandoned stream ran to its end"
    # the slot is free: a new request is answered at once
    answer = httpx.post(one_slot.url + "/v1/completions", timeout=30,
                        json={"model": MODEL, "prompt": "hi", "max_tokens": 3, "ignore_eos": True}).json()
    assert answer["usage"]["completion_tokens"] == 3


def test_queue_full_answers_503_with_retry_after(one_slot):
    """Six requests at once on one running slot and one waiting place: the rest are refused at once
    with 503 + Retry-After, and every accepted one runs to its end (none dropped)."""
    def ask(_: int) -> httpx.Response:
        return httpx.post(one_slot.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": 900, "temperature": 0, "ignore_eos": True})

    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(ask, range(6)))
    refused = [a for a in answers if a.status_code == 503]
    accepted = [a for a in answers if a.status_code == 200]
    assert refused and len(accepted) >= 2 and len(refused) + len(accepted) == 6
    for a in refused:
        assert a.headers["retry-after"] == "1" and a.json()["error"]["code"] == "overloaded"
    for a in accepted:
        assert a.json()["usage"]["completion_tokens"] == 900


def test_sigterm_finishes_running_streams(artifact):
    """SIGTERM while three streams run: each still gets every token, then the server exits 0.

    The clients connect first and start together (a barrier), and ask for most of the context, so
    that on a slow machine no stream ends before the others have started."""
    srv = GrpcServer([f"{MODEL}={artifact}", "--variant", "fp32", "--max-batch-size", "4"])
    outcomes: list = []
    max_tokens = 1000
    start = threading.Barrier(3)

    def stream() -> None:
        with httpx.Client(base_url=srv.url, timeout=60) as client:
            client.get("/v2/health/ready")  # the connection exists before the race starts
            start.wait()
            with client.stream("POST", "/v1/completions", json={
                    "model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}) as response:
                outcomes.append(sse_events(response))

    threads = [threading.Thread(target=stream) for _ in range(3)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while metric(srv, "vllm:num_requests_running") < 3:
        assert not outcomes, "a stream ended before all three were running: the machine outran the test"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    srv.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(60)
    code, err = srv.stop()
    assert code == 0, err[-2000:]
    assert len(outcomes) == 3
    for events in outcomes:
        assert events[-1] == "[DONE]"
        usage = json.loads(events[-2])["usage"]
        assert usage["completion_tokens"] == max_tokens


def test_engine_replicas_give_the_same_answers_and_metrics_add_up(artifact, client):
    """--generation-replicas 2: two engine cores, requests spread over them; greedy answers equal one
    engine's, token for token (each replica runs the same graph with the same threads), and the
    running-requests gauge sums both replicas."""
    srv = GrpcServer([f"{MODEL}={artifact}", "--variant", "fp32", "--max-batch-size", "4", "--generation-replicas", "2",
                      "--threads", "1"])
    try:
        two = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        prompts = [PROMPT, "Hello there", "x", "Numbers 1 2 3 4 5"] * 2

        def answer(c, p):
            return greedy(c, p, max_tokens=24, extra_body={"ignore_eos": True}).choices[0].text

        expected = [answer(client, p) for p in prompts]
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda p: answer(two, p), prompts))
        assert got == expected
        assert metric(srv, "vllm:num_requests_running") == 0
        assert metric(srv, "vllm:generation_tokens_total") == 24 * len(prompts)
    finally:
        code, err = srv.stop()
    assert code == 0, err[-2000:]
