"""Open Inference Protocol (KServe v2) tensors: JSON and the binary tensor data extension.

Decoding turns a request body into named numpy arrays (BYTES → object arrays of ``bytes``);
encoding turns named arrays back into a response body. No model or task knowledge here."""

from __future__ import annotations

import gzip
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from ..errors import InvalidInputError, PayloadTooLargeError

HEADER_LENGTH = "inference-header-content-length"

# OIP datatype ↔ numpy dtype (BYTES is handled separately).
DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8), "UINT16": np.dtype(np.uint16), "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64), "INT8": np.dtype(np.int8), "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32), "INT64": np.dtype(np.int64), "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32), "FP64": np.dtype(np.float64),
}
DATATYPES = {v: k for k, v in DTYPES.items()}


@dataclass
class InferRequest:
    id: str | None
    inputs: dict[str, np.ndarray]
    outputs: list[str] | None  # requested output names, None = all
    binary_outputs: set[str] = field(default_factory=set)  # outputs to return as binary data
    binary_default: bool = False  # request-level ``binary_data_output``
    parameters: dict[str, Any] = field(default_factory=dict)


def decompress(body: bytes, encoding: str | None, limit: int) -> bytes:
    """Undo ``Content-Encoding: gzip|deflate`` (tritonclient can compress requests), bounded."""
    if not encoding or encoding == "identity":
        return body
    try:
        if encoding == "gzip":
            d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif encoding == "deflate":
            d = zlib.decompressobj()
        else:
            raise InvalidInputError(f"unsupported Content-Encoding '{encoding}'")
        out = d.decompress(body, limit + 1)
    except (zlib.error, gzip.BadGzipFile) as exc:
        raise InvalidInputError(f"cannot decompress request body: {exc}") from None
    if len(out) > limit:
        raise PayloadTooLargeError(f"decompressed request body exceeds {limit} bytes")
    return out


def loads(data: bytes | str) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise InvalidInputError(f"malformed JSON: {exc}") from None


def decode_request(body: bytes, header_length: str | None) -> InferRequest:
    """Parse an infer request; ``header_length`` is the Inference-Header-Content-Length header."""
    if header_length is not None:
        try:
            n = int(header_length)
        except ValueError:
            raise InvalidInputError("Inference-Header-Content-Length must be an integer") from None
        if not 0 < n <= len(body):
            raise InvalidInputError(f"Inference-Header-Content-Length {n} does not fit the body ({len(body)} bytes)")
        header, binary = loads(body[:n]), memoryview(body)[n:]
    else:
        header, binary = loads(body), memoryview(b"")
    if not isinstance(header, dict):
        raise InvalidInputError("the request must be a JSON object")
    raw_inputs = header.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise InvalidInputError("'inputs' must be a non-empty list of tensors")
    offset = 0
    inputs: dict[str, np.ndarray] = {}
    for tensor in raw_inputs:
        if not isinstance(tensor, dict):
            raise InvalidInputError("each input must be a JSON object")
        name, array, used = _decode_tensor(tensor, binary, offset)
        if name in inputs:
            raise InvalidInputError(f"input '{name}' given twice")
        inputs[name] = array
        offset += used
    if offset != len(binary):
        raise InvalidInputError(f"{len(binary) - offset} bytes of binary data are not claimed by any input")

    params = header.get("parameters") or {}
    if not isinstance(params, dict):
        raise InvalidInputError("'parameters' must be an object")
    outputs: list[str] | None = None
    binary_outputs: set[str] = set()
    if header.get("outputs") is not None:
        if not isinstance(header["outputs"], list):
            raise InvalidInputError("'outputs' must be a list")
        outputs = []
        for out in header["outputs"]:
            if not isinstance(out, dict) or not isinstance(out.get("name"), str):
                raise InvalidInputError("each requested output needs a 'name'")
            outputs.append(out["name"])
            if (out.get("parameters") or {}).get("binary_data"):
                binary_outputs.add(out["name"])
    request_id = header.get("id")
    return InferRequest(
        id=str(request_id) if request_id is not None else None, inputs=inputs, outputs=outputs,
        binary_outputs=binary_outputs, binary_default=bool(params.get("binary_data_output")), parameters=params,
    )


