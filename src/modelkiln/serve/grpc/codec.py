"""KServe v2 gRPC messages ⇄ the data plane's typed requests and responses.

Pure functions, no servicer state, so a streaming method (ModelStreamInfer, for generation) uses
the same conversions as ModelInfer. Raw tensors share ``serve.codec``'s decoder with REST's
binary extension, so both transports read bytes the same way; answers always travel in
``raw_output_contents``, as Triton sends them and tritonclient expects."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ...errors import InvalidInputError
from .. import codec as rest_codec
from ..types import InferRequest, InferResponse, ModelMetadata, ModelStatistics, RequestedOutput
from . import kserve_pb2 as pb

# Which ``InferTensorContents`` field holds each datatype's typed values (FP16 has none: raw only).
_CONTENTS_FIELD = {
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents",
}


# -- parameters -------------------------------------------------------------------------------------
def parameters_from_proto(params: Mapping[str, pb.InferParameter]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if not params:  # the common case; iterating an empty protobuf map still costs µs
        return out
    for key, value in params.items():
        choice = value.WhichOneof("parameter_choice")
        out[key] = getattr(value, choice) if choice else None
    return out


def parameters_to_proto(target: Any, params: Mapping[str, Any]) -> None:
    """Fill a protobuf ``map<string, InferParameter>`` (values: bool, int, float, str)."""
    for key, value in params.items():
        slot = target[key]
        if isinstance(value, bool):
            slot.bool_param = value
        elif isinstance(value, int):
            slot.int64_param = value
        elif isinstance(value, float):
            slot.double_param = value
        else:
            slot.string_param = str(value)


# -- requests -------------------------------------------------------------------------------------
def request_from_proto(message: pb.ModelInferRequest) -> InferRequest:
    """A ModelInferRequest → ``InferRequest``; malformed tensors → InvalidInputError."""
    raw = message.raw_input_contents
    if raw and len(raw) != len(message.inputs):
        raise InvalidInputError(f"{len(raw)} raw_input_contents for {len(message.inputs)} inputs: "
                                "give every input raw, or none")
    inputs: dict[str, np.ndarray] = {}
    for i, tensor in enumerate(message.inputs):
        name = tensor.name
        if name in inputs:
            raise InvalidInputError(f"input '{name}' given twice")
        if tensor.datatype != "BYTES" and tensor.datatype not in rest_codec.DTYPES:
            raise InvalidInputError(f"input '{name}': unsupported datatype {tensor.datatype!r}")
        shape = list(tensor.shape)
        if raw:
            inputs[name] = rest_codec.decode_raw(name, tensor.datatype, shape, raw[i])
        else:
            inputs[name] = _from_contents(name, tensor.datatype, shape, tensor)
    if not inputs:
        raise InvalidInputError("'inputs' must be a non-empty list of tensors")
    outputs = ([RequestedOutput(o.name, parameters_from_proto(o.parameters)) for o in message.outputs]
               if message.outputs else None)
    return InferRequest(model_name=message.model_name, model_version=message.model_version or None,
                        inputs=inputs, outputs=outputs, id=message.id or None,
                        parameters=parameters_from_proto(message.parameters))


def _from_contents(name: str, datatype: str, shape: list[int], tensor: Any) -> np.ndarray:
    count = rest_codec.element_count(name, shape)
    field = _CONTENTS_FIELD.get(datatype)
    if field is None:
        raise InvalidInputError(f"input '{name}': {datatype} travels in raw_input_contents only")
    values = getattr(tensor.contents, field)
    if len(values) != count:
        raise InvalidInputError(f"input '{name}': {len(values)} elements in contents.{field} do not fill "
                                f"shape {shape}")
    if datatype == "BYTES":
        array = np.empty(count, dtype=object)
        array[:] = list(values)
    else:
        # Narrow types (INT8 in int_contents) must fit: a value out of range is the client's error.
        wide = np.asarray(values)
        array = wide.astype(rest_codec.DTYPES[datatype])
        if count and not np.array_equal(array, wide):
            raise InvalidInputError(f"input '{name}': values out of range for {datatype}")
    return array.reshape(shape)


# -- responses ------------------------------------------------------------------------------------
def response_to_proto(response: InferResponse) -> pb.ModelInferResponse:
    message = pb.ModelInferResponse(model_name=response.model_name, model_version=response.model_version,
                                    id=response.id or "")
    parameters_to_proto(message.parameters, response.parameters)
    for out in response.outputs:
        tensor = message.outputs.add(name=out.name, datatype=out.datatype, shape=list(out.data.shape))
        parameters_to_proto(tensor.parameters, out.parameters)
        message.raw_output_contents.append(rest_codec.encode_raw(out.datatype, out.data))
    return message


def metadata_to_proto(metadata: ModelMetadata) -> pb.ModelMetadataResponse:
    def tensors(specs: Any) -> list[pb.ModelMetadataResponse.TensorMetadata]:
        return [pb.ModelMetadataResponse.TensorMetadata(name=t.name, datatype=t.datatype, shape=list(t.shape))
                for t in specs]

    return pb.ModelMetadataResponse(name=metadata.name, versions=list(metadata.versions),
                                    platform=metadata.platform, inputs=tensors(metadata.inputs),
                                    outputs=tensors(metadata.outputs))


def statistics_to_proto(stats: list[ModelStatistics]) -> pb.ModelStatisticsResponse:
    def duration(d: Any) -> pb.StatisticDuration:
        return pb.StatisticDuration(count=d.count, ns=d.ns)

    return pb.ModelStatisticsResponse(model_stats=[
        pb.ModelStatistics(
            name=s.name, version=s.version, last_inference=s.last_inference_ms,
            inference_count=s.inference_count, execution_count=s.execution_count,
            inference_stats=pb.InferStatistics(success=duration(s.success), fail=duration(s.fail),
                                               queue=duration(s.queue), compute_infer=duration(s.compute_infer)))
        for s in stats])
