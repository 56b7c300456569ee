"""The data plane: the logic behind every model route (OIP infer, /predict, OpenAI embeddings).

Routes parse nothing themselves; they hand the raw body here. Everything runs on the event loop
and is cheap: decoding, ``task.prepare`` (validation), queueing, and shaping answers. Tokenizing
and the model run on the model's batcher thread."""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

import numpy as np
import orjson

from .. import __version__
from ..errors import InvalidInputError, KilnError, ModelNotFoundError, ModelNotReadyError
from ..tasks import tensors as tensors_protocol
from . import codec
from .model import PER_TOKEN_ANSWERS, ServedModel, TokenRow
from .settings import ServeSettings

_TOKEN_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


class DataPlane:
    def __init__(self, models: Mapping[str, ServedModel], settings: ServeSettings):
        self.models = dict(models)
        self.settings = settings

    # -- registry ------------------------------------------------------------------------------
    def ready(self) -> bool:
        return bool(self.models) and all(m.ready for m in self.models.values())

    def model(self, name: str, version: str | None = None, need_ready: bool = True) -> ServedModel:
        model = self.models.get(name)
        if model is None:
            raise ModelNotFoundError(f"unknown model '{name}' (serving: {', '.join(self.models) or 'none'})")
        if version not in (None, "", model.version):
            raise ModelNotFoundError(f"unknown version '{version}' of model '{name}' (versions: {model.version})")
        if need_ready and not model.ready:
            raise ModelNotReadyError(f"model '{name}' is not ready")
        return model

    def server_metadata(self) -> dict[str, Any]:
        return {"name": "modelkiln", "version": __version__, "extensions": ["binary_tensor_data", "statistics"]}

    def model_metadata(self, name: str, version: str | None) -> dict[str, Any]:
        m = self.model(name, version, need_ready=False)
        return {
            "name": m.name,
            "versions": [m.version],
            "platform": "onnxruntime_onnx",
            "inputs": [{"name": n, "datatype": "BYTES", "shape": [-1]} for n in m.text_inputs()],
            "outputs": [{"name": n, "datatype": d, "shape": s} for n, d, s in m.output_specs()],
            "parameters": {"task": m.task.name, "variant": m.variant.name, "max_length": m.manifest.max_length,
                           "tokenized_inputs": list(m.manifest.input_names)},
        }

    def model_stats(self, name: str | None, version: str | None) -> dict[str, Any]:
        models = [self.model(name, version, need_ready=False)] if name else list(self.models.values())
        out = []
        for m in models:
            s = m.stats
            out.append({
                "name": m.name, "version": m.version, "last_inference": s.last_inference_ms,
                "inference_count": s.inference_count, "execution_count": s.execution_count,
                "inference_stats": {
                    "success": {"count": s.success_count, "ns": s.success_ns},
                    "fail": {"count": s.fail_count, "ns": s.fail_ns},
                    "queue": {"count": s.queue_count, "ns": s.queue_ns},
                    "compute_infer": {"count": s.compute_count, "ns": s.compute_ns},
                },
            })
        return {"model_stats": out}

    # -- shared checks --------------------------------------------------------------------------
    def _check_texts(self, texts: list[Any]) -> None:
        if len(texts) > self.settings.max_inputs_per_request:
            raise InvalidInputError(
                f"{len(texts)} inputs in one request; the limit is {self.settings.max_inputs_per_request}")
        limit = self.settings.max_input_chars
        for i, t in enumerate(texts):
            parts = t if isinstance(t, (tuple, list)) else (t,)
            if any(isinstance(p, str) and len(p) > limit for p in parts):
                raise InvalidInputError(f"input {i} is longer than {limit} characters")

    def _timeout(self, parameters: Mapping[str, Any] | None) -> float:
        timeout = self.settings.request_timeout_s
        asked = (parameters or {}).get("timeout")  # Triton: microseconds
        if isinstance(asked, (int, float)) and not isinstance(asked, bool) and asked > 0:
            timeout = min(timeout, asked / 1e6)
        return timeout

    # -- OIP infer ------------------------------------------------------------------------------
    async def infer(self, name: str, version: str | None, body: bytes, header_length: str | None
                    ) -> tuple[bytes, int | None]:
        model = self.model(name, version)
        request = codec.decode_request(body, header_length)
        available = self._output_names(model, request)
        wanted = request.outputs if request.outputs is not None else available
        unknown = [n for n in wanted if n not in available]
        if unknown:
            raise InvalidInputError(f"unknown output {unknown[0]!r} for model '{name}' (outputs: {', '.join(available)})")
        inputs = self._infer_inputs(model, request.inputs)
        answers, _ = await model.run(inputs, self._timeout(request.parameters))
        tensors = self._answer_tensors(model, answers, inputs)
        outputs = {n: tensors[n] for n in wanted}
        binary = set(wanted) if request.binary_default else request.binary_outputs
        return codec.encode_response(model.name, model.version, request.id, outputs, binary)

    def _tokenized(self, request_inputs: Mapping[str, np.ndarray]) -> bool:
        return "input_ids" in request_inputs

    def _output_names(self, model: ServedModel, request: codec.InferRequest) -> list[str]:
        if self._tokenized(request.inputs) and model.task.name in PER_TOKEN_ANSWERS:
            return list(model.engine.output_names)
        return [n for n, _, _ in model.output_specs()]

    def _infer_inputs(self, model: ServedModel, tensors: Mapping[str, np.ndarray]) -> list[Any]:
        if self._tokenized(tensors):
            return self._token_rows(model, tensors)
        texts = tensors_protocol.inputs_from_tensors(model.task.name, tensors)
        self._check_texts(texts)
        return model.task.prepare(texts)

    def _token_rows(self, model: ServedModel, tensors: Mapping[str, np.ndarray]) -> list[TokenRow]:
        names = model.manifest.input_names
        extra = [n for n in tensors if n not in names]
        if extra:
            raise InvalidInputError(f"unexpected input {extra[0]!r}: model '{model.name}' takes {', '.join(names)}")
        ids = tensors["input_ids"]
        if ids.ndim != 2 or ids.dtype.kind not in "iu":
            raise InvalidInputError("input_ids must be an integer tensor of shape [n, seq]")
        arrays = {}
        for n in _TOKEN_INPUTS:
            a = tensors.get(n)
            if a is None:
                a = np.ones_like(ids) if n == "attention_mask" else np.zeros_like(ids)
            if a.shape != ids.shape or a.dtype.kind not in "iu":
                raise InvalidInputError(f"{n} must be an integer tensor shaped like input_ids {list(ids.shape)}")
            arrays[n] = a.astype(np.int64, copy=False)
        if ids.shape[0] > self.settings.max_inputs_per_request:
            raise InvalidInputError(
                f"{ids.shape[0]} inputs in one request; the limit is {self.settings.max_inputs_per_request}")
        rows = []
        limit = model.manifest.max_length
        for r in range(ids.shape[0]):
            n = int(arrays["attention_mask"][r].sum())  # right padding: real tokens come first
            if n == 0:
                raise InvalidInputError(f"input {r} has no tokens (attention_mask is all zero)")
            if n > limit:
                if not self.settings.truncate:
                    raise InvalidInputError(f"input {r} has {n} tokens; model '{model.name}' takes at most {limit}")
                n = limit
            rows.append(TokenRow(arrays["input_ids"][r, :n], arrays["attention_mask"][r, :n],
                                 arrays["token_type_ids"][r, :n]))
        return rows

    def _answer_tensors(self, model: ServedModel, answers: list[Any], inputs: list[Any]
                        ) -> dict[str, tuple[str, np.ndarray]]:
        """Task answers → named OIP tensors (the answers themselves come from task.postprocess)."""
        task = model.task.name
        if answers and isinstance(answers[0], dict) and task in PER_TOKEN_ANSWERS and isinstance(inputs[0], TokenRow):
            return self._raw_tensors(answers)
        tensors = tensors_protocol.tensors_from_answers(task, model.manifest.labels or [], answers)
        return {name: (tensors_protocol.datatype(array), array) for name, array in tensors.items()}

    @staticmethod
    def _raw_tensors(rows: list[dict[str, np.ndarray]]) -> dict[str, tuple[str, np.ndarray]]:
        """Per-row raw model outputs (trimmed to each row's tokens) → padded [n, seq, ...] FP32."""
        out = {}
        width = max(next(iter(r.values())).shape[0] for r in rows)
        for name in rows[0]:
            first = rows[0][name]
            array = np.zeros((len(rows), width, *first.shape[1:]), dtype=np.float32)
            for i, r in enumerate(rows):
                array[i, : r[name].shape[0]] = r[name]
            out[name] = ("FP32", array)
        return out

    # -- /predict --------------------------------------------------------------------------------
    async def predict(self, name: str, version: str | None, body: bytes) -> bytes:
        """``{"inputs": x | [x, ...], "parameters": {...}}`` → the task's answer(s) as JSON.
        One input (a string, a QA/pair object) gives one answer; a list gives a list."""
        model = self.model(name, version)
        payload = codec.loads(body)
        if not isinstance(payload, dict) or "inputs" not in payload:
            raise InvalidInputError('the body must be a JSON object with "inputs"')
        raw = payload["inputs"]
        single = not isinstance(raw, list)
        items = [raw] if single else raw
        items = [_pair(x) for x in items]
        self._check_texts(items)
        params = payload.get("parameters") or {}
        if not isinstance(params, dict):
            raise InvalidInputError("'parameters' must be an object")
        answers, _ = await model.run(model.task.prepare(items), self._timeout(params))
        top_k = params.get("top_k")
        if top_k is not None and model.task.name == "text-classification":
            if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
                raise InvalidInputError("top_k must be a positive integer")
            answers = [a[:top_k] for a in answers]
        return orjson.dumps(answers[0] if single else answers, option=orjson.OPT_SERIALIZE_NUMPY)

    # -- OpenAI /v1/embeddings ------------------------------------------------------------------
    async def embeddings(self, body: bytes, labels: dict | None = None) -> bytes:
        """OpenAI ``/v1/embeddings``. ``labels`` receives the resolved model name (for metrics)."""
        payload = codec.loads(body)
        if not isinstance(payload, dict):
            raise InvalidInputError("the body must be a JSON object")
        model = self._embedding_model(payload.get("model"))
        if labels is not None:
            labels["model"] = model.name
        raw = payload.get("input")
        texts = [raw] if isinstance(raw, str) else raw
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise InvalidInputError("'input' must be a string or a non-empty list of strings (token arrays are not supported)")
        fmt = payload.get("encoding_format") or "float"
        if fmt not in ("float", "base64"):
            raise InvalidInputError("encoding_format must be 'float' or 'base64'")
        self._check_texts(texts)
        vectors, tokens = await model.run(model.task.prepare(texts), self.settings.request_timeout_s)
        dims = payload.get("dimensions")
        if dims is not None and dims != len(vectors[0]):
            raise InvalidInputError(f"model '{model.name}' has {len(vectors[0])} dimensions, not {dims}")
        data = []
        for i, v in enumerate(vectors):
            v = np.asarray(v, dtype=np.float32)
            emb: Any = base64.b64encode(v.astype("<f4").tobytes()).decode() if fmt == "base64" else v
            data.append({"object": "embedding", "index": i, "embedding": emb})
        return orjson.dumps({"object": "list", "data": data, "model": model.name,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}},
                            option=orjson.OPT_SERIALIZE_NUMPY)

    def _embedding_model(self, name: Any) -> ServedModel:
        if isinstance(name, str) and name in self.models:
            model = self.model(name)
        else:
            candidates = [m for m in self.models.values() if m.task.name == "sentence-embeddings"]
            if name is not None or len(candidates) != 1:
                raise ModelNotFoundError(
                    f"unknown embedding model {name!r} (serving: {', '.join(m.name for m in candidates) or 'none'})")
            model = self.model(candidates[0].name)
        if model.task.name != "sentence-embeddings":
            raise InvalidInputError(f"model '{model.name}' is a {model.task.name} model, not an embedding model")
        return model


def _pair(x: Any) -> Any:
    """``{"text", "text_pair"}`` → a (text, pair) tuple; everything else is left to task.prepare."""
    if isinstance(x, dict) and "text" in x:
        return (x.get("text"), x.get("text_pair")) if "text_pair" in x else x.get("text")
    return x


__all__ = ["DataPlane", "KilnError"]
