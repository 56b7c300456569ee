"""Open Inference Protocol ``infer`` on a text-generation model: a BYTES ``text_input`` in, the whole
answer as a BYTES ``text_output`` (the task contract: ``tasks/text_generation.py``); sampling
settings are request parameters (``max_tokens``, ``temperature``... see ``params.py``). gRPC's
ModelInfer comes here through the data plane; ModelStreamInfer streams the same request."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any
from ...errors import InvalidInputError
from ...tasks import text_generation as contract
from ..types import InferRequest, InferResponse, OutputTensor
from .model import GenerationModel, Stream


def _check_outputs(request: InferRequest) -> None:
    for out in request.outputs or ():
        if out.name != contract.TEXT_OUTPUT:
            raise InvalidInputError(f"unknown output {out.name!r} for a text-generation model "
                                    f"(outputs: {contract.TEXT_OUTPUT})")


_FLOATS = ("temperature", "top_p", "repetition_penalty", "frequency_penalty", "presence_penalty")


def _fields(parameters: dict[str, Any]) -> dict[str, Any]:
    """Request parameters as sampling fields. tritonclient's gRPC parameters take bool, int and
    str only, so a float may come as a string ("0.7"); vLLM's Triton backend takes them all as one
    JSON string, ``sampling_parameters``, which is accepted too."""
    fields = dict(parameters)
    packed = fields.pop("sampling_parameters", None)
    if packed is not None:
        try:
            unpacked = json.loads(packed) if isinstance(packed, str) else None
        except json.JSONDecodeError:
            unpacked = None
        if not isinstance(unpacked, dict):
            raise InvalidInputError("'sampling_parameters' must be a JSON object in a string")
        fields.update(unpacked)
    for name in _FLOATS:
        if isinstance(fields.get(name), str):
            try:
                fields[name] = float(fields[name])
            except ValueError:
                raise InvalidInputError(f"'{name}' must be a number, got {fields[name]!r}") from None
    if isinstance(fields.get("stop"), str) and fields["stop"].startswith("["):
        try:  # a list of stop strings, as JSON
            fields["stop"] = json.loads(fields["stop"])
        except json.JSONDecodeError:
            pass  # then it is one stop string that starts with "["
    return fields


def start(model: GenerationModel, request: InferRequest) -> Stream:
    """The request checked and submitted: its deltas (raises a 4xx/503 error before any)."""
    _check_outputs(request)
    prompt = contract.prompt_from_tensors(request.inputs)
    ids = model.prompt_ids(prompt)
    params = model.params(_fields(request.parameters), len(ids))
    return model.generate(ids, params, model.timeout(request.parameters))


def response(model: GenerationModel, request: InferRequest, text: str, parameters: dict | None = None
             ) -> InferResponse:
    return InferResponse(model.name, model.version,
                         [OutputTensor(contract.TEXT_OUTPUT, "BYTES", contract.output_tensor(text))],
                         id=request.id, parameters=parameters or {})


async def generation_infer(model: GenerationModel, request: InferRequest) -> InferResponse:
    started = time.perf_counter()
    try:
        async with start(model, request) as stream:
            pieces = [delta.text async for delta in stream]
    except BaseException:
        model.record(False, time.perf_counter() - started)
        raise
    model.record(True, time.perf_counter() - started)
    return response(model, request, "".join(pieces), {"finish_reason": stream.finish_reason or ""})


async def generation_stream(model: GenerationModel, request: InferRequest) -> AsyncIterator[InferResponse]:
    """Triton's decoupled responses: one per token that adds text, the last flagged
    ``triton_final_response`` (with ``finish_reason``); closing early cancels the generation."""
    started = time.perf_counter()
    ok = False
    try:
        async with start(model, request) as stream:
            async for delta in stream:
                if delta.finish_reason is not None:
                    yield response(model, request, delta.text, {"triton_final_response": True,
                                                                "finish_reason": delta.finish_reason})
                elif delta.text:
                    yield response(model, request, delta.text, {"triton_final_response": False})
        ok = True
    finally:
        model.record(ok, time.perf_counter() - started)
