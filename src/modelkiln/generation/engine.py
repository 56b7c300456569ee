"""Opening the right engine for a decoder graph: ``ServingEngine`` for the serving graph
(GroupQueryAttention, in-place cache; convert/serving_graph.py), ``PaddedEngine`` for a graph from
the torch export (convert/decoder_export.py). Both answer the calls the engine core makes
(``core.Engine``); which one a graph needs is written in its metadata (``graph_io.GRAPH_KIND_KEY``)."""

from __future__ import annotations

from pathlib import Path

from ..cpus import available_cpus
from . import graph_io as io
from .core import DEFAULT_MAX_RUNNING, Engine
from .decoder import DecoderSession, open_session
from .padded_engine import PaddedEngine
from .prefix_cache import DEFAULT_MAX_TOKENS
from .serving_engine import ServingEngine


def graph_kind(session) -> str:  # type: ignore[no-untyped-def]
    return session.get_modelmeta().custom_metadata_map.get(io.GRAPH_KIND_KEY, "export")


def open_engine(path: Path | str, *, heads: int, max_context: int | None, threads: int | None = None,
                device: str = "cpu", max_rows: int = DEFAULT_MAX_RUNNING, memory_arena: bool = True,
                prefix_cache_tokens: int = DEFAULT_MAX_TOKENS) -> Engine:
    """``heads``: the model's attention heads (the serving engine keeps rows × heads ≥ threads);
    ``max_rows``: the most sequences decoding together; ``prefix_cache_tokens``: the most tokens of
    prompt-prefix KV kept for the prompts that follow (serving graph only; 0: none)."""
    session = open_session(path, device, threads, memory_arena)
    if graph_kind(session) == io.SERVING_GRAPH:
        return ServingEngine(session, heads=heads, threads=threads or available_cpus().count,
                             max_context=max_context, max_rows=max_rows, prefix_cache_tokens=prefix_cache_tokens)
    return PaddedEngine(DecoderSession(path, device=device, session=session), max_context)
