"""Probes about bad clients: bad input (a table of hand-made requests, the test suite's error
table, and a hypothesis fuzzer of the three request schemas), disconnects, security defaults."""

from __future__ import annotations

import asyncio
import gzip
import http.client
import json
import re
import struct
import sys
import time
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import orjson

from .harness import (AUTH, ERROR_BODIES, LEAK_PATTERNS, PICKLE_MARK, Conn, KilnServer, ProbeResult, Reply, metrics,
                      once, request_bytes, wait_idle)
from .load import GoodClients, Tally, Workload, good_outcome, good_passed, run_clients

REPO = Path(__file__).resolve().parents[3]
# A stalled client must be answered (408) or dropped within this long: the server's default
# --body-read-timeout is 10 s.
STALL_LIMIT_S = 30.0
TESTS = REPO / "tests"


@dataclass(frozen=True)
class BadCase:
    id: str
    raw: bytes  # everything the client sends; for a stall, the part it sends before going silent
    json_error: bool = True  # False: refused below the ASGI app (HTTP framing), a JSON body is not ours to give
    status: int | None = None  # one exact status (else any 4xx)
    stall: bool = False
    close_ok: bool = False  # closing the connection without an answer is fine (no request to answer yet)


def _post(path: str, body: bytes, **headers: str) -> bytes:
    return request_bytes("POST", path, body, headers or None)


def _binary_infer(model: str, name: str, header: dict, binary: bytes, header_length: str | None = None) -> bytes:
    head = orjson.dumps(header)
    length = header_length if header_length is not None else str(len(head))
    return _post(f"/v2/models/{model}/infer", head + binary, **{"Inference-Header-Content-Length": length,
                                                                 "Content-Type": "application/octet-stream"})


def _bomb(wbits: int, megabytes: int = 100) -> bytes:
    """``megabytes`` MiB of zeros compressed (gzip: wbits 31, deflate: 15): a few hundred KB."""
    c = zlib.compressobj(9, zlib.DEFLATED, wbits)
    zeros = bytes(1 << 20)
    return b"".join([*(c.compress(zeros) for _ in range(megabytes)), c.flush()])


