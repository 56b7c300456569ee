"""KServe v2 gRPC on `kiln serve`: the unmodified tritonclient.grpc (sync and aio) against a real
server process, answers equal to HTTP's bit for bit, and the error table over gRPC.

This process talks to the server through tritonclient's own generated messages only: importing
modelkiln's generated modules here as well would register ``inference.*`` twice (see
``modelkiln.serve.grpc``). The regeneration check compares descriptors in a subprocess."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import tempfile

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcclient_aio
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from error_cases import CASES, ErrorCase
from modelkiln.errors import ErrorKind
from modelkiln.samples import SAMPLE_QA, SAMPLE_TEXTS
from modelkiln.tasks import tensors as protocol
from servers import TASKS, GrpcServer
from helpers import REPO

ROOT = REPO
# What each kind must be over gRPC, written here independently of the server's own table.
GRPC_CODE = {ErrorKind.INVALID_INPUT: grpc.StatusCode.INVALID_ARGUMENT, ErrorKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
             ErrorKind.TOO_LARGE: grpc.StatusCode.RESOURCE_EXHAUSTED,
             ErrorKind.OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,
             ErrorKind.TIMED_OUT: grpc.StatusCode.DEADLINE_EXCEEDED, ErrorKind.NOT_READY: grpc.StatusCode.UNAVAILABLE,
             ErrorKind.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED}
KEY = "s3cret"


@pytest.fixture(scope="module")
def server(zoo):
    srv = GrpcServer([f"{n}={zoo.artifact('bert', t)}" for n, t in TASKS.items()] +
                     ["--variant", "fp32", "--max-inputs-per-request", "64", "--max-body-bytes", "200000"])
    yield srv
    code, err = srv.stop()
    assert code == 0, err[-2000:]


def _samples(task: str) -> list:
    if task == "question-answering":
        return list(SAMPLE_QA[:3])
    if task == "text-classification":
        return list(zip(SAMPLE_TEXTS[:3], SAMPLE_TEXTS[3:6]))
    return list(SAMPLE_TEXTS[:4])


def _inputs(module, tensors: dict[str, np.ndarray]) -> list:
    out = []
    for name, array in tensors.items():
        item = module.InferInput(name, list(array.shape), "BYTES")
        item.set_data_from_numpy(array)
        out.append(item)
    return out


@pytest.mark.parametrize("model", list(TASKS))
def test_every_task_answers_over_grpc_as_over_http_bit_for_bit(server, model):
    tensors = protocol.tensors_from_inputs(TASKS[model], _samples(TASKS[model]))
    http = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    via_http = http.infer(model, _inputs(httpclient, tensors))
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        via_grpc = client.infer(model, _inputs(grpcclient, tensors))
        names = [o["name"] for o in client.get_model_metadata(model, as_json=True)["outputs"]]
    assert names
    for name in names:
        a, b = via_http.as_numpy(name), via_grpc.as_numpy(name)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert a.tobytes() == b.tobytes() if a.dtype != object else list(a.ravel()) == list(b.ravel()), name


def test_pre_tokenized_int64_inputs_in_typed_contents(server):
    """Typed ``contents`` (not raw bytes), as a client that builds messages itself sends them."""
    request = service_pb2.ModelInferRequest(model_name="emb")
    for name, rows in (("input_ids", [[2, 7, 9, 3]]), ("attention_mask", [[1, 1, 1, 1]])):
        tensor = request.inputs.add(name=name, datatype="INT64", shape=[1, 4])
        tensor.contents.int64_contents.extend(sum(rows, []))
    with grpc.insecure_channel(server.grpc_url) as channel:
        answer = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request)
    assert [o.name for o in answer.outputs] and len(answer.raw_output_contents) == len(answer.outputs)


def test_health_metadata_statistics_and_repository_index(server):
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("emb")
        meta = client.get_server_metadata(as_json=True)
        assert meta["name"] == "modelkiln" and "statistics" in meta["extensions"]
        model = client.get_model_metadata("qa", as_json=True)
        assert [i["name"] for i in model["inputs"]] == ["QUESTION", "CONTEXT"]
        client.infer("emb", _inputs(grpcclient, protocol.tensors_from_inputs(TASKS["emb"], ["a b c"])))
        stats = client.get_inference_statistics("emb", as_json=True)["model_stats"][0]
        assert int(stats["inference_count"]) >= 1 and int(stats["inference_stats"]["success"]["count"]) >= 1
        index = client.get_model_repository_index(as_json=True)["models"]
        assert {m["name"] for m in index} == set(TASKS) and {m["state"] for m in index} == {"READY"}
        with pytest.raises(InferenceServerException) as err:
            client.is_model_ready("nope")
        assert "NOT_FOUND" in str(err.value.status())


def test_aio_client_and_metrics_protocol_label(server):
    async def run() -> tuple[np.ndarray, bool]:
        client = grpcclient_aio.InferenceServerClient(server.grpc_url)
        try:
            ready = await client.is_server_ready()
            tensors = protocol.tensors_from_inputs(TASKS["emb"], SAMPLE_TEXTS[:2])
            answers = await asyncio.gather(*(client.infer("emb", _inputs(grpcclient_aio, tensors)) for _ in range(8)))
            return np.stack([a.as_numpy(protocol.EMBEDDINGS) for a in answers]), ready
        finally:
            await client.close()

    vectors, ready = asyncio.run(run())
    assert ready and all(np.array_equal(vectors[0], v) for v in vectors)
    import httpx

    metrics = httpx.get(server.url + "/metrics").text
    assert 'kiln_requests_total{model="emb",protocol="grpc",route="infer",status="OK"}' in metrics, [
        line for line in metrics.splitlines() if "grpc" in line]



def _metric_values(url: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of the server's /metrics as (name, its labels) → value, whatever the label order."""
    import re

    import httpx

    values = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        match = re.fullmatch(r"([\w:]+)(?:\{(.*)\})? (\S+)", line)
        if match and not line.startswith("#"):
            labels = frozenset(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
            values[(match.group(1), labels)] = float(match.group(3))
    return values


def test_request_metrics_count_every_grpc_call(server):
    """The servicer keeps its labelled metric children between calls: each call must still count
    once, under its own model and status, and every answered infer is timed."""
    ok = ("kiln_requests_total", frozenset({("model", "emb"), ("route", "infer"), ("status", "OK"), ("protocol", "grpc")}))
    missing = ("kiln_requests_total", frozenset({("model", "metrics-nope"), ("route", "infer"), ("status", "NOT_FOUND"),
                                                 ("protocol", "grpc")}))
    timed = ("kiln_request_duration_seconds_count", frozenset({("model", "emb"), ("route", "infer"), ("protocol", "grpc")}))
    before = _metric_values(server.url)
    inputs = _inputs(grpcclient, protocol.tensors_from_inputs(TASKS["emb"], ["a b c"]))
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        for _ in range(3):
            client.infer("emb", inputs)
        for _ in range(2):
            with pytest.raises(InferenceServerException):
                client.infer("metrics-nope", inputs)
    after = _metric_values(server.url)
    assert after[ok] - before.get(ok, 0.0) == 3
    assert after[missing] - before.get(missing, 0.0) == 2
    assert after[timed] - before.get(timed, 0.0) == 3

def _proto_request(case: ErrorCase) -> service_pb2.ModelInferRequest:
    """An error case's OIP JSON tensors, as they are, in a ModelInferRequest (typed contents)."""
    body = case.body
    request = service_pb2.ModelInferRequest(model_name=case.model, model_version=case.version or "")
    fields = {"BYTES": "bytes_contents", "INT64": "int64_contents", "INT32": "int_contents", "FP32": "fp32_contents",
              "BOOL": "bool_contents"}
    for tensor in body.get("inputs", []):
        item = request.inputs.add(name=tensor["name"], datatype=tensor["datatype"], shape=tensor["shape"])
        data = np.asarray(tensor.get("data", []), dtype=object).ravel().tolist()
        if tensor["datatype"] == "BYTES":
            data = [v.encode() for v in data]
        getattr(item.contents, fields[tensor["datatype"]]).extend(data)
    for out in body.get("outputs", []) or []:
        request.outputs.add(name=out["name"])
    for key, value in (body.get("parameters") or {}).items():
        slot = request.parameters[key]
        if isinstance(value, bool):
            slot.bool_param = value
        elif isinstance(value, int):
            slot.int64_param = value
        else:
            slot.string_param = str(value)
    return request


GRPC_CASES = [c for c in CASES if c.route == "infer" and not c.http_only]


def test_the_error_table_has_grpc_cases():
    assert len(GRPC_CASES) >= 10


@pytest.mark.parametrize("case", GRPC_CASES, ids=[c.id for c in GRPC_CASES])
def test_error_table_over_grpc(server, case):
    with grpc.insecure_channel(server.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.ModelInfer(_proto_request(case), timeout=30)
    assert err.value.code() == GRPC_CODE[case.kind], err.value.details()
    assert case.message in err.value.details()
    assert "Traceback" not in err.value.details() and "/src/" not in err.value.details()


def test_raw_contents_must_cover_every_input(server):
    request = service_pb2.ModelInferRequest(model_name="qa")
    request.inputs.add(name="QUESTION", datatype="BYTES", shape=[1])
    request.inputs.add(name="CONTEXT", datatype="BYTES", shape=[1])
    request.raw_input_contents.append(b"\x01\x00\x00\x00q")
    with grpc.insecure_channel(server.grpc_url) as channel:
        with pytest.raises(grpc.RpcError) as err:
            service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "raw_input_contents" in err.value.details()


def test_bearer_key_guards_every_method_but_health(zoo):
    srv = GrpcServer([f"emb={zoo.artifact('bert', 'sentence-embeddings')}", "--variant", "fp32"],
                     env={"KILN_API_KEY": KEY})
    try:
        tensors = protocol.tensors_from_inputs(TASKS["emb"], ["hello"])
        with grpcclient.InferenceServerClient(srv.grpc_url) as client:
            assert client.is_server_live() and client.is_model_ready("emb")  # health: no key
            with pytest.raises(InferenceServerException) as err:
                client.infer("emb", _inputs(grpcclient, tensors))
            assert "UNAUTHENTICATED" in str(err.value.status())
            with pytest.raises(InferenceServerException):
                client.get_model_metadata("emb", headers={"authorization": "Bearer wrong"})
            # the scheme is case-insensitive, as over HTTP
            answer = client.infer("emb", _inputs(grpcclient, tensors), headers={"authorization": f"bearer {KEY}"})
            assert answer.as_numpy(protocol.EMBEDDINGS).shape[0] == 1
    finally:
        code, err = srv.stop()
    assert code == 0, err[-2000:]


def test_committed_grpc_modules_match_the_proto():
    """Regenerate from kserve.proto with grpcio-tools and compare the file descriptors (the
    generated text differs between grpcio-tools releases; the descriptor must not)."""
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", str(ROOT / "src"), f"--python_out={out}",
                        str(ROOT / "src/modelkiln/serve/grpc/kserve.proto")], check=True)
        code = ("import sys; sys.path.insert(0, sys.argv[1]); "
                "import importlib.util as u; "
                "spec = u.spec_from_file_location('fresh', sys.argv[2]); fresh = u.module_from_spec(spec); "
                "from google.protobuf import descriptor_pb2 as d; "
                "from modelkiln.serve.grpc import kserve_pb2 as committed; "
                "a = d.FileDescriptorProto(); committed.DESCRIPTOR.CopyToProto(a); "
                "src = open(sys.argv[2]).read(); "
                "b = d.FileDescriptorProto.FromString(eval(src.split('AddSerializedFile(')[1].split(')')[0])); "
                "print(a == b)")
        result = subprocess.run([sys.executable, "-c", code, str(ROOT / "src"),
                                 f"{out}/modelkiln/serve/grpc/kserve_pb2.py"], capture_output=True, text=True)
    assert result.stdout.strip() == "True", result.stderr[-2000:]


def test_loadtest_measures_grpc(server, tmp_path):
    out = tmp_path / "run.json"
    result = subprocess.run([sys.executable, "-m", "modelkiln", "loadtest", server.url, "-m", "emb", "--protocol", "grpc",
                             "--grpc-url", server.grpc_url, "--concurrency", "2", "--warmup", "0.2", "--window", "0.5",
                             "--stable-windows", "2", "--max-windows", "3", "--json", str(out)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    import json

    step = json.loads(out.read_text())["steps"][0]
    assert step["requests"] > 0 and not step["errors"], step
    # the server counted them as gRPC answers of the model (its own counters, not the client's)
    assert step["server"]["success"] >= step["requests"], step["server"]
