"""Property-based fuzzing of the REST decoder and the checks behind it: any JSON a client can
send is either decoded or refused with a typed error (a 4xx), never an unexpected exception (a
500). Runs in-process, so hypothesis can try hundreds of bodies in a second or two."""

from __future__ import annotations

import json
import os
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modelkiln.errors import KilnError
from modelkiln.serve import codec
from modelkiln.serve.http import json_api
from modelkiln.serve.tokenized import TokenLimits, is_tokenized, token_rows
from modelkiln.tasks import TASKS

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                    st.text(max_size=8))
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                            st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                           max_leaves=12)
datatypes = st.sampled_from(["BYTES", "INT64", "INT32", "FP32", "BOOL", "UINT64", "FP16", "nope", 3])
names = st.sampled_from(["TEXT", "TEXT_PAIR", "QUESTION", "CONTEXT", "input_ids", "attention_mask",
                         "token_type_ids", "x"])
shapes = st.one_of(st.lists(st.integers(-2, 2**40), max_size=3), json_values)
parameters = st.one_of(st.none(), json_values, st.dictionaries(
    st.sampled_from(["binary_data", "binary_data_size", "binary_data_output", "timeout"]), json_values, max_size=2))
tensors = st.fixed_dictionaries({}, optional={"name": names, "datatype": datatypes, "shape": shapes,
                                              "data": json_values, "parameters": parameters})
# Nearly valid tensors get past the first checks and exercise the later ones: often the shape
# fits the data, and pre-tokenized rows come with their mask and types.
small_values = st.one_of(st.integers(-3, 200), st.text(max_size=4), st.booleans(), st.floats(-1e3, 1e3), st.none())
flat_data = st.one_of(st.lists(st.text(max_size=5), min_size=1, max_size=4),
                      st.lists(st.integers(-3, 200), min_size=1, max_size=4), st.lists(small_values, max_size=4))


@st.composite
def near_valid(draw: st.DrawFn) -> dict:
    name = draw(names)
    data = draw(flat_data)
    rows = draw(st.sampled_from([1, len(data)])) if data else 1
    shape = draw(st.one_of(st.just([len(data)]), st.just([rows, len(data) // rows]), st.lists(st.integers(0, 3), max_size=3)))
    tensor = {"name": name, "datatype": draw(st.sampled_from(["BYTES", "INT64", "INT32", "UINT8", "FP32"])),
              "shape": shape, "data": data}
    if draw(st.booleans()):
        tensor["parameters"] = draw(st.fixed_dictionaries({}, optional={"binary_data_size": st.integers(-1, 40)}))
    return tensor


requests = st.fixed_dictionaries({}, optional={
    "inputs": st.one_of(st.lists(near_valid(), min_size=1, max_size=3), st.lists(st.one_of(near_valid(), tensors),
                                                                                  max_size=3), json_values),
    "outputs": st.one_of(st.none(), json_values, st.lists(st.fixed_dictionaries(
        {"name": st.text(max_size=5)}, optional={"parameters": parameters}), max_size=2)),
    "parameters": parameters, "id": json_values})

def dumps(value: object) -> bytes:
    return json.dumps(value).encode()  # the standard library writes integers of any size (orjson: 64-bit)


LIMITS = TokenLimits(("input_ids", "attention_mask", "token_type_ids"), vocab_size=100, max_type_id=1,
                     max_length=16, max_inputs=8, truncate=True)


def decode_all_the_way(body: bytes, header_length: str | None = None) -> None:
    """What the server does with a body before batching: decode, then the task's or the
    pre-tokenized checks (every task's, since the fuzzer does not know the model)."""
    try:
        request = codec.decode_request(body, header_length, "m")
    except KilnError:
        return
    if is_tokenized(request.inputs):
        try:
            token_rows(request.inputs, LIMITS, "m")
        except KilnError:
            pass
        return
    for task in TASKS.values():
        try:
            task.inputs_from_tensors(request.inputs)
        except KilnError:
            pass


@settings(max_examples=int(os.environ.get("KILN_FUZZ_EXAMPLES", 400)), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests)
def test_any_json_infer_request_is_decoded_or_refused(request):
    decode_all_the_way(dumps(request))


@settings(max_examples=200, deadline=None)
@given(requests, st.binary(max_size=64), st.one_of(st.none(), st.integers(-5, 400).map(str), st.text(max_size=4)))
def test_binary_extension_bodies_are_decoded_or_refused(request, binary, header_length):
    header = dumps(request)
    decode_all_the_way(header + binary, header_length if header_length is not None else str(len(header)))


@settings(max_examples=200, deadline=None)
@given(st.one_of(json_values, st.fixed_dictionaries({}, optional={
    "inputs": json_values, "parameters": json_values, "model": json_values, "input": json_values,
    "encoding_format": json_values, "dimensions": json_values})))
def test_predict_and_embeddings_bodies_are_decoded_or_refused(payload):
    body = dumps(payload)
    for decode in (lambda: json_api.decode_predict(body, "m", None), lambda: json_api.decode_embeddings(body)):
        try:
            decoded = decode()
        except KilnError:
            continue
        if isinstance(decoded, json_api.PredictRequest):
            for task in TASKS.values():
                try:
                    task(manifest=None).prepare(decoded.inputs)  # type: ignore[arg-type]
                except KilnError:
                    pass


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(
    st.sampled_from(["input_ids", "attention_mask", "token_type_ids", "other"]),
    st.tuples(st.sampled_from(["int8", "int64", "uint64", "uint8", "float32", "bool"]),
              st.lists(st.integers(0, 3), min_size=1, max_size=3), st.integers(-2**63, 2**64 - 1)),
    min_size=1).filter(lambda d: "input_ids" in d))
def test_pretokenized_rows_are_checked_or_refused(spec):
    import numpy as np

    arrays = {}
    for name, (dtype, shape, value) in spec.items():
        info = np.iinfo(dtype) if np.dtype(dtype).kind in "iu" else None
        fill = min(max(value, info.min), info.max) if info else value % 7
        arrays[name] = np.full(shape, fill).astype(dtype)
    try:
        rows = token_rows(arrays, LIMITS, "m")
    except KilnError:
        return
    for row in rows:  # what reaches a batch is in range, whatever was sent
        assert row.ids.dtype == np.int64 and 0 <= row.ids.min() and row.ids.max() < LIMITS.vocab_size
        assert set(row.attention_mask.tolist()) == {1} and row.type_ids.max() <= LIMITS.max_type_id
        assert 0 < len(row.ids) <= LIMITS.max_length
