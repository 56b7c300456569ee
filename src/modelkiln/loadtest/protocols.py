"""Request bodies for each protocol, built once before a run (the hot loop only sends bytes).

- ``oip-json``: Open Inference Protocol ``POST /v2/models/{m}/infer`` with JSON tensors;
- ``oip-binary``: the same route with the binary tensor data extension (Triton, kiln serve);
- ``task``: kiln serve's task route ``POST /v2/models/{m}/predict`` with ``{"inputs": [...]}``;
- ``grpc``: KServe v2 ``ModelInfer`` over gRPC, serialized with tritonclient (sent by ``grpc_load``).

Input tensor names follow the Triton ensemble that ``kiln triton`` writes and ``kiln serve``
shares: BYTES ``TEXT`` (+ optional ``TEXT_PAIR``), or ``QUESTION`` + ``CONTEXT``. Triton's ensemble
declares them with ``dims: [1]`` under batching, i.e. shape ``[n, 1]``; kiln serve says ``[-1]``
(and accepts both). ``InputLayout.from_metadata`` reads the model metadata to get that right."""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from ..errors import KilnError
from ..extras import install_hint
from .inputs import Item

PROTOCOLS = ("oip-json", "oip-binary", "task", "grpc")
GRPC_METHOD = "/inference.GRPCInferenceService/ModelInfer"
GENERATION_PROTOCOLS = ("openai-chat", "openai-completions", "generate")  # streamed text generation (streaming.py)


@dataclass(frozen=True)
class PreparedRequest:
    """One ready-to-send request: a path, its body and the headers that depend on the body."""

    path: str
    body: bytes
    headers: tuple[tuple[str, str], ...]
    inputs: int  # model inputs in this request (its batch size)


@dataclass(frozen=True)
class InputLayout:
    """Which BYTES tensors a text model takes and with which rank."""

    text: str = "TEXT"
    pair: str | None = None  # TEXT_PAIR when the model takes one
    question_answering: bool = False
    rank: int = 1  # 1: shape [n]; 2: shape [n, 1] (Triton with max_batch_size > 0 and dims [1])

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any]) -> InputLayout:
        inputs = {i.get("name"): i for i in metadata.get("inputs") or [] if isinstance(i, dict)}
        if "QUESTION" in inputs and "CONTEXT" in inputs:
            return cls(text="QUESTION", pair="CONTEXT", question_answering=True,
                       rank=2 if len(inputs["QUESTION"].get("shape") or [-1]) == 2 else 1)
        if "TEXT" not in inputs:
            names = ", ".join(str(n) for n in inputs) or "none"
            raise KilnError(f"model '{metadata.get('name')}' has no BYTES input TEXT or QUESTION/CONTEXT "
                            f"(inputs: {names}); kiln loadtest sends text")
        shape = inputs["TEXT"].get("shape") or [-1]
        return cls(text="TEXT", pair="TEXT_PAIR" if "TEXT_PAIR" in inputs else None, rank=2 if len(shape) == 2 else 1)

    def columns(self, batch: Sequence[Item]) -> dict[str, list[str]]:
        """Items → named columns of strings."""
        if self.question_answering:
            if not all(isinstance(i, tuple) for i in batch):
                raise KilnError("a question-answering model needs (question, context) inputs: use --inputs squad, "
                                "the samples, or a file with question<TAB>context lines")
            return {"QUESTION": [i[0] for i in batch], "CONTEXT": [i[1] for i in batch]}
        if self.pair and all(isinstance(i, tuple) for i in batch):
            return {self.text: [i[0] for i in batch], self.pair: [i[1] for i in batch]}
        # a pair sent to a single-text model: join them (it is still real text of that length)
        return {self.text: [i if isinstance(i, str) else f"{i[0]} {i[1]}" for i in batch]}

    def shape(self, n: int) -> list[int]:
        return [n, 1] if self.rank == 2 else [n]


class Protocol:
    name: ClassVar[str]

    def __init__(self, model: str, layout: InputLayout):
        self.model = model
        self.layout = layout

    def build(self, batch: Sequence[Item]) -> PreparedRequest:
        raise NotImplementedError


