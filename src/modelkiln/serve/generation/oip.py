"""Open Inference Protocol ``infer`` on a text-generation model, the wire side: a BYTES
``text_input`` in, the answer as a BYTES ``text_output`` (the task contract:
``tasks/text_generation.py``); sampling settings are request parameters (``max_tokens``,
``temperature``... see ``params.py``). ``GenerationModel.infer`` and ``stream_infer`` (OIP infer,
gRPC's ModelInfer and ModelStreamInfer) read requests and write responses with these."""

from __future__ import annotations

import json
from typing import Any

from ...errors import InvalidInputError
from ...generation.request.settings import FLOAT_NAMES
from ...tasks import text_generation as contract
from ..types import InferRequest, InferResponse, OutputTensor


def _check_outputs(request: InferRequest) -> None:
    for out in request.outputs or ():
        if out.name != contract.TEXT_OUTPUT:
            raise InvalidInputError(f"unknown output {out.name!r} for a text-generation model "
                                    f"(outputs: {contract.TEXT_OUTPUT})")




def sampling_fields(parameters: dict[str, Any]) -> dict[str, Any]:
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
    for name in FLOAT_NAMES:
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


def prompt(request: InferRequest) -> str:
    """The request's one prompt (its requested outputs checked first)."""
    _check_outputs(request)
    return contract.prompt_from_tensors(request.inputs)


def response(name: str, version: str, request: InferRequest, text: str, parameters: dict | None = None
             ) -> InferResponse:
    return InferResponse(name, version, [OutputTensor(contract.TEXT_OUTPUT, "BYTES", contract.output_tensor(text))],
                         id=request.id, parameters=parameters or {})
