"""Which engine runs a decoder variant: a registry keyed by the variant's ``engine`` (kiln.json),
as text-embeddings-inference picks a backend. ``onnx-serving``: the serving graph
(``engines/onnx/serving.py``: GroupQueryAttention, in-place cache, prefix cache); ``onnx-export``: a graph
from the torch export (``engines/onnx/padded.py``); ``torch``: a PyTorch model on CPU or CUDA
(``engines/torch/engine.py``; imported only when asked, so the ONNX serving path needs no torch).
Artifacts written before the field existed name their graph's kind in its metadata instead."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ...cpus import available_cpus
from ...errors import ArtifactError
from .onnx import graph_io as io
from .onnx.decoder import DecoderSession, open_session
from ..plan import Engine, EngineOptions, ModelShape

if TYPE_CHECKING:
    import onnxruntime as ort

ONNX_SERVING, ONNX_EXPORT, TORCH = "onnx-serving", "onnx-export", "torch"


def graph_kind(session: ort.InferenceSession) -> str:
    """The engine an ONNX decoder graph needs, from its metadata (artifacts without ``engine``)."""
    kind = session.get_modelmeta().custom_metadata_map.get(io.GRAPH_KIND_KEY, "export")
    return ONNX_SERVING if kind == io.SERVING_GRAPH else ONNX_EXPORT


def _open_onnx(path: Path, shape: ModelShape, options: EngineOptions, kind: str | None) -> Engine:
    from .onnx.kiln_attention import KilnAttentionEngine
    from .onnx.padded import PaddedEngine
    from .onnx.serving import ServingEngine

    session = open_session(path, options.device, options.threads, options.memory_arena)
    kind = kind or graph_kind(session)
    if kind == ONNX_SERVING:
        # a graph with KilnAttention takes each token's cache row and position: one call a step
        kiln_attention = io.POSITIONS in {i.name for i in session.get_inputs()}
        engine = KilnAttentionEngine if kiln_attention else ServingEngine
        return engine(session, heads=shape.heads, threads=options.threads or available_cpus().count,
                      max_context=shape.max_context, max_rows=options.max_rows,
                      prefix_cache_tokens=options.prefix_cache_tokens, keep_logits=options.keep_logits)
    return PaddedEngine(DecoderSession(path, device=options.device, session=session), shape.max_context,
                        max_rows=options.max_rows, keep_logits=options.keep_logits)


def _open_torch(path: Path, shape: ModelShape, options: EngineOptions, kind: str | None) -> Engine:
    from .torch.engine import open_torch_engine  # noqa: PLC0415 - torch only for this engine

    return open_torch_engine(path, shape, options)


ENGINES: dict[str, Callable[[Path, ModelShape, EngineOptions, str | None], Engine]] = {
    ONNX_SERVING: _open_onnx, ONNX_EXPORT: _open_onnx, TORCH: _open_torch,
}


def open_engine(path: Path, kind: str | None, shape: ModelShape, options: EngineOptions) -> Engine:
    """The engine of kind ``kind`` on a variant's file; None: an ONNX graph whose metadata says which."""
    opener = ENGINES.get(kind or ONNX_SERVING)
    if opener is None:
        raise ArtifactError(f"unknown engine '{kind}' in kiln.json (known: {', '.join(ENGINES)})")
    return opener(path, shape, options, kind)
