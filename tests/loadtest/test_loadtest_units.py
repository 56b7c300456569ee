"""kiln loadtest pieces without a server: load levels, text selection, request bodies (decoded by
kiln serve's own codec), Triton metadata layouts, Prometheus diffs, result files."""

from __future__ import annotations

import json

import numpy as np
import pytest

from modelkiln.errors import KilnError
from modelkiln.loadtest import inputs, server_metrics
from modelkiln.loadtest.client import parse_url, render_request
from modelkiln.loadtest.protocols import InputLayout, make_protocol
from modelkiln.loadtest.runner import Latency, parse_levels
from modelkiln.samples import SAMPLE_QA, SAMPLE_TEXTS


def test_parse_levels():
    assert parse_levels("1:64:x2", "--c") == [1, 2, 4, 8, 16, 32, 64]
    assert parse_levels("10:100:+30", "--r") == [10, 40, 70, 100]
    assert parse_levels("4", "--c") == [4]
    assert parse_levels("1,3,9", "--c") == [1, 3, 9]
    for bad in ("0", "8:2:x2", "1:8:x1", "a,b", ""):
        with pytest.raises(KilnError):
            parse_levels(bad, "--c")


def test_text_sources_and_length_selection():
    items = inputs.load_items(None)
    assert items == list(SAMPLE_TEXTS)
    short, long = inputs.select(items, "short"), inputs.select(items, "long")
    assert max(map(len, short)) <= min(map(len, long)) and set(short) | set(long) == set(items)
    assert inputs.load_items("samples", question_answering=True) == list(SAMPLE_QA)
    sts = inputs.load_items("sts")
    assert len(sts) > 1000 and all(isinstance(s, str) for s in sts)
    squad = inputs.load_items("squad")
    assert sum(map(len, squad)) / len(squad) > sum(map(len, sts)) / len(sts) * 5  # paragraphs vs sentences
    qa = inputs.load_items("squad", question_answering=True)
    assert all(isinstance(q, tuple) and len(q) == 2 for q in qa)
    three = inputs.select(items, "all", limit=3)
    assert len(three) == 3 and set(three) <= set(items)
    assert inputs.select(items, "all", limit=3) == three  # seeded: the same sequence every run
    everything = inputs.select(sts, "all")
    assert sorted(everything) == sorted(sts) and everything != sts  # shuffled, nothing lost
    assert inputs.select(sts, "all", seed=1) != everything
    assert inputs.batches(["a", "b", "c"], 2, 3) == [["a", "b"], ["c", "a"], ["b", "c"]]
    with pytest.raises(KilnError, match="--inputs"):
        inputs.load_items("/no/such/file.txt")
    with pytest.raises(KilnError, match="--length"):
        inputs.select(items, "medium")


def test_text_file_source(tmp_path):
    f = tmp_path / "texts.txt"
    f.write_text("one line\nquestion?\tcontext here\n\n", encoding="utf-8")
    assert inputs.load_items(str(f)) == ["one line", ("question?", "context here")]


@pytest.mark.parametrize("name", ["oip-json", "oip-binary"])
def test_oip_bodies_decode_with_kiln_serve_codec(name):
    from modelkiln.serve import codec

    texts = list(SAMPLE_TEXTS[:3])
    req = make_protocol(name, "m", InputLayout()).build(texts)
    assert req.path == "/v2/models/m/infer" and req.inputs == 3
    headers = dict(req.headers)
    decoded = codec.decode_request(req.body, headers.get("Inference-Header-Content-Length"))
    assert [v.decode() for v in decoded.inputs["TEXT"]] == texts
    assert codec.binary_default(decoded) == (name == "oip-binary")
    qa = make_protocol(name, "qa", InputLayout.from_metadata(
        {"inputs": [{"name": "QUESTION", "shape": [-1]}, {"name": "CONTEXT", "shape": [-1]}]})).build(list(SAMPLE_QA[:2]))
    d = codec.decode_request(qa.body, dict(qa.headers).get("Inference-Header-Content-Length"))
    assert [v.decode() for v in d.inputs["CONTEXT"]] == [c for _, c in SAMPLE_QA[:2]]


