"""kiln loadtest on text generation and ``--check``, against real processes: `kiln serve` of the
tiny generation artifact (each streaming protocol, closed and open loop, the CLI's JSON contract),
`kiln serve` of tiny encoders (``--check`` for every encoder protocol), and a fake server that
answers right alone and wrong under load (``fake_answer_server.py``), so that each kind of
mismatch is shown to be caught."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import time

import httpx
import openai
import pytest
from helpers import kiln, REPO, TESTS
from servers import Server, free_port

from modelkiln.loadtest import check
from modelkiln.loadtest.api import LoadtestOptions, parse_extra_input, prepare, run_loadtest
from modelkiln.loadtest.client import render_request, run_async
from modelkiln.loadtest.report import SUMMARY_KEYS, read_json
from modelkiln.loadtest.runner import Load
from modelkiln.loadtest.records import StreamRecord
from modelkiln.loadtest.streaming import build_requests

SHORT = dict(warmup_s=0.2, window_s=0.5, stable_windows=2, max_windows=2)
GENERATION = ("openai-chat", "openai-completions", "generate")


@pytest.fixture(scope="module")
def server(tiny_generation_artifact):
    srv = Server([f"tiny={tiny_generation_artifact}", "--variant", "fp32", "--max-batch-size", "8"])
    yield srv
    code, err = srv.stop()
    assert code == 0, err[-2000:]


def options(url: str, model: str, protocol: str, *loads: Load, **kw) -> LoadtestOptions:
    return LoadtestOptions(url=url, model=model, protocol=protocol, loads=loads,
                           **{"inputs": "sts", "max_inputs": 6, "max_tokens": 8, "ignore_eos": True, "check": True,
                              **SHORT, **kw})


@pytest.mark.parametrize("protocol", GENERATION)
def test_each_protocol_closed_loop_checked(server, protocol):
    result = run_loadtest(options(server.url, "tiny", protocol, Load("concurrency", 1), Load("concurrency", 4)))
    assert result.mismatch_examples == []
    for step in result.steps:
        g = step.generation
        assert step.errors == {} and step.stream_errors == 0 and step.requests > 0
        assert step.checked >= step.requests and step.mismatches == 0 and step.mismatch_kinds == {}
        assert g is not None and g.tokens_from == "usage" and g.output_tokens_per_request == 8  # --ignore-eos
        assert 0 < g.ttft.p50 <= g.ttft.p90 <= g.ttft.p99 and g.itl is not None and g.itl.p50 >= 0
        assert g.ttft.p50 <= step.latency.p50 * 1.0001
        assert g.output_tokens_per_s > 0


def test_open_loop_checked_and_natural_lengths(server):
    result = run_loadtest(options(server.url, "tiny", "openai-completions", Load("rate", 20), ignore_eos=False,
                                  max_tokens=None, inputs="squad"))
    step = result.steps[0]
    assert result.max_tokens is None and result.ignore_eos is False
    assert step.errors == {} and step.mismatches == 0 and step.checked > 0 and step.late_fraction is not None
    assert step.generation.output_tokens_per_request > 0  # natural lengths, up to the artifact's default


def test_constrained_requests_checked_under_load(server):
    """--extra-inputs puts a constraint in every request; --check compares each constrained answer
    under load with the same request alone."""
    choice = ("structured_outputs", {"choice": ["alpha", "beta gamma"]})
    result = run_loadtest(options(server.url, "tiny", "openai-chat", Load("concurrency", 4), ignore_eos=False,
                                  max_tokens=16, extra_inputs=(choice,)))
    step = result.steps[0]
    assert step.errors == {} and step.stream_errors == 0 and step.checked > 0 and step.mismatches == 0
    assert step.generation.output_tokens_per_request < 16  # the choice ends the answer, not max_tokens
    body = build_requests("openai-chat", "tiny", ["hi"], 16, False, (choice,))[0].body
    assert json.loads(body)["structured_outputs"] == {"choice": ["alpha", "beta gamma"]}
    assert parse_extra_input('response_format:{"type": "json_object"}') == ("response_format", {"type": "json_object"})
    assert parse_extra_input("user:someone") == ("user", "someone")


def test_reference_equals_the_openai_client(server):
    """The load client's reading of a stream (text, usage) is what the openai client reads."""
    opts = options(server.url, "tiny", "openai-chat", Load("concurrency", 1), max_inputs=2)

    async def references():
        prepared, _ = await prepare(opts)
        raws = [render_request("POST", "127.0.0.1", server.port, p.path, p.body, p.headers) for p in prepared]
        return await check.generation_references(server.url, raws, "openai-chat", 30, 8, True), prepared

    checker, prepared = run_async(references)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    for ref, request in zip(checker.references, prepared):
        prompt = json.loads(request.body)["messages"][0]["content"]
        stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                                max_tokens=8, temperature=0, stream=True,
                                                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert ref.text == text and ref.completion_tokens == chunks[-1].usage.completion_tokens == 8


