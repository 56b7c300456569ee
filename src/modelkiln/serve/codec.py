"""Open Inference Protocol (KServe v2) tensors: JSON and the binary tensor data extension.

Decoding turns a request body into named numpy arrays (BYTES → object arrays of ``bytes``);
encoding turns named arrays back into a response body. No model or task knowledge here."""

from __future__ import annotations

import gzip
import math
import struct
import zlib
from typing import Any

import numpy as np
import orjson

from ..errors import InvalidInputError, PayloadTooLargeError
from .types import InferRequest, InferResponse, RequestedOutput

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
# No tensor dimension can be larger than a body could fill (it also keeps numpy's shapes in range).
MAX_DIMENSION = 2**31 - 1


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


def decode_request(body: bytes, header_length: str | None, model_name: str = "", model_version: str | None = None
                   ) -> InferRequest:
    """Parse an infer request; ``header_length`` is the Inference-Header-Content-Length header.
    The binary-data choices (``binary_data_output``, ``outputs[].parameters.binary_data``) stay in
    the request's parameters for ``encode_response``."""
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

    params = _parameters(header, "the request")
    outputs: list[RequestedOutput] | None = None
    if header.get("outputs") is not None:
        if not isinstance(header["outputs"], list):
            raise InvalidInputError("'outputs' must be a list")
        outputs = []
        for out in header["outputs"]:
            if not isinstance(out, dict) or not isinstance(out.get("name"), str):
                raise InvalidInputError("each requested output needs a 'name'")
            outputs.append(RequestedOutput(out["name"], _parameters(out, f"output '{out['name']}'")))
    request_id = header.get("id")
    return InferRequest(model_name=model_name, model_version=model_version, inputs=inputs, outputs=outputs,
                        id=str(request_id) if request_id is not None else None, parameters=params)


def _parameters(obj: dict, what: str) -> dict[str, Any]:
    """An object's ``parameters``: absent/null → {}, an object → itself, anything else → 400."""
    params = obj.get("parameters")
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise InvalidInputError(f"'parameters' of {what} must be an object")
    return params


def _decode_tensor(tensor: dict, binary: memoryview, offset: int) -> tuple[str, np.ndarray, int]:
    name, datatype, shape = tensor.get("name"), tensor.get("datatype"), tensor.get("shape")
    if not isinstance(name, str):
        raise InvalidInputError("every input needs a string 'name'")
    if datatype != "BYTES" and datatype not in DTYPES:
        raise InvalidInputError(f"input '{name}': unsupported datatype {datatype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        raise InvalidInputError(f"input '{name}': 'shape' must be a list of non-negative integers")
    count = element_count(name, shape)
    size = _parameters(tensor, f"input '{name}'").get("binary_data_size")
    if size is not None:  # binary tensor extension: the bytes follow the JSON header
        if not isinstance(size, int) or isinstance(size, bool) or size < 0 or offset + size > len(binary):
            raise InvalidInputError(f"input '{name}': binary_data_size {size} exceeds the binary data")
        return name, decode_raw(name, datatype, shape, binary[offset : offset + size]), size
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
    """Nested JSON lists → one flat list, row-major (iterative: nesting depth is the client's)."""
    if not isinstance(data, list):
        return [data]
    out: list = []
    stack = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            out.append(item)
        else:
            stack.pop()
    return out


def element_count(name: str, shape: list[int]) -> int:
    """Elements of ``shape``, refusing negative and absurd dimensions (400, not a 500 later)."""
    if any(d < 0 for d in shape):
        raise InvalidInputError(f"input '{name}': 'shape' must be a list of non-negative integers")
    if any(d > MAX_DIMENSION for d in shape):
        raise InvalidInputError(f"input '{name}': shape {shape} has a dimension over {MAX_DIMENSION}")
    # Python integers: np.prod wraps around (shape [2**32, 2**32] gave 0 elements, then a 500)
    return math.prod(shape)


def decode_raw(name: str, datatype: str, shape: list[int], chunk: memoryview | bytes) -> np.ndarray:
    """A tensor in its raw binary form (REST's binary extension, gRPC's ``raw_input_contents``):
    little-endian elements, BYTES as length-prefixed elements."""
    count = element_count(name, shape)
    if datatype == "BYTES":
        array = _decode_bytes_elements(name, memoryview(chunk), count)
    else:
        dtype = DTYPES[datatype]
        if len(chunk) != count * dtype.itemsize:
            raise InvalidInputError(f"input '{name}': {len(chunk)} bytes do not hold shape {shape} of {datatype}")
        array = np.frombuffer(chunk, dtype=dtype.newbyteorder("<")).astype(dtype)
    return array.reshape(shape)


def encode_raw(datatype: str, array: np.ndarray) -> bytes:
    """The inverse of ``decode_raw``."""
    if datatype == "BYTES":
        return _encode_bytes_elements(array)
    return np.ascontiguousarray(array, dtype=DTYPES[datatype].newbyteorder("<")).tobytes()


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


def binary_default(request: InferRequest) -> bool:
    """The request-level choice: every output as binary data unless an output says otherwise."""
    return bool(request.parameters.get("binary_data_output"))


def encode_response(request: InferRequest, response: InferResponse) -> tuple[bytes, int | None]:
    """A response as JSON, with the outputs the request asked for as binary data (request-level
    ``binary_data_output``, or ``binary_data`` on a requested output) after the JSON header.
    Returns (body, JSON header length, or None when nothing is binary)."""
    default = binary_default(request)
    asked = {o.name: o.parameters.get("binary_data") for o in request.outputs or ()}
    tensors = []
    chunks: list[bytes] = []
    for out in response.outputs:
        datatype, array = out.datatype, out.data
        tensor: dict[str, Any] = {"name": out.name, "datatype": datatype, "shape": list(array.shape)}
        binary = asked.get(out.name)
        if binary if binary is not None else default:
            data = encode_raw(datatype, array)
            tensor["parameters"] = {**out.parameters, "binary_data_size": len(data)}
            chunks.append(data)
        else:
            if out.parameters:
                tensor["parameters"] = out.parameters
            if datatype == "BYTES":
                tensor["data"] = [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in array.ravel()]
            else:
                tensor["data"] = array.ravel()
        tensors.append(tensor)
    header: dict[str, Any] = {"model_name": response.model_name, "model_version": response.model_version,
                              "outputs": tensors}
    if response.id is not None:
        header["id"] = response.id
    if response.parameters:
        header["parameters"] = response.parameters
    head = orjson.dumps(header, option=orjson.OPT_SERIALIZE_NUMPY)
    if not chunks:
        return head, None
    return head + b"".join(chunks), len(head)
