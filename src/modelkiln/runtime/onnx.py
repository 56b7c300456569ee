"""ONNX Runtime engine: the only engine on the serving path."""

from __future__ import annotations

import os
import threading
import weakref
from pathlib import Path

import numpy as np
import onnxruntime as ort

from ..errors import ArtifactError
from ..manifest import weights_file

# execution providers by device, in the order onnxruntime should try them
PROVIDERS = {
    "cpu": ["CPUExecutionProvider"],
    "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"],
    "tensorrt": ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"],
}


def cuda_available() -> bool:
    return "CUDAExecutionProvider" in ort.get_available_providers()


def session_options(threads: int | None, memory_arena: bool = True) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads:
        options.intra_op_num_threads = threads
    # One graph branch at a time: transformer graphs are a single chain, and a second pool of
    # threads only competes with the intra-op pool on small machines.
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    # The CPU arena keeps its high-water mark for the life of the session. A long-running server
    # turns it off (see serve/model.py); short-lived processes (bench, convert) keep the default.
    options.enable_cpu_mem_arena = memory_arena
    register_native_ops(options)
    return options


def register_native_ops(options: ort.SessionOptions) -> None:
    """kiln's own operators (native/: GGUF K-quant blocks), where the library was built: a graph
    converted with them needs them, any other graph ignores them."""
    from ..native import library, library_path

    path = library_path()
    if path:
        library()  # held by kiln first, so that what registering finds outlives these options (native.library)
        options.register_custom_ops_library(path)


# A graph's weights file (FILE.data beside it, as kiln convert writes every ONNX variant), read once per
# process and given to each session of that graph in memory, which onnxruntime then uses as it is
# (``use_external_initializer_file_buffers_directly``): the sessions a server runs on one variant (its
# instances, the lone-request session) share one copy (all-MiniLM-L6-v2 int8 served with the defaults:
# 344 MiB with the weights inline in the graph, 246 so; benchmarks/results/serve-memory/). Read, not
# mapped: onnxruntime's own loading maps the file, and a process whose mapped file is truncated (an
# artifact copied over in place) dies (SIGBUS). Kept while an engine holds it.
_weights: weakref.WeakValueDictionary[tuple[str, int, int], np.ndarray] = weakref.WeakValueDictionary()
_weights_lock = threading.Lock()


def shared_weights(graph: Path) -> np.ndarray | None:
    """The bytes of ``graph``'s weights file, one buffer per file version in this process; None where
    the graph has its weights inline."""
    data = weights_file(graph)
    try:
        stat = data.stat()
    except FileNotFoundError:
        return None
    key = (os.path.realpath(data), stat.st_size, stat.st_mtime_ns)
    with _weights_lock:
        buffer = _weights.get(key)
        if buffer is None:
            buffer = _weights[key] = np.fromfile(data, dtype=np.uint8)
        return buffer


class OnnxEngine:
    def __init__(
        self,
        path: Path | str,
        device: str = "cpu",
        threads: int | None = None,
        label: str = "",
        provider_options: dict | None = None,
        memory_arena: bool = True,
    ):
        if device not in PROVIDERS:
            raise ArtifactError(f"unknown device '{device}' (choose from {', '.join(PROVIDERS)})")
        providers: list = list(PROVIDERS[device])
        if provider_options:
            providers[0] = (providers[0], provider_options)
        options = session_options(threads, memory_arena)
        self._weights = shared_weights(Path(path)) if device == "cpu" else None  # held for the session's life
        if self._weights is not None:
            options.add_external_initializers_from_files_in_memory([weights_file(Path(path)).name], [self._weights],
                                                                   [self._weights.nbytes])
            options.add_session_config_entry("session.use_external_initializer_file_buffers_directly", "1")
        try:
            self.session = ort.InferenceSession(str(path), options, providers=providers)
        except Exception as exc:  # onnxruntime raises its own untyped errors for bad files
            raise ArtifactError(f"cannot load {path}: {exc}") from exc
        self.name = label or f"onnxruntime-{device}"
        self.device = device
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]
        # each output's shape, -1 where dynamic (serve's model metadata sizes its answers by them)
        self.output_shapes = {o.name: tuple(d if isinstance(d, int) else -1 for d in o.shape)
                              for o in self.session.get_outputs()}

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        values = self.session.run(self.output_names, {n: feeds[n] for n in self.input_names})
        return dict(zip(self.output_names, values))