def test_cli_json_contract_csv_plot(server, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Tell me about the sea.\nWhat is a fox?\nName three colors.\n")
    out, table, png = tmp_path / "run.json", tmp_path / "run.csv", tmp_path / "run.png"
    r = kiln("loadtest", server.url, "-m", "tiny", "--protocol", "openai-chat", "--inputs", str(prompts),
             "--max-tokens", "6", "--ignore-eos", "--concurrency", "1,2", "--check", "--warmup", "0.2",
             "--window", "0.5", "--max-windows", "2", "--json", str(out), "--csv", str(table), "--plot", str(png),
             timeout=120)
    assert r.returncode == 0, r.stderr
    assert "TTFT p50" in r.stdout and "mismatches" in r.stdout and "c=2" in r.stdout
    data = json.loads(out.read_text())
    assert data["protocol"] == "openai-chat" and data["max_tokens"] == 6 and data["check"] is True
    documented = REPO / "docs" / "loadtest-generation.md"
    for step, load in zip(data["steps"], ("c=1", "c=2")):
        for key in (*SUMMARY_KEYS, "mismatches", "checked", "stream_errors", "errors"):
            assert key in step and f"`{key}`" in documented.read_text(), key
        assert step["load"] == load and step["mismatches"] == 0 and step["errors_total"] == 0
        assert step["output_tokens_per_request"] == 6 and step["ttft_p50_ms"] > 0 and step["output_tokens_per_s"] > 0
    again = read_json(out)  # --compare reads generation results back
    assert again.steps[1].generation.ttft.p50 == pytest.approx(data["steps"][1]["ttft_p50_ms"], abs=1e-3)
    rows = list(csv.DictReader(table.open()))
    assert [r["load"] for r in rows] == ["c=1", "c=2"] and float(rows[0]["itl_p50_ms"]) >= 0
    assert png.read_bytes().startswith(b"\x89PNG")


# --- --check must catch wrong answers ----------------------------------------------------------

@pytest.fixture(scope="module")
def fake():
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(TESTS / "fake_answer_server.py"), str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            if httpx.get(url + "/v2/health/ready", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(proc.stderr.read())
        time.sleep(0.05)
    yield url
    proc.terminate()
    proc.wait(timeout=10)


FAKE = dict(inputs="sts", max_inputs=4, warmup_s=0.1, window_s=0.3, stable_windows=2, max_windows=1)


@pytest.mark.parametrize("protocol, fault, kind", [
    ("openai-chat", "wrong-text", "text"),
    ("generate", "wrong-text", "text"),
    ("openai-completions", "bad-framing", "framing"),
    ("generate", "bad-framing", "framing"),
    ("openai-chat", "bad-usage", "usage"),
    ("generate", "bad-usage", "usage"),
])
def test_check_catches_wrong_answers_under_load(fake, protocol, fault, kind):
    alone, loaded = run_loadtest(LoadtestOptions(url=fake, model=fault, protocol=protocol, check=True,
                                                 loads=(Load("concurrency", 1), Load("concurrency", 4)), **FAKE)).steps
    assert alone.mismatches == 0 and alone.checked > 0  # alone the fake answers right: the check is not just failing
    assert loaded.mismatches > 0 and set(loaded.mismatch_kinds) == {kind}
    assert loaded.stream_errors == 0


@pytest.mark.parametrize("protocol, fault", [("openai-chat", "mid-stream-error"), ("generate", "mid-stream-error"),
                                             ("openai-completions", "no-done")])
def test_streams_that_fail_midway_are_their_own_column(fake, protocol, fault):
    alone, loaded = run_loadtest(LoadtestOptions(url=fake, model=fault, protocol=protocol, check=True,
                                                 loads=(Load("concurrency", 1), Load("concurrency", 4)), **FAKE)).steps
    assert alone.stream_errors == 0 and alone.errors == {}
    assert loaded.stream_errors > 0 and loaded.errors.get("mid-stream", 0) > 0 and loaded.mismatches == 0


def test_good_fake_passes_and_cli_prints_mismatches(fake):
    result = run_loadtest(LoadtestOptions(url=fake, model="good", protocol="openai-chat", check=True,
                                          loads=(Load("concurrency", 4),), **FAKE))
    assert result.steps[0].mismatches == 0 and result.steps[0].checked > 0
    r = kiln("loadtest", fake, "-m", "wrong-text", "--protocol", "generate", "--inputs", "sts", "--max-inputs", "3",
             "--concurrency", "3", "--check", "--warmup", "0.1", "--window", "0.4", "--max-windows", "1", timeout=60)
    assert r.returncode == 0, r.stderr
    assert "mismatch: request" in r.stdout and "wrong" in r.stdout


def test_triton_like_generate_stream_counts_chunks(fake):
    """Triton's events carry text only: the end of the response ends the stream, tokens are counted."""
    step = run_loadtest(LoadtestOptions(url=fake, model="triton-like", protocol="generate", check=True,
                                        loads=(Load("concurrency", 2),), **FAKE)).steps[0]
    assert step.errors == {} and step.stream_errors == 0 and step.mismatches == 0 and step.checked > 0
    assert step.generation.tokens_from == "chunks" and step.generation.output_tokens_per_request == 6


def test_encoder_check_catches_a_changed_vector(fake):
    alone, loaded = run_loadtest(LoadtestOptions(url=fake, model="wrong-text", protocol="oip-json", check=True,
                                                 loads=(Load("concurrency", 1), Load("concurrency", 4)), **FAKE)).steps
    assert alone.mismatches == 0 and alone.checked > 0
    assert loaded.mismatches > 0 and set(loaded.mismatch_kinds) == {"vector"}


# --- encoders on kiln serve --------------------------------------------------------------------

@pytest.mark.parametrize("model, protocol", [("cls", "oip-json"), ("qa", "oip-binary"), ("cls", "task"),
                                             ("qa", "grpc")])
def test_encoder_check_on_kiln_serve(encoder_server, model, protocol):
    result = run_loadtest(LoadtestOptions(url=encoder_server.url, model=model, protocol=protocol, check=True, batch=2,
                                          grpc_url=encoder_server.grpc_url, loads=(Load("concurrency", 4),),
                                          warmup_s=0.1, window_s=0.3, stable_windows=2, max_windows=2))
    step = result.steps[0]
    assert step.errors == {} and step.checked > 0 and step.mismatches == 0, result.mismatch_examples


# --- pieces ------------------------------------------------------------------------------------

def test_stream_record_framing():
    r = StreamRecord("openai-completions")
    r.event(b'data: {"choices":[{"text":"a","finish_reason":null}]}', 1.0)
    r.event(b'data: {"choices":[{"text":"b","finish_reason":"length"}]}\ndata: {"x":1}', 2.0)  # two lines, one event
    r.event(b"data: [DONE]", 3.0)
    r.event(b'data: {"choices":[]}', 4.0)
    assert r.text == "ab" and r.token_times == [1.0, 2.0] and r.done and r.events_after_done == 1
    assert len(r.framing) == 2 and check.stream_faults(r) == r.framing
    r.completion_tokens = 1  # fewer tokens than text chunks
    assert check.stream_faults(r)[-1] == "usage says 1 tokens but 2 text chunks arrived"


def test_compare_vectors_and_labels():
    import numpy as np

    ref = {"E": np.array([[1.0, 2.0, 3.0], [0.5, 0.1, 0.0]], dtype=np.float32), "L": ["a", "b"]}
    assert check.compare(ref, {"E": ref["E"] * (1 + 1e-7), "L": ["a", "b"]}) is None
    assert check.compare(ref, {"E": ref["E"] + [[0, 0, 0.05], [0, 0, 0]], "L": ["a", "b"]})[0] == "vector"
    assert check.compare(ref, {"E": ref["E"], "L": ["a", "c"]})[0] == "label"
    assert check.compare({"score": 0.9}, {"score": 0.901})[0] == "vector"


# --- a server that closes kept-alive connections ------------------------------------------------

def test_a_kept_alive_connection_the_server_closed_is_not_a_server_error():
    """llama.cpp's server closes a connection after a streamed answer without saying
    `connection: close`; the next request on it then meets a closed socket before any byte of its
    answer. That is no failure of the server: the request goes again on a new connection (as HTTP
    clients do). Found as 55 "connection errors" against llama-server that disappeared with this."""
    import asyncio

    from modelkiln.loadtest.records import StepState
    from modelkiln.loadtest.streaming import send_stream

    events = (b'data: {"choices":[{"index":0,"delta":{"content":" hi"},"finish_reason":"stop"}]}\n\n'
              b"data: [DONE]\n\n")
    answer = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
              + f"{len(events):x}\r\n".encode() + events + b"\r\n0\r\n\r\n")
    served = []

    async def answer_once_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")  # the body is small and ignored
        writer.write(answer)
        await writer.drain()
        served.append(1)
        await asyncio.sleep(0.05)  # the client has the answer and may already reuse the connection
        writer.close()

    async def main() -> tuple[StepState, int]:
        server = await asyncio.start_server(answer_once_then_close, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        request = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                   b"content-length: 2\r\n\r\n{}")
        state = StepState([request], rate=None, seed=0, protocol="openai-chat")
        conn = None
        for _ in range(4):
            conn = await send_stream(state, conn, "127.0.0.1", port, timeout=5)  # reused at once: the close crosses it
        server.close()
        return state, len(served)

    state, served_count = asyncio.run(main())
    assert state.codes == [200, 200, 200, 200] and state.sent == 4 and served_count == 4


def test_nothing_listening_is_one_line():
    r = kiln("loadtest", f"http://127.0.0.1:{free_port()}", "-m", "tiny", "--protocol", "openai-chat",
             "--max-tokens", "4", "--concurrency", "1", timeout=60)
    assert r.returncode == 2 and "cannot connect to 127.0.0.1" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_sampled_requests_are_seeded_and_checked_under_load(server):
    """--sampled: temperature 0.7, top_p 0.95 and the prompt's index as its seed, so each sampled answer
    under load is compared with the same seeded request alone."""
    result = run_loadtest(options(server.url, "tiny", "openai-chat", Load("concurrency", 4), sampled=True))
    step = result.steps[0]
    assert result.sampled is True
    assert step.errors == {} and step.stream_errors == 0 and step.checked > 0 and step.mismatches == 0
    bodies = [json.loads(r.body) for r in build_requests("openai-chat", "tiny", ["a", "b"], 8, False, sampled=True)]
    assert [(b["temperature"], b["top_p"], b["seed"]) for b in bodies] == [(0.7, 0.95, 0), (0.7, 0.95, 1)]
