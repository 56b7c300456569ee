"""The decoder graph built for serving: written node by node from a Llama-family model's weights
with onnxruntime's contrib ops, the layout onnxruntime-genai's model builder uses on CPU.

Per layer:

    h   = SkipSimplifiedLayerNormalization(previous output, residual)     (RMSNorm and the residual add, one op)
    qkv = MatMul(h, W_qkv)                                                (q, k and v projections fused)
    a   = GroupQueryAttention(qkv, past_k, past_v, seqlens_k, ...)        (rotary inside; each row over its own length)
    h   = SkipSimplifiedLayerNormalization(a · W_o, residual)
    gu  = MatMul(h, W_gate_up); out = (silu(gate) * up) · W_down          (gate and up projections fused)

and after the last layer the final norm, then ``lm_head`` for the positions asked for only
(``logit_positions``, indices into the call's tokens flattened row by row: each row's last one for
a prefill, every one for a perplexity, one per row for a decode step).

Why this graph and not the torch export (``decoder_export.py``, kept for the architectures this
builder does not cover): ``GroupQueryAttention`` reduces each row over that row's own length
(``seqlens_k``), in a fixed order, whatever the other rows in the call are, so a sequence's
logits do not depend on its batch; and its KV cache is one preallocated buffer per layer
[rows, kv_heads, capacity, head_dim] that the op writes in place when the same buffer is bound as
past and present (``past_present_share_buffer``): no copy of the cache per step, joining a
sequence is writing its rows, leaving is forgetting them (``generation/kv_cache.py``).

The graph's inputs and outputs are named in ``generation/graph_io.py``. Weights come in through a
``WeightStore`` (``linear_weights.py``): fp32 MatMuls, or the GGUF file's own quantized blocks."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import UnsupportedArchitectureError
from ..generation import graph_io as io
from .linear_weights import MS_DOMAIN, GraphBuilder, WeightStore

log = logging.getLogger(__name__)

SERVING_GRAPH_OPSET = 21  # the ONNX domain's ops here are all old; contrib ops are com.microsoft v1
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class DecoderSpec:
    """What the graph needs from a model's config, checked for what the builder supports."""

    model_type: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    rms_eps: float
    qkv_bias: bool
    max_positions: int

    @classmethod
    def of(cls, model: Any) -> DecoderSpec:
        """Raises UnsupportedArchitectureError, naming what is not covered (the caller falls back
        to the torch export)."""
        cfg = model.config
        kind = getattr(cfg, "model_type", "?")
        if kind not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedArchitectureError(f"the serving graph covers {', '.join(SUPPORTED_MODEL_TYPES)}, not {kind}")
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise UnsupportedArchitectureError(f"{kind}: activation {cfg.hidden_act} (the serving graph has silu)")
        if getattr(cfg, "mlp_bias", False):
            raise UnsupportedArchitectureError(f"{kind}: MLP biases")
        window = getattr(cfg, "sliding_window", None)
        if window and (kind != "qwen2" or getattr(cfg, "use_sliding_window", False)):
            raise UnsupportedArchitectureError(f"{kind}: sliding-window attention ({window} tokens)")
        rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        if (rope.get("rope_type") or rope.get("type") or "default") in ("dynamic", "longrope"):
            raise UnsupportedArchitectureError(f"{kind}: rotary scaling '{rope.get('rope_type') or rope.get('type')}' "
                                               "changes with the sequence length")
        heads = int(cfg.num_attention_heads)
        kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        if head_dim % 16:
            raise UnsupportedArchitectureError(f"{kind}: head size {head_dim} (GroupQueryAttention on CPU needs a "
                                               "multiple of 16)")
        attention = model.model.layers[0].self_attn
        qkv_bias = getattr(attention.q_proj, "bias", None) is not None
        if getattr(attention, "q_norm", None) is not None:
            raise UnsupportedArchitectureError(f"{kind}: per-head q/k norms")
        return cls(kind, int(cfg.num_hidden_layers), heads, kv_heads, head_dim, int(cfg.hidden_size),
                   int(cfg.intermediate_size), int(cfg.vocab_size), float(cfg.rms_norm_eps), qkv_bias,
                   int(cfg.max_position_embeddings))


