"""The error table as data: bad requests and the ``ErrorKind`` each must be answered with.

``tests/serve/test_serve.py`` runs every case over HTTP against a real server. Another transport runs
the cases of the routes it has (gRPC: ``route == "infer"``) that are not ``http_only`` (those are
about JSON framing); their bodies are OIP JSON, convertible to a ModelInferRequest. So both
transports answer the same table. The server they run against serves the
tiny models ``cls``, ``emb``, ``ner``, ``qa`` with ``--max-inputs-per-request 64 --max-body-bytes
200000`` (see ``test_serve.server``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from modelkiln.errors import ErrorKind, KilnError
from modelkiln.serve.codec import decode_request
from modelkiln.serve.types import InferRequest

# What each kind must be over HTTP, written here independently of the server's own table.
HTTP_STATUS = {ErrorKind.INVALID_INPUT: 400, ErrorKind.NOT_FOUND: 404, ErrorKind.TOO_LARGE: 413,
               ErrorKind.TIMED_OUT: 503, ErrorKind.OVERLOADED: 503, ErrorKind.NOT_READY: 503,
               ErrorKind.UNAUTHENTICATED: 401, ErrorKind.METHOD_NOT_ALLOWED: 405}


@dataclass(frozen=True)
class ErrorCase:
    id: str
    route: str  # infer | predict | embeddings
    model: str  # "" for /v1/embeddings (the model is named in the body)
    body: Any  # a JSON value (sent as JSON), or raw bytes
    kind: ErrorKind
    message: str  # a fragment the error message must contain
    version: str | None = None
    http_only: bool = False  # about JSON/HTTP framing: no gRPC form

    @property
    def path(self) -> str:
        if self.route == "embeddings":
            return "/v1/embeddings"
        version = f"/versions/{self.version}" if self.version else ""
        return f"/v2/models/{self.model}{version}/{self.route}"

    def content(self) -> bytes:
        return self.body if isinstance(self.body, bytes) else json.dumps(self.body).encode()

    def infer_request(self) -> InferRequest | None:
        """The case as the typed request a transport builds (infer cases that are not http_only):
        named numpy tensors, requested outputs, parameters. None when the request cannot be one
        (its tensors do not fill their shapes...): the REST codec refuses it, and a gRPC test
        encodes its JSON tensors into the ModelInferRequest as they are, for the gRPC codec to
        refuse."""
        assert self.route == "infer" and not self.http_only, self.id
        try:
            return decode_request(self.content(), None, self.model, self.version)
        except KilnError:
            return None


def text(name: str = "TEXT", shape: list[int] | None = None, data: Any = ("x",), **extra: Any) -> dict:
    data = list(data) if isinstance(data, tuple) else data
    return {"name": name, "datatype": "BYTES", "shape": shape if shape is not None else [len(data)], "data": data,
            **extra}


def ids(name: str, rows: list[list[int]]) -> dict:
    return {"name": name, "datatype": "INT64", "shape": [len(rows), len(rows[0])], "data": rows}


def nested_data(depth: int) -> bytes:
    """An infer body whose TEXT data is nested ``depth`` lists deep (json.dumps cannot write it)."""
    data = "[" * depth + '"x"' + "]" * depth
    return ('{"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [2], "data": ' + data + "}]}").encode()


INVALID, NOT_FOUND = ErrorKind.INVALID_INPUT, ErrorKind.NOT_FOUND
CASES: list[ErrorCase] = [
    # -- framing (HTTP only) --
    ErrorCase("infer-malformed-json", "infer", "emb", b"{not json", INVALID, "malformed JSON", http_only=True),
    ErrorCase("predict-malformed-json", "predict", "emb", b"[1,", INVALID, "malformed JSON", http_only=True),
    ErrorCase("embeddings-malformed-json", "embeddings", "", b"{", INVALID, "malformed JSON", http_only=True),
    ErrorCase("predict-too-large", "predict", "emb", {"inputs": "x" * 300_000}, ErrorKind.TOO_LARGE, "exceeds",
              http_only=True),
    # -- which model --
    ErrorCase("unknown-model", "infer", "nope", {"inputs": [text()]}, NOT_FOUND, "unknown model"),
    ErrorCase("unknown-model-empty-body", "infer", "nope", b"{}", NOT_FOUND, "unknown model", http_only=True),
    ErrorCase("unknown-version", "infer", "emb", {"inputs": [text()]}, NOT_FOUND, "unknown version", version="7"),
    ErrorCase("embeddings-unknown-model", "embeddings", "", {"model": "nope", "input": "x"}, NOT_FOUND,
              "unknown embedding model"),
    ErrorCase("embeddings-not-an-embedding-model", "embeddings", "", {"model": "cls", "input": "x"}, INVALID,
              "not an embedding model"),
    # -- the OIP request's shape --
    ErrorCase("no-inputs", "infer", "emb", {"inputs": []}, INVALID, "inputs", http_only=True),
    ErrorCase("unexpected-input", "infer", "emb", {"inputs": [text("WRONG")]}, INVALID, "unexpected input"),
    ErrorCase("missing-input", "infer", "qa", {"inputs": [text("QUESTION")]}, INVALID, "missing input 'CONTEXT'"),
    ErrorCase("shape-not-filled", "infer", "emb", {"inputs": [text(shape=[3])]}, INVALID, "do not fill"),
    ErrorCase("unknown-output", "infer", "emb", {"inputs": [text()], "outputs": [{"name": "NOPE"}]}, INVALID,
              "unknown output"),
    ErrorCase("unequal-columns", "infer", "qa", {"inputs": [text("QUESTION", data=("a", "b")), text("CONTEXT")]},
              INVALID, "QUESTION has 2 elements"),
    ErrorCase("too-many-inputs", "infer", "emb", {"inputs": [text(data=("x",) * 65)]}, INVALID, "limit is 64"),
    # -- malformed but parseable JSON (issue 15: these were 500s) --
    ErrorCase("tensor-parameters-list", "infer", "emb", {"inputs": [text(parameters=[1])]}, INVALID,
              "'parameters' of input 'TEXT' must be an object", http_only=True),
    ErrorCase("output-parameters-list", "infer", "emb",
              {"inputs": [text()], "outputs": [{"name": "EMBEDDINGS", "parameters": ["binary_data"]}]}, INVALID,
              "'parameters' of output 'EMBEDDINGS' must be an object", http_only=True),
    ErrorCase("request-parameters-list", "infer", "emb", {"inputs": [text()], "parameters": [1]}, INVALID,
              "'parameters' of the request must be an object", http_only=True),
    ErrorCase("shape-overflow", "infer", "emb", {"inputs": [text(shape=[4294967296, 4294967296], data=[])]},
              INVALID, "shape", http_only=True),
    ErrorCase("shape-huge-zero", "infer", "emb", {"inputs": [text(shape=[0, 2**62], data=[])]}, INVALID, "shape",
              http_only=True),
    ErrorCase("shape-bool", "infer", "emb", {"inputs": [text(shape=[True])]}, INVALID, "shape", http_only=True),
    ErrorCase("deeply-nested-data", "infer", "emb", nested_data(1000), INVALID, "1 elements do not fill shape [2]",
              http_only=True),
    ErrorCase("binary-size-bool", "infer", "emb",
              {"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1], "parameters": {"binary_data_size": True}}]},
              INVALID, "binary_data_size", http_only=True),
    ErrorCase("bytes-as-numbers", "infer", "emb", {"inputs": [text(data=[1])]}, INVALID, "must be strings",
              http_only=True),
    ErrorCase("int-tensor-wrong-values", "infer", "emb",
              {"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [1, 2], "data": ["a", "b"]}]},
              INVALID, "data is not INT64", http_only=True),
    ErrorCase("text-tensor-wrong-rank", "infer", "emb", {"inputs": [text(shape=[1, 1, 1], data=[[["x"]]])]}, INVALID,
              "must have shape [n] or [n, 1]"),
    # -- pre-tokenized inputs, checked before batching (issue 15: one bad row failed its batch) --
    ErrorCase("ids-out-of-vocabulary", "infer", "emb", {"inputs": [ids("input_ids", [[101, 999999999, 102]])]},
              INVALID, "outside 0.."),
    ErrorCase("ids-negative", "infer", "emb", {"inputs": [ids("input_ids", [[101, -5, 102]])]}, INVALID, "holds -5"),
    ErrorCase("token-types-out-of-range", "infer", "emb",
              {"inputs": [ids("input_ids", [[101, 7, 102]]), ids("token_type_ids", [[0, 9, 0]])]}, INVALID,
              "token_type_ids holds 9"),
    ErrorCase("mask-not-binary", "infer", "emb",
              {"inputs": [ids("input_ids", [[101, 7, 102]]), ids("attention_mask", [[1, 2, 1]])]}, INVALID,
              "attention_mask holds 2"),
    ErrorCase("mask-left-padded", "infer", "emb",
              {"inputs": [ids("input_ids", [[0, 101, 102]]), ids("attention_mask", [[0, 1, 1]])]}, INVALID,
              "right-padded"),
    ErrorCase("ids-empty", "infer", "emb", {"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [1, 0],
                                                        "data": []}]}, INVALID, "no tokens"),
    # -- /predict and OpenAI --
    ErrorCase("predict-qa-needs-a-pair", "predict", "qa", {"inputs": "no context"}, INVALID, "pair"),
    ErrorCase("predict-too-many-inputs", "predict", "emb", {"inputs": ["x"] * 65}, INVALID, "limit is 64"),
    ErrorCase("predict-parameters-list", "predict", "emb", {"inputs": "x", "parameters": [1]}, INVALID,
              "'parameters' must be an object", http_only=True),
    ErrorCase("predict-bad-top-k", "predict", "cls", {"inputs": "x", "parameters": {"top_k": 0}}, INVALID, "top_k",
              http_only=True),
    ErrorCase("embeddings-bad-input", "embeddings", "", {"model": "emb", "input": [1, 2]}, INVALID,
              "'input' must be a string", http_only=True),
    ErrorCase("embeddings-bad-dimensions", "embeddings", "", {"model": "emb", "input": "x", "dimensions": "a"},
              INVALID, "dimensions", http_only=True),
    # -- deadlines --
    ErrorCase("predict-timeout-1us", "predict", "emb", {"inputs": "x", "parameters": {"timeout": 1}},
              ErrorKind.TIMED_OUT, "timed out"),
    ErrorCase("infer-timeout-1us", "infer", "emb", {"inputs": [text()], "parameters": {"timeout": 1}},
              ErrorKind.TIMED_OUT, "timed out"),
]
