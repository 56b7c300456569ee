"""``kiln loadtest --check``: is every answer under load the answer the server gives alone?

Before the load, each distinct request of the run is sent once, alone, one after the other: its
answer is the *reference*. During the load every answer is compared with its request's reference,
and what differs is counted in the step's ``mismatches`` column, by kind:

- generation (greedy, ``temperature: 0``): ``text`` — the streamed text differs from the reference
  text; ``usage`` — the final usage is missing although the reference had one, differs from the
  reference's token counts, or counts fewer tokens than text chunks arrived (a server that never
  sends usage gets a warning, and its tokens are counted from the chunks); ``framing`` — an
  event that is not one ``data: `` line followed by a blank line, bytes after the last blank line,
  ``data: [DONE]`` not last (OpenAI), or data that is not a JSON object. A stream that carries an
  error event or ends before its finish is not a mismatch: it is recorded as a ``mid-stream`` error.
- encoders (``oip-json``, ``oip-binary``, ``task``, ``grpc``): ``vector`` — a float output row whose
  cosine similarity to the reference row is below 0.99999 (a lone float: differs by more than
  1e-4 relative), or whose shape changed; ``label`` — any other value (labels, ids, token spans,
  strings) not equal. Batching on the server may change float rounding, never a label.

A reference that is itself broken (not a 200, a broken stream) stops the run before the load:
there is nothing to compare with."""

from __future__ import annotations

import json
import struct
import sys
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import KilnError
from .client import Connection, parse_url
from .records import StreamRecord
from .streaming import reference

COSINE = 0.99999
SCALAR_RTOL = 1e-4
EXAMPLES = 5  # mismatches described in words, per run


class Checker:
    """Compares answers with references; remembers the first few mismatches in words."""

    def __init__(self) -> None:
        self.examples: list[str] = []
        self.kinds: Counter[str] = Counter()

    def _found(self, index: int, kind: str, detail: str) -> str:
        self.kinds[kind] += 1
        if len(self.examples) < EXAMPLES:
            self.examples.append(f"request {index}: {kind}: {detail}")
        return kind

    def verify(self, index: int, body: bytes) -> str | None:
        raise KilnError("this protocol's answers are streams")

    def verify_stream(self, index: int, record: StreamRecord) -> str | None:
        raise KilnError("this protocol's answers are not streams")


# -- generation -----------------------------------------------------------------------------------

def stream_faults(record: StreamRecord) -> list[str]:
    """What is wrong with a stream on its own (framing, usage arithmetic), in words."""
    faults = list(record.framing)
    if record.completion_tokens is not None and record.completion_tokens < len(record.token_times):
        faults.append(f"usage says {record.completion_tokens} tokens but {len(record.token_times)} text chunks arrived")
    return faults


class GenerationChecker(Checker):
    def __init__(self, references: Sequence[StreamRecord]):
        super().__init__()
        self.references = references

    def verify_stream(self, index: int, record: StreamRecord) -> str | None:
        ref = self.references[index]
        if record.framing:
            return self._found(index, "framing", "; ".join(record.framing[:2]))
        if not record.complete:
            return None  # counted as a mid-stream error by its code
        if record.text != ref.text:
            at = next((i for i, (a, b) in enumerate(zip(record.text, ref.text)) if a != b),
                      min(len(record.text), len(ref.text)))
            return self._found(index, "text", f"from character {at}: {_around(record.text, at)!r} instead of "
                                              f"{_around(ref.text, at)!r}")
        faults = stream_faults(record)
        if faults:
            return self._found(index, "usage", faults[0])
        if record.completion_tokens is None and ref.completion_tokens is not None:
            return self._found(index, "usage", "no usage, although the reference answer had one")
        if (record.completion_tokens, record.prompt_tokens) != (ref.completion_tokens, ref.prompt_tokens):
            return self._found(index, "usage", f"prompt/completion tokens {record.prompt_tokens}/"
                                               f"{record.completion_tokens} instead of {ref.prompt_tokens}/"
                                               f"{ref.completion_tokens}")
        return None


def _around(text: str, at: int, n: int = 40) -> str:
    """The text from a little before ``at`` (where two answers part), at most ``n`` characters."""
    start = max(0, at - 10)
    return ("..." if start else "") + text[start:start + n] + ("..." if len(text) > start + n else "")


