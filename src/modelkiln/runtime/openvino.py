"""The OpenVINO engine for encoder artifacts: the exported ``model.onnx`` compiled by OpenVINO's CPU
plugin, behind the runtime's engine protocol (``run(feeds) -> outputs``, numpy in and out).

OpenVINO reads the ONNX file itself (no IR is written next to it) and picks its own kernels: on a
CPU with AMX or AVX-512 BF16 its bf16 precision hint runs the matrix products on that unit, which
onnxruntime's CPU kernels do not use. A variant names its precision (``fp32`` or ``bf16``); which
one a machine is offered is ``machine.native_bf16``'s decision (convert/artifact.py).

Imports ``openvino`` (the ``openvino`` extra): only ``runtime/registry.py`` opens it, for a variant
whose engine is ``openvino``."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import openvino

from ..cpus import available_cpus
from ..errors import ArtifactError

# kiln's precision names → OpenVINO's inference precision hint
PRECISION_HINTS = {"fp32": "f32", "bf16": "bf16"}


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
    def __init__(self, path: Path | str, precision: str, threads: int | None = None, label: str = ""):
        if precision not in PRECISION_HINTS:
            raise ArtifactError(f"the openvino engine runs {', '.join(PRECISION_HINTS)}, not {precision}")
        try:
            self.compiled = openvino.Core().compile_model(
                str(path), "CPU", compile_config(precision, threads or available_cpus().count))
        except RuntimeError as exc:  # OpenVINO raises RuntimeError for unreadable or unsupported files
            raise ArtifactError(f"openvino cannot load {path}: {str(exc).splitlines()[0]}") from exc
        self.name = label or f"openvino {precision}"
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
        with self._lock:
            # share_outputs off (the default): the results are copies, not the request's buffers,
            # which the next run overwrites
            results = self._request.infer({n: feeds[n] for n in self.input_names})
            return {n: results[port] for n, port in zip(self.output_names, self.compiled.outputs)}
