"""The OpenVINO engine for encoder artifacts: the exported ``model.onnx`` (fp32, bf16) or NNCF's
int8 IR (``model.openvino-int8.xml``) compiled by OpenVINO's CPU plugin, behind the runtime's engine
protocol (``run(feeds) -> outputs``, numpy in and out).

OpenVINO reads the ONNX file itself and picks its own kernels: on a CPU with AMX or AVX-512 BF16
its bf16 precision hint runs the matrix products on that unit, and its int8 products run on AMX's
tiles or VNNI, which onnxruntime's kernels for kiln's int8 do not use. A variant names its
precision (``fp32``, ``bf16`` or ``int8``); which ones a machine is offered is
``convert/artifact.openvino_offered``'s decision.

Imports ``openvino`` (the ``openvino`` extra): only ``runtime/registry.py`` opens it, for a variant
whose engine is ``openvino``."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import openvino

from ..cpus import available_cpus
from ..errors import ArtifactError

# kiln's precision names → OpenVINO's inference precision hint. An int8 variant is an IR whose
# quantize nodes NNCF placed (convert/variants.py): OpenVINO runs the products they feed in int8
# whatever the hint, which sets the precision of the rest (softmax, normalization, the products
# NNCF leaves in float): f32, so that only the calibrated quantization moves the answers.
PRECISION_HINTS = {"fp32": "f32", "bf16": "bf16", "int8": "f32"}
# Rows run padded to a multiple of this many tokens (OpenVinoEngine.run). STS-B sentences (16 tokens on
# average) in batches of 4, all-MiniLM-L6-v2 int8, 1 thread, AMD EPYC Zen 5: 1.19-1.20 ms a text at 16,
# 1.24-1.27 at 8, 1.53-1.76 at each exact length; onnxruntime int8 1.18-1.23
# (benchmarks/encoders/openvino_shapes.py).
BUCKET = 16


def compile_config(precision: str, threads: int) -> dict[str, object]:
    """One stream of ``threads`` threads, tuned for latency: one request at a time, as kiln's
    engine instances run (the server runs instances side by side, each with its own threads).
    Pinning off: OpenVINO pins each compiled model's threads to cores of its own choosing, and two
    instances in one process would be pinned to the same cores."""
    return {
        "INFERENCE_PRECISION_HINT": PRECISION_HINTS[precision],
        "INFERENCE_NUM_THREADS": threads,
        "NUM_STREAMS": 1,
        "PERFORMANCE_HINT": "LATENCY",
        "ENABLE_CPU_PINNING": False,
    }


class OpenVinoEngine:
    def __init__(self, path: Path | str, precision: str, threads: int | None = None, label: str = "",
                 pad_id: int = 0, max_length: int = 0):
        if precision not in PRECISION_HINTS:
            raise ArtifactError(f"the openvino engine runs {', '.join(PRECISION_HINTS)}, not {precision}")
        core = openvino.Core()
        # Weights read, not mapped (OpenVINO maps an IR's .bin and an ONNX file's external data by
        # default): a mapped file truncated under a running server (an artifact copied over in place)
        # stops the process with SIGBUS.
        core.set_property({"ENABLE_MMAP": False})
        try:
            self.compiled = core.compile_model(str(path), "CPU", compile_config(precision, threads or available_cpus().count))
        except RuntimeError as exc:  # OpenVINO raises RuntimeError for unreadable or unsupported files
            raise ArtifactError(f"openvino cannot load {path}: {str(exc).splitlines()[0]}") from exc
        self.name = label or f"openvino {precision}"
        # what run() pads rows with, and the widest bucket (the model's max length: no row is longer)
        self.pad_id, self.max_length = pad_id, max_length
        self.input_names = [port.get_any_name() for port in self.compiled.inputs]
        self.output_names = [port.get_any_name() for port in self.compiled.outputs]
        self.output_shapes = {
            port.get_any_name(): tuple(d.get_length() if d.is_static else -1 for d in port.get_partial_shape())
            for port in self.compiled.outputs}
        # One request, reused: it keeps its buffers between runs. A request runs one inference at a
        # time, so callers on several threads (an onnxruntime session allows it) take turns.
        self._request = self.compiled.create_infer_request()
        self._lock = threading.Lock()

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Each row runs padded to its length's bucket (a multiple of BUCKET), with the rows of the same
        bucket, whatever batch it came in. OpenVINO's kernels give a row other bits when its batch is
        padded to another width (each layer's fused attention, the Snippets MHA subgraph: 15 of 24
        texts moved at +8 padding in fp32, and int8 turns such last-bit moves into whole quantization
        steps), never when only the batch size differs (24 of 24 texts the same alone and repeated 3
        and 8 times): so a text's answer is the same alone as in any batch. Buckets rather than exact
        lengths: each change of input shape costs OpenVINO's CPU plugin ~0.45-0.5 ms (it prepares its
        kernels again), more than the padding to a multiple of 16 costs."""
        lengths = _real_lengths(feeds)
        if lengths is None:
            return self._infer(feeds)
        batch, width = lengths.shape[0], next(iter(feeds.values())).shape[1]
        buckets = -(-lengths // BUCKET) * BUCKET
        if self.max_length:  # never wider than the model reads (and never a width this batch decides)
            buckets = np.minimum(buckets, self.max_length)
        merged: dict[str, np.ndarray] = {}
        for bucket in np.unique(buckets):
            rows = np.flatnonzero(buckets == bucket)
            part = self._infer({n: _to_width(v[rows], int(bucket), self.pad_id if n == "input_ids" else 0)
                                for n, v in feeds.items()})
            for name, value in part.items():
                per_token = self.output_shapes[name][1:2] == (-1,)  # (batch, tokens, ...); else (batch, ...)
                if name not in merged:
                    shape = (batch, width, *value.shape[2:]) if per_token else (batch, *value.shape[1:])
                    merged[name] = np.empty(shape, value.dtype)
                merged[name][rows] = _to_width(value, width, 0) if per_token else value
        real = np.arange(width) < lengths[:, None]
        for name, value in merged.items():
            if self.output_shapes[name][1:2] == (-1,):
                value[~real] = 0  # padded positions: zeros, whatever bucket computed them
        return merged

    def _infer(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with self._lock:
            # share_outputs off (the default): the results are copies, not the request's buffers,
            # which the next run overwrites
            results = self._request.infer({n: feeds[n] for n in self.input_names})
            return {n: results[port] for n, port in zip(self.output_names, self.compiled.outputs)}


def _to_width(array: np.ndarray, width: int, fill: int) -> np.ndarray:
    """``array`` (rows, tokens, ...) cut or padded with ``fill`` to ``width`` tokens."""
    if array.shape[1] >= width:
        return array[:, :width]
    pad = [(0, 0), (0, width - array.shape[1])] + [(0, 0)] * (array.ndim - 2)
    return np.pad(array, pad, constant_values=fill)


def _real_lengths(feeds: dict[str, np.ndarray]) -> np.ndarray | None:
    """Each row's real length where the attention mask is a run of ones then zeros (kiln pads on
    the right); None where there is no mask, or a mask of another form (run as given)."""
    mask = feeds.get("attention_mask")
    if mask is None or mask.ndim != 2:
        return None
    lengths = mask.sum(axis=1)
    prefix = np.arange(mask.shape[1]) < lengths[:, None]
    return lengths if np.array_equal(mask != 0, prefix) and lengths.min() > 0 else None