async def generation_references(url: str, raws: Sequence[bytes], protocol: str, timeout: float,
                                max_tokens: int | None, ignore_eos: bool) -> GenerationChecker:
    host, port, _ = parse_url(url)
    references = []
    for i, raw in enumerate(raws):
        status, record = await reference(host, port, raw, protocol, timeout)
        faults = stream_faults(record)
        if status != 200 or not record.complete or faults:
            why = f"status {status}" if status != 200 else record.error or "; ".join(faults) or "the stream ended early"
            raise KilnError(f"--check: the reference answer of request {i} (sent alone) is broken: {why}")
        if i == 0 and protocol != "generate" and record.completion_tokens is None:
            print("warning: no usage chunk although stream_options.include_usage was asked: output tokens are "
                  "counted from text chunks, and --check cannot compare usage", file=sys.stderr)
        if ignore_eos and max_tokens is not None and record.completion_tokens not in (None, max_tokens):
            print(f"warning: --ignore-eos --max-tokens {max_tokens}, but request {i} alone got "
                  f"{record.completion_tokens} tokens (the server ignores ignore_eos or the context is full)",
                  file=sys.stderr)
        references.append(record)
    return GenerationChecker(references)


# -- encoders -------------------------------------------------------------------------------------

_NUMPY = {"FP32": "<f4", "FP16": "<f2", "FP64": "<f8", "INT8": "<i1", "INT16": "<i2", "INT32": "<i4",
          "INT64": "<i8", "UINT8": "<u1", "UINT16": "<u2", "UINT32": "<u4", "UINT64": "<u8", "BOOL": "?"}


def _tensor(datatype: str, shape: Sequence[int], raw: bytes) -> Any:
    """Raw little-endian tensor bytes (binary extension, gRPC raw contents) → array or list of values."""
    if datatype == "BYTES":
        values, pos = [], 0
        while pos < len(raw):
            (n,) = struct.unpack_from("<I", raw, pos)
            values.append(raw[pos + 4: pos + 4 + n].decode("utf-8", "replace"))
            pos += 4 + n
        return values
    if datatype not in _NUMPY:
        raise ValueError(f"unknown datatype {datatype}")
    return np.frombuffer(raw, dtype=_NUMPY[datatype]).reshape([int(d) for d in shape])


