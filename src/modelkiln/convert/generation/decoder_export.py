"""Exporting a causal LM with its KV cache to one ONNX graph, with torch's own exporter: the graph
for the architectures the serving graph (``serving_graph.py``) does not cover.

transformers 5 keeps the cache in a ``DynamicCache`` object, which the exporter cannot take as an
input; the wrapper below turns it into flat tensors in (``past_key_values.{i}.key/.value``) and out
(``present.{i}.key/.value``), named as the engine reads them (``generation/engines/onnx/graph_io.py``).

One graph serves prefill and decode (past length 0 for a prefill): the engine's chunked prefill
needs a past in the prefill graph anyway, and a decode graph with its sequence axis fixed to 1
decoded no faster (×0.99 in interleaved rounds)."""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Iterator

from ...generation.engines.onnx.graph_io import (ATTENTION_MASK, INPUT_IDS, LOGITS, POSITION_IDS, past_key_name, past_value_name,
                                 present_key_name, present_value_name)

log = logging.getLogger(__name__)

# Opset 23 is the first with the operators a decoder is made of: torch's exporter writes
# ``scaled_dot_product_attention`` as one ``Attention`` node (grouped-query heads included),
# transformers' rotary embedding as ``RotaryEmbedding`` and ``rms_norm`` as ``RMSNormalization``.
# Below 23 each of them is decomposed into dozens of small nodes per layer (masking with
# Where/IsNaN, repeat_kv's Expand/Reshape copies, rotate_half's Slice/Neg/Concat), which made the
# SmolLM2 decode step 2.7× slower than PyTorch on 2 threads (docs/generation.md has the profile).
DECODER_OPSET = 23

# The exporter's symbolic axis limits; ONNX Runtime does not enforce them, they only keep torch's
# shape reasoning from specialising an axis to the example's size.
_MAX_BATCH, _MAX_SEQ = 1024, 32768


@dataclass(frozen=True)
class DecoderShape:
    """What the graph's cache looks like: read from the config, checked against the exported graph."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def of(cls, config: Any) -> DecoderShape:
        cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = int(cfg.num_attention_heads)
        kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        return cls(int(cfg.num_hidden_layers), heads, kv, head_dim, int(cfg.vocab_size))

    @property
    def input_names(self) -> list[str]:
        return [INPUT_IDS, ATTENTION_MASK, POSITION_IDS, *self.past_names]

    @property
    def past_names(self) -> list[str]:
        return [n for i in range(self.layers) for n in (past_key_name(i), past_value_name(i))]

    @property
    def output_names(self) -> list[str]:
        return [LOGITS, *[n for i in range(self.layers) for n in (present_key_name(i), present_value_name(i))]]


def cache_wrapper(model: Any, shape: DecoderShape) -> Any:
    """``model`` as a module taking and returning the cache as flat tensors."""
    import torch
    from transformers import DynamicCache

    class FlatCacheDecoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, position_ids, *past):
            cache = DynamicCache(config=self.model.config)
            for i in range(shape.layers):
                cache.update(past[2 * i], past[2 * i + 1], i)
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=cache, use_cache=True)
            flat = [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
            return (out.logits, *flat)

    return FlatCacheDecoder().eval()


def export_decoder(model: Any, path: Path) -> DecoderShape:
    """Write ``path`` (weights in ``path.data`` beside it). Dynamic batch, sequence and past axes."""
    import torch
    from torch.export import Dim

    shape = DecoderShape.of(model.config)
    batch, seq, past = 2, 3, 4  # distinct sizes, none 0 or 1, so no axis gets specialised
    args = (torch.randint(0, shape.vocab, (batch, seq)), torch.ones(batch, past + seq, dtype=torch.long),
            torch.arange(past, past + seq).expand(batch, seq),
            *[torch.randn(batch, shape.kv_heads, past, shape.head_dim) for _ in shape.past_names])
    d_batch, d_seq = Dim("batch", max=_MAX_BATCH), Dim("seq", max=_MAX_SEQ)
    d_past, d_total = Dim("past", max=_MAX_SEQ), Dim("total", max=2 * _MAX_SEQ)
    dynamic = {"input_ids": {0: d_batch, 1: d_seq}, "attention_mask": {0: d_batch, 1: d_total},
               "position_ids": {0: d_batch, 1: d_seq}, "past": tuple({0: d_batch, 2: d_past} for _ in shape.past_names)}
    with warnings.catch_warnings(), torch.no_grad(), _sdpa_grouped_query_heads():
        warnings.simplefilter("ignore")  # the exporter warns about every axis it renames
        torch.onnx.export(cache_wrapper(model, shape), args, str(path), input_names=shape.input_names,
                          output_names=shape.output_names, dynamic_shapes=dynamic, dynamo=True, optimize=True,
                          opset_version=DECODER_OPSET, external_data=True, verbose=False)
    return shape


@contextlib.contextmanager
def _sdpa_grouped_query_heads() -> Iterator[None]:
    """transformers repeats the KV heads up to the query heads (``repeat_kv``: an Expand and a
    Reshape copy of the whole cache per layer and step) before SDPA whenever a mask is given,
    because CUDA's fused kernels cannot take both. ONNX's ``Attention`` takes fewer KV heads than
    query heads and a mask, so the export asks transformers for SDPA's own ``enable_gqa`` instead
    (its documented switch, read at call time)."""
    previous = os.environ.get(_FORCE_GQA)
    os.environ[_FORCE_GQA] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(_FORCE_GQA, None)
        else:
            os.environ[_FORCE_GQA] = previous


_FORCE_GQA = "TRANSFORMERS_SDPA_FORCE_GQA"
