"""The fault suite's generation mode, its probes about bad clients: the bad requests of the
generation routes (OpenAI completions and chat, Triton generate and generate_stream, OIP infer)
and a fuzzer of their bodies, and clients that hang up (mid-body, mid-prefill, mid-stream, before a
whole answer). The security probe is ``hostile.security`` with the generation routes added."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import orjson

from .generation_load import Answers, StreamTally, request_raw, run_streams, squad_prompt
from .harness import Conn, KilnServer, ProbeResult, Reply, metrics, once, request_bytes, wait_idle
from .hostile import BadCase, fuzz_strategies

def routes(model: str) -> tuple[tuple[str, str], ...]:
    """The generation routes, for the security probe's list of guarded routes."""
    return (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", f"/v2/models/{model}/generate"),
            ("POST", f"/v2/models/{model}/generate_stream"))


def _post(path: str, body: Any, **headers: str) -> bytes:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()  # orjson stops at 64-bit integers
    return request_bytes("POST", path, raw, headers or None)


def generation_cases(model: str, max_body: int) -> list[BadCase]:
    """Bad requests of every generation route, each to be answered 4xx with a JSON error."""
    completions, chat = "/v1/completions", "/v1/chat/completions"
    generate, stream = f"/v2/models/{model}/generate", f"/v2/models/{model}/generate_stream"
    infer = f"/v2/models/{model}/infer"
    prompt = {"model": model, "prompt": "Hello", "max_tokens": 4}
    messages = {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
    text_input = {"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["Hello"]}
    cases: list[BadCase] = []

    def add(case_id: str, path: str, body: Any, status: int | None = None, **headers: str) -> None:
        cases.append(BadCase(case_id, _post(path, body, **headers), status=status))

    # framing, on every route
    for name, path in (("completions", completions), ("chat", chat), ("generate", generate),
                       ("generate-stream", stream), ("infer", infer)):
        add(f"{name}-empty-body", path, b"")
        add(f"{name}-truncated-json", path, orjson.dumps(messages)[:20])
        add(f"{name}-top-level-list", path, b"[]")
        add(f"{name}-nan", path, b'{"prompt": NaN, "text_input": NaN}')
        add(f"{name}-invalid-utf8", path, b'{"prompt": "caf\xc3\x28", "text_input": "\xff\xfe"}')
        add(f"{name}-nested-100k", path, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
        add(f"{name}-gzip-garbage", path, b"\x1f\x8b\x08\x00garbage", **{"Content-Encoding": "gzip"})
        add(f"{name}-encoding-unknown", path, orjson.dumps(messages), **{"Content-Encoding": "br"})
        cases.append(BadCase(f"{name}-1GiB-announced", request_bytes("POST", path, b"", {"Content-Length": str(1 << 30)}),
                             status=413))
    # slow clients: a body announced, part of it sent, then silence (408 after --body-read-timeout)
    for name, path in (("completions", completions), ("generate", generate)):
        cases.append(BadCase(f"{name}-stalled-body", request_bytes("POST", path, b"", {"Content-Length": "5000"})
                             + b'{"model": ', stall=True, status=408))
    # which model
    add("completions-unknown-model", completions, {**prompt, "model": "nope"}, status=404)
    add("chat-model-a-number", chat, {**messages, "model": 7})
    add("generate-unknown-model", "/v2/models/nope/generate", {"text_input": "x"}, status=404)
    # OpenAI prompts and messages
    for case_id, value in (("missing", None), ("a-number", 7), ("an-object", {"a": 1}), ("mixed-list", ["a", 5]),
                           ("ids-out-of-vocabulary", [1, 2**40]), ("ids-negative", [1, -5]), ("empty", ""),
                           ("ids-bools", [True, False])):
        add(f"completions-prompt-{case_id}", completions, {**prompt, "prompt": value})
    add("completions-prompt-too-long-chars", completions, {**prompt, "prompt": "fox " * (max_body // 8)})
    add("completions-prompt-too-long-tokens", completions, {**prompt, "prompt": "fox " * 20_000})
    for case_id, value in (("missing", None), ("empty", []), ("a-string", "Hello"), ("not-objects", ["Hello"]),
                           ("no-role", [{"content": "Hi"}]), ("role-wizard", [{"role": "wizard", "content": "Hi"}]),
                           ("role-a-number", [{"role": 1, "content": "Hi"}]),
                           ("role-function", [{"role": "function", "content": "Hi"}]),
                           ("content-a-number", [{"role": "user", "content": 5}]),
                           ("content-image", [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]),
                           ("content-part-no-text", [{"role": "user", "content": [{"type": "text"}]}])):
        add(f"chat-messages-{case_id}", chat, {**messages, "messages": value})
    for case_id, extra in (("n-17", {"n": 17}), ("best-of-3", {"best_of": 3}),
                           ("top-logprobs-21", {"logprobs": True, "top_logprobs": 21}),
                           ("echo", {"echo": True}), ("tools", {"tools": [{"type": "function"}]}),
                           ("response-format-yaml", {"response_format": {"type": "yaml"}}),
                           ("response-format-bad-schema", {"response_format": {"type": "json_schema", "json_schema": {
                               "name": "x", "schema": {"type": "bogus"}}}}),
                           ("two-constraints", {"response_format": {"type": "json_object"}, "guided_regex": "a"}),
                           ("logit-bias-outside-vocabulary", {"logit_bias": {str(2**40): 1}}),
                           ("stream-a-string", {"stream": "yes"}), ("stream-options-unstreamed", {"stream_options": {}})):
        add(f"chat-{case_id}", chat, {**messages, **extra})
    # sampling settings, on the OpenAI bodies
    for case_id, extra in (("max-tokens-1e12", {"max_tokens": 10**12}), ("max-tokens-negative", {"max_tokens": -1}),
                           ("max-tokens-zero", {"max_tokens": 0}), ("max-tokens-fraction", {"max_tokens": 1.5}),
                           ("max-tokens-a-string", {"max_tokens": "10"}), ("max-tokens-bool", {"max_tokens": True}),
                           ("max-tokens-past-context", {"max_tokens": 10**6}),
                           ("max-tokens-aliases-disagree", {"max_tokens": 4, "max_completion_tokens": 5}),
                           ("temperature-negative", {"temperature": -1}), ("temperature-a-string", {"temperature": "hot"}),
                           ("temperature-1e999", b""), ("top-p-zero", {"top_p": 0}), ("top-p-2", {"top_p": 2}),
                           ("top-k-negative", {"top_k": -5}), ("seed-negative", {"seed": -1}),
                           ("seed-2**64", {"seed": 2**64}), ("repetition-penalty-zero", {"repetition_penalty": 0}),
                           ("frequency-penalty-3", {"frequency_penalty": 3}), ("stop-empty", {"stop": ""}),
                           ("stop-17", {"stop": [str(i) for i in range(17)]}), ("stop-numbers", {"stop": [1]}),
                           ("stop-token-ids-a-string", {"stop_token_ids": "x"}), ("ignore-eos-a-string", {"ignore_eos": "yes"})):
        if extra == b"":
            add(f"completions-{case_id}", completions, orjson.dumps(prompt)[:-1] + b', "temperature": 1e999}')
            continue
        add(f"completions-{case_id}", completions, {**prompt, **extra})
        add(f"chat-{case_id}", chat, {**messages, **extra})
    # Triton's generate
    for name, path in (("generate", generate), ("generate-stream", stream)):
        for case_id, body in (("text-input-missing", {"parameters": {}}), ("text-input-a-number", {"text_input": 5}),
                              ("parameters-a-list", {"text_input": "x", "parameters": [1]}),
                              ("max-tokens-1e12", {"text_input": "x", "parameters": {"max_tokens": 10**12}}),
                              ("temperature-a-string", {"text_input": "x", "temperature": "hot"}),
                              ("prompt-too-long", {"text_input": "fox " * 20_000})):
            add(f"{name}-{case_id}", path, body)
    # OIP infer on a generation model
    for case_id, body in (("wrong-input-name", {"inputs": [{**text_input, "name": "TEXT"}]}),
                          ("two-prompts", {"inputs": [{**text_input, "shape": [2], "data": ["a", "b"]}]}),
                          ("fp32-input", {"inputs": [{**text_input, "datatype": "FP32", "data": [1.0]}]}),
                          ("unknown-output", {"inputs": [text_input], "outputs": [{"name": "LOGITS"}]}),
                          ("temperature-nan", {"inputs": [text_input], "parameters": {"temperature": "nan"}}),
                          ("top-p-inf", {"inputs": [text_input], "parameters": {"top_p": "inf"}}),
                          ("sampling-parameters-not-json", {"inputs": [text_input], "parameters": {"sampling_parameters": "{"}}),
                          ("max-tokens-1e12", {"inputs": [text_input], "parameters": {"max_tokens": 10**12}})):
        add(f"infer-{case_id}", infer, body)
    # wrong methods
    for path in (completions, chat, generate):
        cases.append(BadCase(f"get-{path.rsplit('/', 1)[-1]}", request_bytes("GET", path), status=405))
    return cases


def generation_bodies(model: str) -> Any:
    """(path, body) for the OpenAI routes and Triton's generate: hypothesis values in every field.
    ``max_tokens``, ``model`` and the prompt are always there (with any value), so that some bodies
    are valid, and a valid one asks for a short answer."""
    from hypothesis import strategies as st

    f = fuzz_strategies()
    small = st.one_of(st.integers(-3, 8), f.json_values)
    sampling = {"temperature": f.json_values, "top_p": f.json_values, "top_k": f.json_values, "seed": f.json_values,
                "stop": f.json_values, "repetition_penalty": f.json_values, "ignore_eos": f.json_values,
                "stream": st.one_of(st.booleans(), f.json_values), "n": f.json_values}
    role = st.one_of(st.sampled_from(["system", "developer", "user", "assistant", "tool", "wizard"]), f.json_values)
    message = st.one_of(st.fixed_dictionaries({"role": role, "content": st.one_of(st.text(max_size=20), f.json_values)}),
                        f.json_values)
    name = st.one_of(st.just(model), f.json_values)
    completion = st.fixed_dictionaries({"max_tokens": small, "model": name, "prompt": st.one_of(
        st.text(max_size=20), st.lists(st.integers(-2, 500), max_size=5), f.json_values)}, optional=sampling)
    chat = st.fixed_dictionaries({"max_tokens": small, "model": name,
                                  "messages": st.one_of(st.lists(message, max_size=3), f.json_values)}, optional=sampling)
    generate = st.fixed_dictionaries({"parameters": st.fixed_dictionaries({"max_tokens": small}, optional=sampling)},
                                     optional={"text_input": st.one_of(st.text(max_size=20), f.json_values)})
    return st.one_of(st.tuples(st.just("/v1/completions"), completion), st.tuples(st.just("/v1/chat/completions"), chat),
                     st.tuples(st.just(f"/v2/models/{model}/generate"), generate))


# --- hang-ups ---------------------------------------------------------------------------------------


# What a client that hangs up asks for: long answers, so that one nobody stopped would show.
HANG_UP_TOKENS = 1000
# Idle: no sequence running or waiting (and only the metrics request in flight).
IDLE_GAUGES = {"running": 'vllm:num_requests_running{{model_name="{}"}}',
               "waiting": 'vllm:num_requests_waiting{{model_name="{}"}}'}


async def hang_ups(server: KilnServer, answers: Answers, per_group: int, paragraph: str, question: str) -> ProbeResult:
    """Clients that hang up mid-body, mid-prefill (a long prompt, gone 20 ms after it is sent),
    mid-stream (after the first token) and before a whole answer (after 50 ms), each asking for up
    to 1,000 tokens. Afterwards nothing may run, wait or be in flight, at most half the tokens they
    asked for may have been generated, and the following streams must get their answers alone."""
    started = time.monotonic()
    model = server.name
    meta = await once(server.port, request_bytes("GET", f"/v2/models/{model}"))
    assert isinstance(meta, Reply)
    context = int(meta.json()["parameters"]["max_context"])

    async def request(protocol: str, prompt: str, stream: bool = True) -> tuple[bytes, int]:
        """The request asking for as many tokens as its prompt leaves room for (up to HANG_UP_TOKENS)."""
        probe = await once(server.port, request_raw(server.port, protocol, model, prompt, 1, stream=False))
        assert isinstance(probe, Reply) and probe.status == 200, probe
        ask = min(HANG_UP_TOKENS, context - probe.json()["usage"]["prompt_tokens"])
        return request_raw(server.port, protocol, model, prompt, ask, stream=stream), ask

    refused: list[bytes] = []  # status lines of the mid-stream requests answered without a stream

    async def vanish(raw: bytes, wait: float, first_token: bool = False) -> None:
        conn = await Conn(server.port).open()
        await conn.send(raw)
        if first_token:
            assert conn.reader is not None
            try:
                await asyncio.wait_for(conn.reader.readuntil(b"data: "), 60)
            except asyncio.IncompleteReadError as exc:  # answered whole (a 503 when the queue is full): no stream
                refused.append(exc.partial.split(b"\r\n", 1)[0])
        await asyncio.sleep(wait)
        conn.close()

    def answered(values: dict[str, float]) -> float:
        """Requests the generation routes have answered so far (a client gone counts when noticed)."""
        return sum(v for k, v in values.items() if k.startswith("kiln_requests_total")
                   and ('route="chat_completions"' in k or 'route="completions"' in k))

    until_answered = [0.0]  # the count the group before reaches once the server has seen every request of it

    async def group(raw: bytes, wait: float, first_token: bool = False, counted: bool = True) -> None:
        """``per_group`` clients at once, on an idle server: the server reads a vanished client's request
        when it gets to it, so the group before must be answered (counted) and freed first. The wait
        after the last group is the one measured below. ``counted``: the server answers these requests
        (a body never finished is not one)."""
        deadline = time.monotonic() + 20.0
        while answered(await metrics(server.port)) < until_answered[0] and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await wait_idle(server.port, model, 20.0, tuple(IDLE_GAUGES.values()))
        until_answered[0] = answered(await metrics(server.port)) + (per_group if counted else 0)
        await asyncio.gather(*(vanish(raw, wait, first_token) for _ in range(per_group)))

    mid_body = request_bytes("POST", "/v1/chat/completions", b"", {"Content-Length": "5000"}) + b'{"model": "'
    prefill, prefill_ask = await request("openai-chat", squad_prompt(paragraph, question))
    streaming, stream_ask = await request("openai-completions", "Tell me a story.")
    whole, whole_ask = await request("openai-chat", "Tell me a story.", stream=False)
    asked = per_group * (prefill_ask + stream_ask + whole_ask)
    values_before = await metrics(server.port)
    await group(mid_body, 0.0, counted=False)
    await group(prefill, 0.02)
    await group(streaming, 0.0, first_token=True)
    await group(whole, 0.05)
    idle, idle_s, values = await wait_idle(server.port, model, 20.0, tuple(IDLE_GAUGES.values()))
    asked -= len(refused) * stream_ask  # a refused request asked for nothing it could be given
    gauges = {name: values.get(series.format(model)) for name, series in IDLE_GAUGES.items()}
    gauges["in_flight"] = values.get("kiln_requests_in_flight")
    kv = values.get(f'vllm:kv_cache_usage_perc{{model_name="{model}"}}', 0.0)
    tokens = f'vllm:generation_tokens_total{{model_name="{model}"}}'
    generated = values.get(tokens, 0) - values_before.get(tokens, 0)
    tally = StreamTally()
    await run_streams(answers, 4, tally, lambda: tally.requests >= 50)
    groups = f"{per_group} mid-body, {per_group} mid-prefill, {per_group} mid-stream, {per_group} before a whole answer"
    state = ", ".join(f"{name} {value:g}" for name, value in gauges.items())
    outcome = (f"{4 * per_group} clients hung up ({groups}): {'idle' if idle else 'NOT idle'} {idle_s:.2f} s later "
               f"({state}: the metrics request; KV cache {kv:.1%}: cached prefixes); {generated:,.0f} tokens generated "
               f"of the {asked:,} they asked for; {len(refused)} mid-stream requests answered without a stream "
               f"({', '.join(sorted(set(r.decode(errors='replace') for r in refused))) or 'none'}); then {tally.outcome()}")
    return ProbeResult("disconnects", 4 * per_group + tally.requests, outcome,
                       "nothing running, waiting or in flight once they are gone; at most half the tokens they asked "
                       "for generated (their sequences freed); later streams unaffected",
                       idle and generated <= asked / 2 and tally.passed(), time.monotonic() - started,
                       {"idle": idle, "idle_after_s": round(idle_s, 2), **gauges, "kv_cache_usage": kv,
                        "tokens_generated": generated, "tokens_asked": asked, "refused_mid_stream": len(refused),
                        "after": tally.as_dict()})
