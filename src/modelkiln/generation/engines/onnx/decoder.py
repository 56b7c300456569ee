"""One forward pass of an exported decoder graph (the torch export, convert/generation/decoder_export.py) in
ONNX Runtime; the KV cache it returns is the next pass's input as it is. The padded engine
(``engines/onnx/padded.py``) drives it; the serving graph has its own engine (``engines/onnx/serving.py``).

The graph (names in ``engines/onnx/graph_io.py``) takes ``input_ids``, ``attention_mask`` [batch, past + seq],
``position_ids`` and per layer ``past_key_values.{i}.key/.value`` [batch, kv_heads, past, head_dim];
it returns ``logits`` and ``present.{i}.key/.value`` [batch, kv_heads, past + seq, head_dim]. The
graph's own Concat of past and new token copies the cache every step (the serving graph writes it
in place instead). On CPU the present arrays come back as numpy without a copy (onnxruntime 1.32
hands its buffers to numpy); on CUDA, OrtValues keep the cache on the device."""


from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from ....errors import ArtifactError
from ....runtime.onnx import PROVIDERS, session_options
from .graph_io import INPUT_IDS, ATTENTION_MASK, POSITION_IDS, LOGITS, past_key_name, past_value_name, present_key_name, present_value_name

# 2 × layers tensors, key then value per layer: [batch, kv_heads, past, head_dim]: numpy arrays, or
# OrtValues with ``io_binding``.
Past = list

_NUMPY_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
                 "tensor(int32)": np.int32}


def open_session(path: Path | str, device: str = "cpu", threads: int | None = None,
                 memory_arena: bool = True) -> ort.InferenceSession:
    if device not in PROVIDERS:
        raise ArtifactError(f"unknown device '{device}' (choose from {', '.join(PROVIDERS)})")
    try:
        return ort.InferenceSession(str(path), session_options(threads, memory_arena), providers=list(PROVIDERS[device]))
    except Exception as exc:  # onnxruntime raises its own untyped errors for bad files
        raise ArtifactError(f"cannot load {path}: {exc}") from exc


class DecoderSession:
    """The decoder graph and what its inputs say about the model (layers, KV heads, head size)."""

    def __init__(self, path: Path | str, device: str = "cpu", threads: int | None = None,
                 io_binding: bool | None = None, memory_arena: bool = True,
                 session: ort.InferenceSession | None = None):
        """``session``: the graph already loaded (``engine.open_engine`` reads its kind first)."""
        self.session = session or open_session(path, device, threads, memory_arena)
        inputs = {i.name: i for i in self.session.get_inputs()}
        for required in (INPUT_IDS, ATTENTION_MASK, POSITION_IDS, past_key_name(0)):
            if required not in inputs:
                raise ArtifactError(f"{path} is not a decoder with a KV cache (no input '{required}')")
        self.layers = sum(1 for name in inputs if name.startswith("past_key_values.") and name.endswith(".key"))
        _, self.kv_heads, _, self.head_dim = inputs[past_key_name(0)].shape
        self.cache_dtype = _NUMPY_DTYPES[inputs[past_key_name(0)].type]
        self._int_dtypes = {n: _NUMPY_DTYPES[inputs[n].type] for n in (INPUT_IDS, ATTENTION_MASK, POSITION_IDS)}
        self.past_names = [n for i in range(self.layers) for n in (past_key_name(i), past_value_name(i))]
        self.present_names = [n for i in range(self.layers) for n in (present_key_name(i), present_value_name(i))]
        self.output_names = [LOGITS, *self.present_names]
        self.io_binding = device != "cpu" if io_binding is None else io_binding
        self.device = device

    def empty_past(self, batch: int = 1) -> Past:
        empty = np.zeros((batch, self.kv_heads, 0, self.head_dim), dtype=self.cache_dtype)
        return self.past_from_numpy([empty] * len(self.past_names))

    def past_to_numpy(self, past: Past) -> list[np.ndarray]:
        return [v.numpy() for v in past] if self.io_binding else list(past)

    def past_from_numpy(self, arrays: list[np.ndarray]) -> Past:
        arrays = [np.ascontiguousarray(a, dtype=self.cache_dtype) for a in arrays]
        return [ort.OrtValue.ortvalue_from_numpy(a) for a in arrays] if self.io_binding else arrays

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
                past: Past) -> tuple[np.ndarray, Past]:
        """One pass: logits [batch, seq, vocab] as numpy, and the present cache as OrtValues."""
        feeds = {
            INPUT_IDS: input_ids.astype(self._int_dtypes[INPUT_IDS], copy=False),
            ATTENTION_MASK: attention_mask.astype(self._int_dtypes[ATTENTION_MASK], copy=False),
            POSITION_IDS: position_ids.astype(self._int_dtypes[POSITION_IDS], copy=False),
        }
        if not self.io_binding:
            logits, *present = self.session.run(self.output_names, dict(feeds, **dict(zip(self.past_names, past))))
            return logits, present
        values = {n: ort.OrtValue.ortvalue_from_numpy(a) for n, a in feeds.items()}
        values.update(zip(self.past_names, past))
        logits, *present = self.session.run_with_ort_values(self.output_names, values)
        return logits.numpy(), present