def _decode_tensor(tensor: dict, binary: memoryview, offset: int) -> tuple[str, np.ndarray, int]:
    name, datatype, shape = tensor.get("name"), tensor.get("datatype"), tensor.get("shape")
    if not isinstance(name, str):
        raise InvalidInputError("every input needs a string 'name'")
    if datatype != "BYTES" and datatype not in DTYPES:
        raise InvalidInputError(f"input '{name}': unsupported datatype {datatype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise InvalidInputError(f"input '{name}': 'shape' must be a list of non-negative integers")
    count = int(np.prod(shape)) if shape else 1
    size = (tensor.get("parameters") or {}).get("binary_data_size")
    if size is not None:  # binary tensor extension: the bytes follow the JSON header
        if not isinstance(size, int) or size < 0 or offset + size > len(binary):
            raise InvalidInputError(f"input '{name}': binary_data_size {size} exceeds the binary data")
        chunk = binary[offset : offset + size]
        if datatype == "BYTES":
            array = _decode_bytes_elements(name, chunk, count)
        else:
            dtype = DTYPES[datatype]
            if size != count * dtype.itemsize:
                raise InvalidInputError(f"input '{name}': {size} bytes do not hold shape {shape} of {datatype}")
            array = np.frombuffer(chunk, dtype=dtype.newbyteorder("<")).astype(dtype)
        return name, array.reshape(shape), size
    data = tensor.get("data")
    if data is None:
        raise InvalidInputError(f"input '{name}' has neither 'data' nor binary_data_size")
    flat = _flatten(data)
    if len(flat) != count:
        raise InvalidInputError(f"input '{name}': {len(flat)} elements do not fill shape {shape}")
    if datatype == "BYTES":
        values = []
        for v in flat:
            if not isinstance(v, str):
                raise InvalidInputError(f"input '{name}': BYTES elements must be strings in JSON")
            values.append(v.encode("utf-8"))
        array = np.empty(count, dtype=object)
        array[:] = values
    else:
        try:
            array = np.asarray(flat, dtype=DTYPES[datatype])
        except (TypeError, ValueError, OverflowError):
            raise InvalidInputError(f"input '{name}': data is not {datatype}") from None
    return name, array.reshape(shape), 0


def _flatten(data: Any) -> list:
    if not isinstance(data, list):
        return [data]
    if data and isinstance(data[0], list):
        out: list = []
        for item in data:
            out.extend(_flatten(item))
        return out
    return data


def _decode_bytes_elements(name: str, chunk: memoryview, count: int) -> np.ndarray:
    """BYTES in binary form: each element is a 4-byte little-endian length, then the bytes."""
    values = []
    pos, end = 0, len(chunk)
    while pos < end:
        if pos + 4 > end:
            raise InvalidInputError(f"input '{name}': truncated BYTES element length")
        (n,) = struct.unpack_from("<I", chunk, pos)
        pos += 4
        if pos + n > end:
            raise InvalidInputError(f"input '{name}': BYTES element overruns the binary data")
        values.append(bytes(chunk[pos : pos + n]))
        pos += n
    if len(values) != count:
        raise InvalidInputError(f"input '{name}': {len(values)} BYTES elements do not fill the shape")
    array = np.empty(count, dtype=object)
    array[:] = values
    return array


def _encode_bytes_elements(values: np.ndarray) -> bytes:
    parts = []
    for v in values.ravel():
        b = v if isinstance(v, bytes) else str(v).encode("utf-8")
        parts.append(struct.pack("<I", len(b)))
        parts.append(b)
    return b"".join(parts)


def encode_response(
    model: str, version: str, request_id: str | None, outputs: dict[str, tuple[str, np.ndarray]], binary: set[str]
) -> tuple[bytes, int | None]:
    """``outputs``: name → (OIP datatype, array). Returns (body, json header length or None)."""
    tensors = []
    chunks: list[bytes] = []
    for name, (datatype, array) in outputs.items():
        tensor: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
        if name in binary:
            data = _encode_bytes_elements(array) if datatype == "BYTES" else np.ascontiguousarray(
                array, dtype=DTYPES[datatype].newbyteorder("<")).tobytes()
            tensor["parameters"] = {"binary_data_size": len(data)}
            chunks.append(data)
        elif datatype == "BYTES":
            tensor["data"] = [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in array.ravel()]
        else:
            tensor["data"] = array.ravel()
        tensors.append(tensor)
    header: dict[str, Any] = {"model_name": model, "model_version": version, "outputs": tensors}
    if request_id is not None:
        header["id"] = request_id
    head = orjson.dumps(header, option=orjson.OPT_SERIALIZE_NUMPY)
    if not chunks:
        return head, None
    return head + b"".join(chunks), len(head)
