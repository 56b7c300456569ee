"""The two JSON APIs beside the Open Inference Protocol: ``/v2/models/{m}/predict`` (the task's
own answers) and OpenAI's ``/v1/embeddings``. Their typed requests and responses, and the JSON
codec that turns HTTP bodies into them and back (the data plane sees only the typed objects)."""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from ...errors import InvalidInputError
from ..codec import loads
from ..types import Parameters


@dataclass
class PredictRequest:
    model_name: str
    model_version: str | None
    inputs: list[Any]  # strings, (text, pair) tuples, {"question", "context"} objects: task.prepare checks them
    single: bool = False  # one input given bare (not in a list): answer it bare
    parameters: Parameters = field(default_factory=dict)  # timeout (µs, as Triton), top_k, ...


@dataclass
class PredictResponse:
    model_name: str
    answers: list[Any]
    single: bool = False


@dataclass
class EmbeddingsRequest:
    model: str | None  # None: the one embedding model served, if there is exactly one
    inputs: list[str]
    encoding_format: str = "float"  # float | base64
    dimensions: int | None = None


@dataclass
class EmbeddingsResponse:
    model_name: str
    vectors: list[np.ndarray]
    prompt_tokens: int
    encoding_format: str = "float"


# --- /predict ------------------------------------------------------------------------------------
def decode_predict(body: bytes, model_name: str, model_version: str | None) -> PredictRequest:
    """``{"inputs": x | [x, ...], "parameters": {...}}``; ``{"text", "text_pair"}`` objects become pairs."""
    payload = loads(body)
    if not isinstance(payload, dict) or "inputs" not in payload:
        raise InvalidInputError('the body must be a JSON object with "inputs"')
    raw = payload["inputs"]
    single = not isinstance(raw, list)
    items = [_pair(x) for x in ([raw] if single else raw)]
    params = payload.get("parameters")
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise InvalidInputError("'parameters' must be an object")
    return PredictRequest(model_name, model_version, items, single, params)


def _pair(x: Any) -> Any:
    """``{"text", "text_pair"}`` → a (text, pair) tuple; everything else is left to task.prepare."""
    if isinstance(x, dict) and "text" in x:
        return (x.get("text"), x.get("text_pair")) if "text_pair" in x else x.get("text")
    return x


def encode_predict(response: PredictResponse) -> bytes:
    answers = response.answers[0] if response.single else response.answers
    return orjson.dumps(answers, option=orjson.OPT_SERIALIZE_NUMPY)


# --- OpenAI /v1/embeddings -----------------------------------------------------------------------
def decode_embeddings(body: bytes) -> EmbeddingsRequest:
    payload = loads(body)
    if not isinstance(payload, dict):
        raise InvalidInputError("the body must be a JSON object")
    model = payload.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidInputError("'model' must be a string")
    raw = payload.get("input")
    texts = [raw] if isinstance(raw, str) else raw
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise InvalidInputError("'input' must be a string or a non-empty list of strings (token arrays are not supported)")
    fmt = payload.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise InvalidInputError("encoding_format must be 'float' or 'base64'")
    dims = payload.get("dimensions")
    if dims is not None and (not isinstance(dims, int) or isinstance(dims, bool) or dims < 1):
        raise InvalidInputError("dimensions must be a positive integer")
    return EmbeddingsRequest(model, texts, fmt, dims)


def encode_embeddings(response: EmbeddingsResponse) -> bytes:
    data = []
    for i, v in enumerate(response.vectors):
        v = np.asarray(v, dtype=np.float32)
        emb: Any = base64.b64encode(v.astype("<f4").tobytes()).decode() if response.encoding_format == "base64" else v
        data.append({"object": "embedding", "index": i, "embedding": emb})
    tokens = response.prompt_tokens
    return orjson.dumps({"object": "list", "data": data, "model": response.model_name,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}},
                        option=orjson.OPT_SERIALIZE_NUMPY)