def test_triton_ensemble_layout_sends_n_by_1():
    meta = {"name": "ens", "inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [-1, 1]},
                                      {"name": "TEXT_PAIR", "datatype": "BYTES", "shape": [-1, 1]}]}
    layout = InputLayout.from_metadata(meta)
    assert layout.rank == 2 and layout.pair == "TEXT_PAIR"
    body = json.loads(make_protocol("oip-json", "ens", layout).build(["a", ("b", "c")]).body)
    assert [t["shape"] for t in body["inputs"]] == [[2, 1]]  # mixed batch: pairs joined into one text
    body = json.loads(make_protocol("oip-json", "ens", layout).build([("a", "b")]).body)
    assert [(t["name"], t["data"]) for t in body["inputs"]] == [("TEXT", ["a"]), ("TEXT_PAIR", ["b"])]
    with pytest.raises(KilnError, match="no BYTES input"):
        InputLayout.from_metadata({"name": "x", "inputs": [{"name": "input_ids", "shape": [-1, -1]}]})


def test_task_route_body():
    layout = InputLayout.from_metadata({"inputs": [{"name": "QUESTION"}, {"name": "CONTEXT"}]})
    req = make_protocol("task", "qa", layout).build([("q?", "ctx")])
    assert req.path == "/v2/models/qa/predict"
    assert json.loads(req.body) == {"inputs": [{"question": "q?", "context": "ctx"}]}
    with pytest.raises(KilnError, match="--protocol"):
        make_protocol("websocket", "m", layout)


def test_url_and_request_rendering():
    assert parse_url("localhost:8000") == ("localhost", 8000, "")
    assert parse_url("http://h:1/prefix/") == ("h", 1, "/prefix")
    with pytest.raises(KilnError):
        parse_url("https://h")
    raw = render_request("POST", "h", 1, "/p", b"xyz", [("Content-Type", "application/json")])
    assert raw.startswith(b"POST /p HTTP/1.1\r\n") and raw.endswith(b"\r\n\r\nxyz") and b"Content-Length: 3" in raw


def _triton_text(ens: tuple, onnx: tuple, tok: tuple) -> str:
    """(success, inferences, executions, queue µs, compute µs) per model → Triton metrics text."""
    lines = [f"# TYPE {n} counter" for n in ("nv_inference_request_success", "nv_inference_count",
                                                "nv_inference_exec_count", "nv_inference_queue_duration_us",
                                                "nv_inference_compute_infer_duration_us", "nv_inference_request_failure")]
    for model, (ok, count, execs, queue, compute) in (("ens", ens), ("onnx", onnx), ("tok", tok)):
        labels = f'model="{model}",version="1"'
        lines += [f"nv_inference_request_success{{{labels}}} {ok}", f"nv_inference_count{{{labels}}} {count}",
                  f"nv_inference_exec_count{{{labels}}} {execs}", f"nv_inference_queue_duration_us{{{labels}}} {queue}",
                  f"nv_inference_compute_infer_duration_us{{{labels}}} {compute}",
                  f'nv_inference_request_failure{{model="{model}",reason="BACKEND",version="1"}} 0']
    return "\n".join(lines) + "\n"


def test_triton_metrics_diff():
    before = _triton_text((10, 10, 10, 1000, 5000), (10, 10, 5, 800, 4000), (10, 10, 10, 100, 500))
    after = _triton_text((110, 110, 110, 51000, 105000), (110, 110, 30, 40800, 94000), (110, 110, 110, 1100, 10500))
    b = server_metrics.breakdown(server_metrics.parse(before), server_metrics.parse(after), "ens", None)
    assert b is not None and b.kind == "triton" and b.success == 100 and b.failed == 0
    assert b.queue_ms == pytest.approx(0.41)  # the steps' queueing: (40 ms + 1 ms) over 100 requests
    assert b.compute_ms == pytest.approx(1.0)
    assert b.batch_size == pytest.approx(4.0)  # onnx (longest compute): 100 inferences in 25 executions
    assert set(b.models) == {"ens", "onnx", "tok"}
    assert server_metrics.breakdown({}, server_metrics.parse("other_metric 1\n"), "m", None) is None


def test_latency_summary():
    lat = Latency.of(np.arange(1, 101) / 1000.0)
    assert lat is not None and lat.max == pytest.approx(100) and lat.p50 == pytest.approx(50.5)
    assert lat.p99 > lat.p95 > lat.p90 > lat.p50
    assert Latency.of(np.array([])) is None