def decode_oip(protocol: str, body: bytes) -> dict[str, Any]:
    """An OIP answer (JSON, binary extension or gRPC ModelInferResponse) → {output name: values}."""
    if protocol == "grpc":
        from tritonclient.grpc import service_pb2

        response = service_pb2.ModelInferResponse.FromString(body)
        return {o.name: _tensor(o.datatype, o.shape, response.raw_output_contents[i])
                for i, o in enumerate(response.outputs)}
    text = body.decode("latin-1")  # the JSON header, then raw bytes when the binary extension is used
    header, end = json.JSONDecoder().raw_decode(text)
    out: dict[str, Any] = {}
    pos = end
    for o in header.get("outputs") or []:
        size = (o.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            out[o["name"]] = _tensor(o["datatype"], o["shape"], body[pos:pos + size])
            pos += size
        elif o.get("datatype") == "BYTES":
            out[o["name"]] = [v.encode("latin-1").decode("utf-8", "replace") if isinstance(v, str) else v
                              for v in o["data"]]
        else:
            out[o["name"]] = np.asarray(o["data"]).reshape(o["shape"])
    return out


def _leaves(value: Any, path: str, floats: dict[str, list[float]], exact: list[tuple[str, Any]]) -> None:
    """Floats grouped by the list that holds them (one vector per innermost list), the rest exact.
    Strings holding JSON (token classification's entities) are compared by their contents."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, dict):
        for k, v in value.items():
            _leaves(v, f"{path}.{k}", floats, exact)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            if isinstance(v, float):
                floats.setdefault(path, []).append(v)
            else:
                _leaves(v, f"{path}[{i}]", floats, exact)
    elif isinstance(value, float):
        floats.setdefault(path, []).append(value)
    elif isinstance(value, str) and value[:1] in "[{":
        try:
            _leaves(json.loads(value), path, floats, exact)
        except ValueError:
            exact.append((path, value))
    else:
        exact.append((path, value))


def compare(reference: Any, answer: Any) -> tuple[str, str] | None:
    """(kind, detail) of the first difference between two decoded answers, or None."""
    ref_floats: dict[str, list[float]] = {}
    ref_exact: list[tuple[str, Any]] = []
    got_floats: dict[str, list[float]] = {}
    got_exact: list[tuple[str, Any]] = []
    _leaves(reference, "", ref_floats, ref_exact)
    _leaves(answer, "", got_floats, got_exact)
    if ref_exact != got_exact:
        for (p, a), (q, b) in zip(ref_exact, got_exact):
            if (p, a) != (q, b):
                return "label", f"{q or p} = {b!r} instead of {a!r}"
        return "label", f"{len(got_exact)} values instead of {len(ref_exact)}"
    if ref_floats.keys() != got_floats.keys():
        return "vector", f"outputs {sorted(got_floats)} instead of {sorted(ref_floats)}"
    for path, ref in ref_floats.items():
        a, b = np.asarray(ref, dtype=np.float64), np.asarray(got_floats[path], dtype=np.float64)
        if a.shape != b.shape:
            return "vector", f"{path}: {b.size} values instead of {a.size}"
        if a.size == 1:
            if abs(a[0] - b[0]) > SCALAR_RTOL * max(1.0, abs(a[0])):
                return "vector", f"{path}: {b[0]:.6g} instead of {a[0]:.6g}"
            continue
        norms = np.linalg.norm(a) * np.linalg.norm(b)
        cosine = float(a @ b / norms) if norms > 0 else (1.0 if np.array_equal(a, b) else 0.0)
        if not cosine >= COSINE:
            return "vector", f"{path}: cosine {cosine:.7f} to the reference (< {COSINE})"
    return None


class EncoderChecker(Checker):
    def __init__(self, protocol: str, references: Sequence[Any]):
        super().__init__()
        self.protocol = protocol
        self.references = references

    def decode(self, body: bytes) -> Any:
        if self.protocol == "task":
            return json.loads(body)
        return decode_oip(self.protocol, body)

    def verify(self, index: int, body: bytes) -> str | None:
        try:
            answer = self.decode(body)
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            return self._found(index, "label", f"the answer cannot be read: {exc}")
        difference = compare(self.references[index], answer)
        return None if difference is None else self._found(index, *difference)


async def encoder_references(url: str, raws: Sequence[bytes], protocol: str, timeout: float,
                             grpc_target: str | None = None, headers: Sequence[tuple[str, str]] = ()) -> EncoderChecker:
    """Each request alone, in order (HTTP: pre-rendered bytes on one connection; gRPC: one channel)."""
    checker = EncoderChecker(protocol, [])
    answers: list[bytes] = []
    if protocol == "grpc":
        import grpc

        from .grpc_load import call_metadata, open_channel
        from .protocols import GRPC_METHOD

        async with open_channel(grpc_target or "") as channel:
            call = channel.unary_unary(GRPC_METHOD)
            for i, raw in enumerate(raws):
                try:
                    answers.append(await call(raw, timeout=timeout, metadata=call_metadata(headers) or None))
                except grpc.aio.AioRpcError as exc:
                    raise KilnError(f"--check: the reference answer of request {i} failed: {exc.code().name} "
                                    f"{exc.details()}") from None
    else:
        host, port, _ = parse_url(url)
        conn = await Connection.open(host, port)
        conn.keep_body = True
        try:
            for i, raw in enumerate(raws):
                if conn.closed:
                    conn = await Connection.open(host, port)
                    conn.keep_body = True
                response = await conn.request(raw, timeout)
                if not 200 <= response.status < 300:
                    raise KilnError(f"--check: the reference answer of request {i} (sent alone) is a "
                                    f"{response.status}: {response.body[:200]!r}")
                answers.append(response.body)
        except (ConnectionError, TimeoutError) as exc:
            raise KilnError(f"--check: a reference request failed: {exc}") from None
        finally:
            conn.abort()
    checker.references = [checker.decode(a) for a in answers]
    return checker