def handmade_cases(model: str, input_name: str, max_body: int) -> list[BadCase]:
    infer, predict = f"/v2/models/{model}/infer", f"/v2/models/{model}/predict"
    good = orjson.dumps({"inputs": [{"name": input_name, "datatype": "BYTES", "shape": [2], "data": ["a b", "c d"]}]})
    tensor = {"name": input_name, "datatype": "BYTES", "shape": [1]}
    element = b"hello"
    prefixed = struct.pack("<I", len(element)) + element
    gz = _bomb(31)
    cases = [
        # truncated and malformed JSON
        *(BadCase(f"truncated-json-{n}of4", _post(infer, good[: len(good) * n // 4])) for n in (1, 2, 3)),
        BadCase("truncated-json-last-byte", _post(infer, good[:-1])),
        BadCase("empty-body-infer", _post(infer, b"")),
        BadCase("empty-body-predict", _post(predict, b"")),
        BadCase("empty-body-embeddings", _post("/v1/embeddings", b"")),
        BadCase("json-top-level-list", _post(infer, b"[]")),
        BadCase("json-top-level-null", _post(predict, b"null")),
        BadCase("json-huge-exponent", _post(predict, b'{"inputs": 1e999999}')),
        BadCase("json-nan", _post(infer, b'{"inputs": NaN}')),
        BadCase("json-trailing-garbage", _post(infer, good + b"}}}")),
        # wrong types and shapes
        BadCase("inputs-a-string", _post(infer, b'{"inputs": "text"}')),
        BadCase("inputs-an-object", _post(infer, b'{"inputs": {"name": "TEXT"}}')),
        BadCase("data-an-object", _post(infer, orjson.dumps({"inputs": [{**tensor, "data": {"a": 1}}]}))),
        BadCase("shape-a-string", _post(infer, orjson.dumps({"inputs": [{**tensor, "shape": "1", "data": ["x"]}]}))),
        BadCase("shape-negative", _post(infer, orjson.dumps({"inputs": [{**tensor, "shape": [-1], "data": ["x"]}]}))),
        BadCase("shape-2**70", _post(infer, ('{"inputs": [{"name": "%s", "datatype": "BYTES", "shape": [%d], '
                                            '"data": ["x"]}]}' % (input_name, 2**70)).encode())),
        BadCase("datatype-unknown", _post(infer, orjson.dumps({"inputs": [{**tensor, "datatype": "FP128", "data": [1]}]}))),
        BadCase("name-a-number", _post(infer, orjson.dumps({"inputs": [{**tensor, "name": 7, "data": ["x"]}]}))),
        BadCase("fp32-text-tensor", _post(infer, orjson.dumps({"inputs": [{**tensor, "datatype": "FP32", "data": [1.5]}]}))),
        BadCase("predict-inputs-numbers", _post(predict, b'{"inputs": [1, 2, 3]}')),
        BadCase("predict-inputs-null", _post(predict, b'{"inputs": null}')),
        BadCase("embeddings-input-object", _post("/v1/embeddings", orjson.dumps({"model": model, "input": {"a": 1}}))),
        BadCase("embeddings-dimensions-negative", _post("/v1/embeddings", orjson.dumps({"model": model, "input": "x",
                                                                                        "dimensions": -3}))),
        # invalid UTF-8
        BadCase("invalid-utf8-json", _post(predict, b'{"inputs": "caf\xc3\x28 \xff\xfe"}')),
        BadCase("invalid-utf8-infer", _post(infer, b'{"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1], '
                                                   b'"data": ["\xed\xa0\x80"]}]}')),
        BadCase("invalid-utf8-binary-bytes", _binary_infer(model, input_name, {"inputs": [
            {**tensor, "parameters": {"binary_data_size": 8}}]}, struct.pack("<I", 4) + b"\xff\xfe\xc3\x28")),
        # lying binary-tensor headers and BYTES length prefixes
        BadCase("header-length-past-body", _binary_infer(model, input_name, {"inputs": [
            {**tensor, "parameters": {"binary_data_size": len(prefixed)}}]}, prefixed, header_length="100000")),
        BadCase("header-length-zero", _binary_infer(model, input_name, {"inputs": [tensor]}, b"", header_length="0")),
        BadCase("header-length-negative", _binary_infer(model, input_name, {"inputs": [tensor]}, b"", header_length="-5")),
        BadCase("header-length-not-a-number", _binary_infer(model, input_name, {"inputs": [tensor]}, b"",
                                                            header_length="ten")),
        BadCase("header-length-mid-json", _binary_infer(model, input_name, {"inputs": [
            {**tensor, "parameters": {"binary_data_size": len(prefixed)}}]}, prefixed, header_length="20")),
        BadCase("bytes-prefix-past-data", _binary_infer(model, input_name, {"inputs": [
            {**tensor, "parameters": {"binary_data_size": 9}}]}, struct.pack("<I", 1000) + element)),
        BadCase("bytes-prefix-2**32-1", _binary_infer(model, input_name, {"inputs": [
            {**tensor, "parameters": {"binary_data_size": 9}}]}, struct.pack("<I", 2**32 - 1) + element)),
        BadCase("bytes-prefix-truncated", _binary_infer(model, input_name, {"inputs": [
            {**tensor, "parameters": {"binary_data_size": 2}}]}, b"\x05\x00")),
        BadCase("binary-size-past-body", _binary_infer(model, input_name, {"inputs": [
            {**tensor, "parameters": {"binary_data_size": 10_000}}]}, prefixed)),
        BadCase("binary-bytes-unclaimed", _binary_infer(model, input_name, {"inputs": [
            {**tensor, "parameters": {"binary_data_size": len(prefixed)}}]}, prefixed + b"extra")),
        BadCase("binary-shape-needs-more-elements", _binary_infer(model, input_name, {"inputs": [
            {**tensor, "shape": [3], "parameters": {"binary_data_size": len(prefixed)}}]}, prefixed)),
        # nesting
        BadCase("nested-lists-100k", _post(predict, b'{"inputs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")),
        BadCase("nested-objects-100k", _post(predict, b'{"inputs": ' + b'{"a":' * 100_000 + b"1" + b"}" * 100_001)),
        BadCase("nested-data-100k", _post(infer, b'{"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1], '
                                                 b'"data": ' + b"[" * 100_000 + b'"x"' + b"]" * 100_000 + b"}]}")),
        # oversized
        BadCase("content-length-1GiB-announced", request_bytes("POST", infer, b"", {"Content-Length": str(1 << 30)}),
                status=413),
        BadCase("body-over-limit-chunked", request_bytes("POST", predict, b"", {"Transfer-Encoding": "chunked"})
                + b"".join(b"%x\r\n" % (1 << 20) + b"x" * (1 << 20) + b"\r\n" for _ in range(max_body // (1 << 20) + 1))
                + b"0\r\n\r\n", status=413),
        BadCase("text-200k-chars", _post(predict, orjson.dumps({"inputs": "word " * 40_000}))),
        BadCase("inputs-300", _post(predict, orjson.dumps({"inputs": ["x"] * 300}))),
        # compressed bodies
        BadCase("gzip-bomb-100MiB", _post(predict, gz, **{"Content-Encoding": "gzip"}), status=413),
        BadCase("deflate-bomb-100MiB", _post(predict, _bomb(15), **{"Content-Encoding": "deflate"}), status=413),
        BadCase("gzip-garbage", _post(predict, b"\x1f\x8b\x08\x00garbage", **{"Content-Encoding": "gzip"})),
        BadCase("gzip-truncated", _post(predict, gzip.compress(b'{"inputs": "x"}')[:12], **{"Content-Encoding": "gzip"})),
        BadCase("encoding-unknown", _post(predict, b'{"inputs": "x"}', **{"Content-Encoding": "br"})),
        # slow clients: announce a body, send part of it, go silent
        BadCase("stalled-body", request_bytes("POST", infer, b"", {"Content-Length": "5000"}) + b'{"inputs": ', stall=True,
                status=408),
        BadCase("stalled-body-after-1-byte", request_bytes("POST", predict, b"", {"Content-Length": "100"}) + b"{",
                stall=True, status=408),
        BadCase("stalled-headers", b"POST " + infer.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Le", stall=True,
                json_error=False, close_ok=True),
        BadCase("silent-connection", b"", stall=True, json_error=False, close_ok=True),
        # routes, methods, auth
        BadCase("unknown-route", request_bytes("GET", "/nope"), status=404),
        BadCase("unknown-model-route", request_bytes("POST", f"/v2/models/{model}/explode", b"{}"), status=404),
        BadCase("unknown-model", request_bytes("GET", "/v2/models/nope"), status=404),
        BadCase("path-traversal", request_bytes("GET", "/v2/models/../../../../etc/passwd"), status=404),
        BadCase("long-path-8KiB", request_bytes("GET", "/v2/models/" + "a" * 8192), status=404),
        *(BadCase(f"{m}-infer", request_bytes(m, infer, b"{}"), status=405) for m in ("GET", "PUT", "DELETE", "PATCH")),
        BadCase("put-server-metadata", request_bytes("PUT", "/v2", b"{}"), status=405),
        BadCase("post-health", request_bytes("POST", "/v2/health/live", b""), status=405),
        BadCase("no-api-key", _post(predict, b'{"inputs": "x"}', Authorization=""), status=401),
        BadCase("wrong-api-key", _post(predict, b'{"inputs": "x"}', Authorization="Bearer nope"), status=401),
        # HTTP framing, refused by the HTTP parser before our code (its own plain-text 400)
        BadCase("garbage-request-line", b"HELLO THERE\r\n\r\n", json_error=False),
        BadCase("bad-content-length", _post(predict, b"{}", **{"Content-Length": "abc"}), json_error=False),
    ]
    return cases


def error_table_cases(model: str) -> list[BadCase]:
    """tests/error_cases.py, the one list of bad requests the test suite checks kind by kind:
    here only "4xx with a JSON error". Its model ``emb`` is the model under test; its other models
    (cls, ner, qa) are unknown here, answered 404. Deadline cases (503 by design) are left out."""
    from error_cases import CASES  # tests/ is on the path (fault_suite.py, as pytest's pythonpath)

    from modelkiln.errors import ErrorKind

    out = []
    for case in CASES:
        if case.kind in (ErrorKind.TIMED_OUT, ErrorKind.OVERLOADED, ErrorKind.NOT_READY):
            continue
        if "too-many-inputs" in case.id:  # over the table server's 64, within the default 256 ("inputs-300" here)
            continue
        path = case.path.replace("/models/emb/", f"/models/{model}/")
        body = case.content().replace(b'"model": "emb"', orjson.dumps(model).join([b'"model": ', b""]))
        out.append(BadCase(f"table:{case.id}", _post(path, body)))
    return out


def judge(case: BadCase, reply: Reply | str) -> str:
    """"ok", or what went wrong."""
    if isinstance(reply, str):
        if reply == "closed" and case.close_ok:
            return "ok"
        return {"timeout": "hang", "closed": "closed without an answer", "refused": "refused"}[reply]
    if reply.status >= 500:
        return f"{reply.status}"
    if not 400 <= reply.status < 500:
        return f"accepted ({reply.status})"
    if case.status is not None and reply.status != case.status:
        return f"{reply.status} instead of {case.status}"
    if case.json_error:
        try:
            error = reply.json()["error"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return f"{reply.status} without a JSON error"
        if not error:
            return "empty error"
    return "ok"


def fuzz_strategies() -> Any:
    """The test suite's hypothesis strategies (tests/serve/test_codec_fuzz.py): a module with
    ``json_values``, ``parameters`` and OIP ``requests``."""
    sys.path.insert(0, str(TESTS / "serve"))  # a test module, imported by its name as pytest imports it
    import test_codec_fuzz

    return test_codec_fuzz


def encoder_bodies(model: str) -> Any:
    """(path, body) for /infer (the test suite's OIP strategies), /predict and /v1/embeddings."""
    from hypothesis import strategies as st

    f = fuzz_strategies()
    texts = st.one_of(st.text(max_size=12), f.json_values)
    predict_bodies = st.fixed_dictionaries({}, optional={
        "inputs": st.one_of(f.json_values, st.lists(texts, max_size=5), st.text(max_size=20),
                            st.lists(st.fixed_dictionaries({"text": texts}, optional={"text_pair": texts}), max_size=3)),
        "parameters": f.parameters})
    embedding_bodies = st.fixed_dictionaries({}, optional={
        "model": st.one_of(st.just(model), f.json_values),
        "input": st.one_of(st.lists(st.text(max_size=12), max_size=4), f.json_values),
        "encoding_format": st.one_of(st.sampled_from(["float", "base64"]), f.json_values),
        "dimensions": st.one_of(st.integers(-3, 5000), f.json_values)})
    return st.one_of(st.tuples(st.just(f"/v2/models/{model}/infer"), f.requests),
                     st.tuples(st.just(f"/v2/models/{model}/predict"), predict_bodies),
                     st.tuples(st.just("/v1/embeddings"), embedding_bodies))


def fuzz(port: int, bodies: Any, examples: int, seed: int = 0) -> tuple[int, Counter, list[str]]:
    """Hypothesis-generated ``bodies`` (a strategy of (path, JSON body)), sent over one keep-alive
    connection: (sent, statuses, failures)."""
    from hypothesis import HealthCheck, Phase, given, settings, seed as hseed

    statuses: Counter = Counter()
    failures: list[str] = []
    sent = [0]
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

    @hseed(seed)
    @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(bodies)
    def send(case: tuple[str, Any]) -> None:
        path, body = case
        sent[0] += 1
        content = json.dumps(body).encode()  # the standard library writes integers of any size
        try:
            conn.request("POST", path, content, {"Authorization": AUTH, "Content-Type": "application/json"})
            response = conn.getresponse()
            data = response.read()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            failures.append(f"{path} {content[:200]!r}: {type(exc).__name__}")
            return
        statuses[response.status] += 1
        if response.status >= 400:
            ERROR_BODIES.append(data)
        if response.status >= 500:
            failures.append(f"{path} {content[:200]!r}: {response.status} {data[:200]!r}")
        elif response.status >= 400:
            try:
                ok = bool(orjson.loads(data)["error"])
            except (orjson.JSONDecodeError, KeyError, TypeError):
                ok = False
            if not ok:
                failures.append(f"{path} {content[:200]!r}: {response.status} without a JSON error")

    send()
    conn.close()
    return sent[0], statuses, failures


class Alongside(Protocol):
    """Well-formed clients that run next to an attack, their answers checked (``load.GoodClients``,
    ``generation_load.GoodStreams``)."""

    async def run(self, until: Callable[[], bool]) -> None: ...
    def outcome(self) -> str: ...
    def passed(self) -> bool: ...
    def as_dict(self) -> dict[str, Any]: ...
    @property
    def requests(self) -> int: ...


async def bad_input(server: KilnServer, work: Workload, repeats: int, fuzz_examples: int, good_clients: int,
                    max_body: int) -> ProbeResult:
    """Every hand-made case and every case of the test suite's error table ``repeats`` times, and
    the fuzzer, while ``good_clients`` well-formed clients run alongside (same batches)."""
    cases = handmade_cases(server.name, work.input_name, max_body) + error_table_cases(server.name)
    return await attack(server, cases, encoder_bodies(server.name), repeats, fuzz_examples,
                        GoodClients(server.port, work, good_clients))


async def attack(server: KilnServer, cases: list[BadCase], bodies: Any, repeats: int, fuzz_examples: int,
                 alongside: Alongside) -> ProbeResult:
    """The bad-input probe: ``cases`` ``repeats`` times and ``fuzz_examples`` fuzzed ``bodies``,
    while ``alongside`` runs."""
    started = time.monotonic()
    results: dict[str, Counter] = {c.id: Counter() for c in cases}
    done = asyncio.Event()
    good = asyncio.create_task(alongside.run(done.is_set))
    limit = asyncio.Semaphore(8)

    async def run(case: BadCase) -> None:
        async with limit if not case.stall else _nothing():
            results[case.id][judge(case, await once(server.port, case.raw, timeout=STALL_LIMIT_S))] += 1

    fuzz_task = asyncio.to_thread(fuzz, server.port, bodies, fuzz_examples)
    outcome_fuzz, _ = await asyncio.gather(fuzz_task, asyncio.gather(*(run(c) for c in cases for _ in range(repeats))))
    done.set()
    await good
    fuzz_sent, fuzz_statuses, fuzz_failures = outcome_fuzz
    bad = {cid: dict(r) for cid, r in results.items() if set(r) != {"ok"}}
    alive = server.alive()
    health = await once(server.port, request_bytes("GET", "/v2/health/ready", auth=None), 10)
    healthy = isinstance(health, Reply) and health.status == 200
    sent = len(cases) * repeats
    passed = not bad and not fuzz_failures and alive and healthy and alongside.passed()
    outcome = (f"{sent:,} bad requests ({len(cases)} kinds x {repeats}): {sent - sum(sum(r.values()) for r in bad.values())}"
               f" answered 4xx as expected, {len(bad)} kinds not; fuzzer: {fuzz_sent:,} bodies, "
               f"{len(fuzz_failures)} 5xx or non-JSON errors ({_statuses(fuzz_statuses)}); server "
               f"{'alive' if alive and healthy else 'DOWN'}; alongside: {alongside.outcome()}")
    return ProbeResult("bad input", sent + fuzz_sent + alongside.requests, outcome,
                       "every bad request 4xx with a JSON error (HTTP-framing errors: any 4xx), no 5xx, hang or "
                       "crash; well-formed requests alongside all equal to their answers alone",
                       passed, time.monotonic() - started,
                       {"kinds": len(cases), "repeats": repeats, "failed_kinds": bad,
                        "fuzz": {"sent": fuzz_sent, "statuses": dict(fuzz_statuses), "failures": fuzz_failures[:20]},
                        "alongside": alongside.as_dict()})


class _nothing:
    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        return None


def _statuses(c: Counter) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(c.items()))


# --- disconnects ------------------------------------------------------------------------------------


async def disconnects(server: KilnServer, work: Workload, per_group: int) -> ProbeResult:
    """Clients that vanish before their body is in, while their work is queued, and after it ran
    but before they read the answer. Afterwards nothing may be queued or in flight, and good
    requests must still get their own answers."""
    started = time.monotonic()
    model = server.name
    stats_path = f"/v2/models/{model}/stats"

    async def computed() -> int:
        reply = await once(server.port, request_bytes("GET", stats_path))
        assert isinstance(reply, Reply)
        return int(reply.json()["model_stats"][0]["inference_count"])

    count_before = await computed()
    metrics_before = await metrics(server.port)

    async def vanish(raw: bytes, wait: float) -> None:
        conn = await Conn(server.port).open()
        await conn.send(raw)
        await asyncio.sleep(wait)
        conn.close()

    long = [work.refs.texts[i] for i in (work.long or work.short)]
    predict = f"/v2/models/{model}/predict"
    before = request_bytes("POST", predict, b"", {"Content-Length": "5000"}) + b'{"inputs": ["a'
    queued = [request_bytes("POST", predict, orjson.dumps({"inputs": long[(4 * i) % len(long):][:4] or long[:4]}))
              for i in range(per_group)]
    after = request_bytes("POST", predict, orjson.dumps({"inputs": [work.refs.texts[work.short[0]]]}))
    await asyncio.gather(*(vanish(before, 0.0) for _ in range(per_group)))
    await asyncio.gather(*(vanish(raw, 0.0) for raw in queued))
    await asyncio.gather(*(vanish(after, 1.0) for _ in range(per_group)))
    idle, idle_s, values = await wait_idle(server.port, model, 20.0)
    abandoned_inputs = sum(len(orjson.loads(r.split(b"\r\n\r\n", 1)[1])["inputs"]) for r in queued)
    computed_inputs = await computed() - count_before - per_group  # the "after" group's inputs do run
    gone = sum(v - metrics_before.get(k, 0) for k, v in values.items()
               if k.startswith("kiln_requests_total") and 'status="499"' in k)
    queue_series = f'kiln_queue_inputs{{model="{model}"}}'
    tally = Tally()
    await run_clients(server.port, work, 4, tally, lambda: tally.requests >= 100)
    # The goal is the issue's: nothing leaked in flight or queued, later requests unaffected. How many
    # abandoned inputs were computed is reported, not judged: on a fast engine (a tiny model, a quiet
    # machine) they are batched and done before the watch's 0.1 s tick sees the socket close, so the
    # count says more about the machine than the server. Dropping queued work of departed clients is
    # asserted by tests/serve/test_serve.py::test_work_of_clients_that_left_is_not_computed, on a backlog
    # built for it (0 of 1,920 computed).
    passed = idle and good_passed(tally)
    outcome = (f"{3 * per_group} clients vanished ({per_group} mid-body, {per_group} queued, {per_group} before "
               f"reading): {'idle' if idle else 'NOT idle'} {idle_s:.2f} s later (in flight "
               f"{values.get('kiln_requests_in_flight'):g} = the metrics request, queue "
               f"{values.get(queue_series, 0):g}); {gone:g} counted 499; "
               f"{max(computed_inputs, 0)} of {abandoned_inputs} abandoned queued inputs computed; then {good_outcome(tally)}")
    return ProbeResult("disconnects", 3 * per_group + tally.requests, outcome,
                       "gauges back to zero (nothing in flight or queued); abandoned queued inputs computed: reported; "
                       "computed; later requests unaffected",
                       passed, time.monotonic() - started,
                       {"idle": idle, "idle_after_s": round(idle_s, 2), "in_flight": values.get("kiln_requests_in_flight"),
                        "answered_499": gone, "abandoned_inputs": abandoned_inputs,
                        "abandoned_inputs_computed": max(computed_inputs, 0), "after": tally.as_dict()})


# --- security defaults ---------------------------------------------------------------------------------


def listening_addresses(port: int) -> list[str]:
    """The local addresses listening on ``port`` (Linux /proc/net/tcp and tcp6), each once (the
    workers of ``kiln serve --workers N`` each listen on the same address)."""
    found = []
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            address, hexport = fields[1].split(":")
            if fields[3] != "0A" or int(hexport, 16) != port:  # 0A: LISTEN
                continue
            if v6:
                found.append(":".join(address[i:i + 4] for i in range(0, 32, 4)))
            else:
                found.append(".".join(str(int(address[i:i + 2], 16)) for i in (6, 4, 2, 0)))
    return sorted(set(found))


STATIC_PATHS = ("serve", "runtime", "tasks", "generation", "manifest.py")  # what loads and serves an artifact
PICKLE_CODE = re.compile(r"\bimport pickle\b|\bpickle\.|torch\.load|allow_pickle\s*=\s*True|\bjoblib\b|\bdill\b|cloudpickle")


def static_findings() -> tuple[list[str], list[str]]:
    """(pickle use in the serving/loading code, every trust_remote_code line in src/)."""
    src = REPO / "src" / "modelkiln"
    pickles, remote = [], []
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src)
        text = path.read_text()
        for n, line in enumerate(text.splitlines(), 1):
            if str(rel).startswith(STATIC_PATHS) and PICKLE_CODE.search(line):
                pickles.append(f"{rel}:{n}: {line.strip()}")
            if "trust_remote_code" in line:
                remote.append(f"{rel}:{n}: {line.strip()}")
    return pickles, remote


async def security(server: KilnServer, routes: tuple[tuple[str, str], ...] = ()) -> ProbeResult:
    """The security defaults; ``routes``: (method, path) the served model adds to the guarded ones."""
    started = time.monotonic()
    model = server.name
    problems: list[str] = []
    addresses = listening_addresses(server.port)
    if not addresses or any(a != "127.0.0.1" for a in addresses):
        problems.append(f"listens on {addresses}")
    guarded = [("GET", "/v2"), ("GET", f"/v2/models/{model}"), ("GET", f"/v2/models/{model}/versions/1"),
               ("GET", f"/v2/models/{model}/ready"), ("GET", f"/v2/models/{model}/stats"), ("GET", "/v2/models/stats"),
               ("GET", "/metrics"), ("GET", "/v1/models"), ("POST", f"/v2/models/{model}/infer"),
               ("POST", f"/v2/models/{model}/predict"), ("POST", "/v1/embeddings"), ("POST", "/v2/repository/index"),
               ("POST", f"/v2/repository/models/{model}/load"), ("GET", "/nope"), *routes]
    checks = 0
    for method, path in guarded:
        for auth in (None, "Bearer wrong", f"Basic {AUTH.split()[1]}"):
            reply = await once(server.port, request_bytes(method, path, b"{}" if method == "POST" else b"", auth=auth))
            checks += 1
            if not isinstance(reply, Reply) or reply.status != 401 or "error" not in reply.json():
                problems.append(f"{method} {path} with {auth!r}: {getattr(reply, 'status', reply)}")
    for path in ("/v2/health/live", "/v2/health/ready"):
        reply = await once(server.port, request_bytes("GET", path, auth=None))
        checks += 1
        if not isinstance(reply, Reply) or reply.status != 200:
            problems.append(f"{path} without a key: {getattr(reply, 'status', reply)}")
    for auth in (AUTH, AUTH.replace("Bearer", "bearer")):
        reply = await once(server.port, request_bytes("GET", "/metrics", auth=auth))
        checks += 1
        if not isinstance(reply, Reply) or reply.status != 200:
            problems.append(f"/metrics with {auth.split()[0]} KEY: {getattr(reply, 'status', reply)}")
    leaks = [b[:200].decode(errors="replace") for b in ERROR_BODIES if LEAK_PATTERNS.search(b.decode(errors="replace"))]
    if leaks:
        problems.append(f"{len(leaks)} error bodies carry a trace or path, e.g. {leaks[0]!r}")
    log = server.log()
    tracebacks = log.count("Traceback")
    if tracebacks:
        problems.append(f"{tracebacks} tracebacks in the server log")
    unpickled = [line for line in log.splitlines() if line.startswith(PICKLE_MARK)]
    if unpickled:
        problems.append(f"unpickling while serving: {unpickled[:3]}")
    pickles, remote = static_findings()
    if pickles:
        problems.append(f"pickle in the loading path: {pickles[:3]}")
    enabled = [r for r in remote if re.search(r"trust_remote_code\s*=\s*True", r)]
    if enabled:
        problems.append(f"trust_remote_code enabled: {enabled}")
    outcome = (f"listens on {', '.join(addresses)}; {len(guarded)} routes x 3 bad credentials -> 401, health open, "
               f"bearer scheme case-insensitive; {len(ERROR_BODIES):,} error bodies, {len(leaks)} with a trace or path; "
               f"{tracebacks} tracebacks logged; {len(unpickled)} unpickling calls while loading and serving, "
               f"{len(pickles)} pickle uses in the loading code; trust_remote_code: "
               f"{'never passed (transformers default off)' if not remote else f'{len(remote)} places, {len(enabled)} on'}"
               + (f"; PROBLEMS: {problems}" if problems else ""))
    return ProbeResult("security", checks + len(ERROR_BODIES), outcome,
                       "binds 127.0.0.1; --api-key guards every route but health (metrics included); no trace or "
                       "path in any error body; no unpickling; trust_remote_code off",
                       not problems, time.monotonic() - started,
                       {"listening": addresses, "error_bodies": len(ERROR_BODIES), "leaks": leaks[:5],
                        "tracebacks_logged": tracebacks, "unpickling": unpickled[:5], "pickle_in_code": pickles,
                        "trust_remote_code_lines": remote, "problems": problems})