class OipJson(Protocol):
    name = "oip-json"

    def build(self, batch: Sequence[Item]) -> PreparedRequest:
        n = len(batch)
        tensors = [{"name": k, "datatype": "BYTES", "shape": self.layout.shape(n), "data": v}
                   for k, v in self.layout.columns(batch).items()]
        body = json.dumps({"inputs": tensors}, ensure_ascii=False, separators=(",", ":")).encode()
        return PreparedRequest(f"/v2/models/{self.model}/infer", body, (("Content-Type", "application/json"),), n)


class OipBinary(Protocol):
    """Binary tensor data extension: a JSON header, then raw tensor bytes; BYTES elements are each
    a 4-byte little-endian length followed by the bytes. Outputs come back binary too."""

    name = "oip-binary"

    def build(self, batch: Sequence[Item]) -> PreparedRequest:
        n = len(batch)
        tensors, chunks = [], []
        for k, values in self.layout.columns(batch).items():
            raw = b"".join(struct.pack("<I", len(b)) + b for b in (v.encode() for v in values))
            tensors.append({"name": k, "datatype": "BYTES", "shape": self.layout.shape(n),
                            "parameters": {"binary_data_size": len(raw)}})
            chunks.append(raw)
        header = json.dumps({"inputs": tensors, "parameters": {"binary_data_output": True}},
                            separators=(",", ":")).encode()
        return PreparedRequest(f"/v2/models/{self.model}/infer", header + b"".join(chunks),
                               (("Content-Type", "application/octet-stream"),
                                ("Inference-Header-Content-Length", str(len(header)))), n)


class TaskRoute(Protocol):
    """kiln serve's ``/predict``: ``{"inputs": [text | {"text","text_pair"} | {"question","context"}]}``."""

    name = "task"

    def build(self, batch: Sequence[Item]) -> PreparedRequest:
        values: list[Any] = []
        for i in batch:
            if isinstance(i, str):
                values.append(i)
            elif self.layout.question_answering:
                values.append({"question": i[0], "context": i[1]})
            elif self.layout.pair:
                values.append({"text": i[0], "text_pair": i[1]})
            else:
                values.append(f"{i[0]} {i[1]}")
        body = json.dumps({"inputs": values}, ensure_ascii=False, separators=(",", ":")).encode()
        return PreparedRequest(f"/v2/models/{self.model}/predict", body, (("Content-Type", "application/json"),),
                               len(batch))


class GrpcInfer(Protocol):
    """ModelInfer with every input in ``raw_input_contents`` (as tritonclient sends them)."""

    name = "grpc"

    def build(self, batch: Sequence[Item]) -> PreparedRequest:
        from tritonclient.grpc import service_pb2  # loadtest extra; never imported by the server

        n = len(batch)
        request = service_pb2.ModelInferRequest(model_name=self.model)
        for name, values in self.layout.columns(batch).items():
            request.inputs.add(name=name, datatype="BYTES", shape=self.layout.shape(n))
            request.raw_input_contents.append(b"".join(len(b).to_bytes(4, "little") + b
                                                       for b in (v.encode() for v in values)))
        return PreparedRequest(GRPC_METHOD, request.SerializeToString(), (), n)


def make_grpc_protocol(model: str, layout: InputLayout) -> GrpcInfer:
    try:
        import tritonclient.grpc  # noqa: F401
    except ImportError:
        raise KilnError(f"--protocol grpc needs tritonclient: {install_hint('loadtest')}") from None
    return GrpcInfer(model, layout)


def make_protocol(name: str, model: str, layout: InputLayout) -> Protocol:
    if name == "grpc":
        return make_grpc_protocol(model, layout)
    for cls in (OipJson, OipBinary, TaskRoute):
        if cls.name == name:
            return cls(model, layout)
    raise KilnError(f"--protocol must be one of {', '.join(PROTOCOLS + GENERATION_PROTOCOLS)}, got '{name}'")