def rotary_caches(model: Any, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [positions, head_dim / 2] as transformers computes them (its own inv_freq and
    attention scaling, so rope variants such as llama3's come for free), in float32."""
    import torch

    rotary = model.model.rotary_emb
    inv_freq = rotary.inv_freq.detach().float()
    scaling = float(getattr(rotary, "attention_scaling", 1.0) or 1.0)
    angles = torch.arange(positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return (angles.cos() * scaling).numpy(), (angles.sin() * scaling).numpy()


def _param(tensor: Any) -> np.ndarray:
    return tensor.detach().float().numpy()


def build_serving_graph(model: Any, weights: WeightStore, path: Path) -> dict[str, int]:
    """Write the serving graph of ``model`` (a transformers causal LM in fp32) to ``path``, its
    weights in ``path.data`` beside it; returns how many projections each storage holds (fp32,
    Q4_1, Q8_0, ...). Raises UnsupportedArchitectureError before writing anything when the model
    is not covered."""
    import onnx
    from onnx import TensorProto, helper

    spec = DecoderSpec.of(model)
    g = GraphBuilder(weights)
    layers = model.model.layers
    cos, sin = rotary_caches(model, spec.max_positions)
    g.constant("rotary.cos", cos)
    g.constant("rotary.sin", sin)
    g.constant("embed.weight", _param(model.model.embed_tokens.weight))

    x = g.node("Gather", ["embed.weight", io.INPUT_IDS], "embed")
    residual = x
    h = g.node("SimplifiedLayerNormalization", [x, g.constant("layers.0.input_norm.weight", _param(layers[0].input_layernorm.weight))],
               "layers.0.input_norm", axis=-1, epsilon=spec.rms_eps, stash_type=1)
    for i, layer in enumerate(layers):
        attention, mlp = layer.self_attn, layer.mlp
        qkv_parts = [attention.q_proj, attention.k_proj, attention.v_proj]
        qkv = g.linear(h, f"layers.{i}.qkv", [_param(p.weight) for p in qkv_parts],
                       [_param(p.bias) for p in qkv_parts] if spec.qkv_bias else None)
        attended = g.node("GroupQueryAttention",
                          [qkv, "", "", io.past_key_name(i), io.past_value_name(i), io.SEQLENS_K, io.TOTAL_SEQUENCE_LENGTH,
                           "rotary.cos", "rotary.sin"],
                          f"layers.{i}.attention", outputs=[f"layers.{i}.attention", io.present_key_name(i), io.present_value_name(i)],
                          domain=MS_DOMAIN, num_heads=spec.heads, kv_num_heads=spec.kv_heads, do_rotary=1,
                          rotary_interleaved=0, scale=float(getattr(attention, "scaling", spec.head_dim ** -0.5)))
        out = g.linear(attended, f"layers.{i}.o_proj", [_param(attention.o_proj.weight)])
        h, residual = g.skip_norm(out, residual, _param(layer.post_attention_layernorm.weight), spec.rms_eps,
                                  f"layers.{i}.post_attention_norm")
        gate_up = g.linear(h, f"layers.{i}.gate_up", [_param(mlp.gate_proj.weight), _param(mlp.up_proj.weight)])
        gate, up = g.split(gate_up, [spec.intermediate, spec.intermediate], f"layers.{i}.gate_up")
        silu = g.node("Mul", [gate, g.node("Sigmoid", [gate], f"layers.{i}.sigmoid")], f"layers.{i}.silu")
        act = g.node("Mul", [silu, up], f"layers.{i}.act")
        out = g.linear(act, f"layers.{i}.down_proj", [_param(mlp.down_proj.weight)])
        norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else model.model.norm
        name = f"layers.{i + 1}.input_norm" if i + 1 < len(layers) else "final_norm"
        h, residual = g.skip_norm(out, residual, _param(norm.weight), spec.rms_eps, name)
    tokens = g.node("Reshape", [h, g.constant("hidden_rows", np.asarray([-1, spec.hidden], np.int64))], "hidden_by_token")
    last = g.node("Gather", [tokens, io.LOGIT_POSITIONS], "hidden_at_logit_positions", axis=0)
    g.linear(last, "lm_head", [_param(model.lm_head.weight)], output=io.LOGITS)

    past_shape = ["batch", spec.kv_heads, "capacity", spec.head_dim]
    inputs = [helper.make_tensor_value_info(io.INPUT_IDS, TensorProto.INT64, ["batch", "sequence"]),
              helper.make_tensor_value_info(io.SEQLENS_K, TensorProto.INT32, ["batch"]),
              helper.make_tensor_value_info(io.TOTAL_SEQUENCE_LENGTH, TensorProto.INT32, []),
              helper.make_tensor_value_info(io.LOGIT_POSITIONS, TensorProto.INT64, ["positions"])]
    outputs = [helper.make_tensor_value_info(io.LOGITS, TensorProto.FLOAT, ["positions", spec.vocab])]
    for i in range(spec.layers):
        for name in (io.past_key_name(i), io.past_value_name(i)):
            inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, past_shape))
        for name in (io.present_key_name(i), io.present_value_name(i)):
            outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, past_shape))
    graph = helper.make_graph(g.nodes, "kiln_serving_decoder", inputs, outputs, g.initializers)
    onnx_model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", SERVING_GRAPH_OPSET),
                                                         helper.make_opsetid(MS_DOMAIN, 1)])
    onnx_model.ir_version = 10
    onnx_model.metadata_props.add(key=io.GRAPH_KIND_KEY, value=io.SERVING_GRAPH)
    onnx.save_model(onnx_model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=path.name + ".data", size_threshold=1024)
    log.info("serving graph: %d nodes, weights %s", len(g.nodes), dict(g.formats))
    return dict(g.formats)
