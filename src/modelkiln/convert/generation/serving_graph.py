"""The decoder graph built for serving: written node by node from a Llama-family model's weights
with onnxruntime's contrib ops, the layout onnxruntime-genai's model builder uses on CPU.

Per layer:

    h   = SkipSimplifiedLayerNormalization(previous output, residual)     (RMSNorm and the residual add, one op)
    qkv = MatMul(h, W_qkv)                                                (q, k and v projections fused)
    a   = GroupQueryAttention(qkv, past_k, past_v, seqlens_k, ...)        (rotary inside; each row over its own length)
    h   = SkipSimplifiedLayerNormalization(a · W_o, residual)
    gu  = MatMul(h, W_gate_up); out = (silu(gate) * up) · W_down          (gate and up projections fused)

(or, built with ``kiln_attention``, kiln's own ``KilnAttention`` in its place: see below), and
after the last layer the final norm, then ``lm_head`` for the positions asked for only
(``logit_positions``, indices into the call's tokens flattened row by row: each row's last one for
a prefill, every one for a perplexity, one per row for a decode step).

Why this graph and not the torch export (``decoder_export.py``, kept for the architectures this
builder does not cover): ``GroupQueryAttention`` reduces each row over that row's own length
(``seqlens_k``), in a fixed order, whatever the other rows in the call are, so a sequence's
logits do not depend on its batch; and its KV cache is one preallocated buffer per layer
[rows, kv_heads, capacity, head_dim] that the op writes in place when the same buffer is bound as
past and present (``past_present_share_buffer``): no copy of the cache per step, joining a
sequence is writing its rows, leaving is forgetting them (``generation/engines/onnx/kv_cache.py``).

``kiln_attention`` (the GGUF variant where kiln's native operators are built): ``KilnAttention``
(native/attention.c) instead of GroupQueryAttention, fed each token's cache row and position
(``cache_rows``, ``positions``) instead of per-row lengths. It reduces every position in the order a
decode step does, so a position's logits are the same bits in a decode step, in a prompt chunk of
any length, or among other rows, and rows of several tokens with a past can share one call;
GroupQueryAttention's prompt path sums in another order than its one-query path. Its key cache is
kept in blocks of 16 positions, dimension-major (``key_blocks = 1``; metadata ``kiln.key_cache``),
the form its scores read, so a decode step does not transpose every block it reads. With
``kv_halves`` the cache holds float16 (``KilnAttentionF16``, as llama.cpp's default cache does):
half the memory a token, and half the bytes each decode step reads. With ``native``, the fused
projections' GgufMatMul writes q, k, v (gate, up) to outputs of their own, the down projection's
multiplies silu(gate) by up as it reads them (its third input), and the norms are ``KilnSkipNorm``
(native/norm.c): SkipSimplifiedLayerNormalization's bits, eight rows at a time.

The graph's inputs and outputs are named in ``generation/engines/onnx/graph_io.py``. Weights come from a
``DecoderWeights``: a transformers model's (``TorchDecoderWeights``, fp32) or a GGUF file's, read
by name (``gguf/decoder.py``); how each is stored (fp32, or the file's own blocks) is
``linear_weights.py``'s job."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ...errors import UnsupportedArchitectureError
from ...generation.engines.onnx import graph_io as io
from ...native import DOMAIN as NATIVE_DOMAIN
from ..external_data import TensorFile
from .linear_weights import MS_DOMAIN, GraphBuilder, Matrix

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
        """A transformers model's; raises UnsupportedArchitectureError, naming what is not covered
        (the caller falls back to the torch export)."""
        kind = getattr(model.config, "model_type", "?")
        if kind not in SUPPORTED_MODEL_TYPES:  # before looking inside: other families name their modules otherwise
            raise UnsupportedArchitectureError(f"the serving graph covers {', '.join(SUPPORTED_MODEL_TYPES)}, not {kind}")
        attention = model.model.layers[0].self_attn
        return cls.from_config(model.config, qkv_bias=getattr(attention.q_proj, "bias", None) is not None,
                               qk_norm=getattr(attention, "q_norm", None) is not None)

    @classmethod
    def from_config(cls, cfg: Any, qkv_bias: bool, qk_norm: bool) -> DecoderSpec:
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
        if qk_norm:
            raise UnsupportedArchitectureError(f"{kind}: per-head q/k norms")
        return cls(kind, int(cfg.num_hidden_layers), heads, kv_heads, head_dim, int(cfg.hidden_size),
                   int(cfg.intermediate_size), int(cfg.vocab_size), float(cfg.rms_norm_eps), qkv_bias,
                   int(cfg.max_position_embeddings))


class DecoderWeights(Protocol):
    """A decoder's weights by role. ``tensor`` keys: ``embed``, ``lm_head`` [vocab, hidden],
    ``final_norm``, and per layer ``layers.{i}.`` + ``q``, ``k``, ``v``, ``o``, ``gate``, ``up``,
    ``down`` ([out, in]), ``q_bias``, ``k_bias``, ``v_bias``, ``input_norm``, ``post_attention_norm``."""

    spec: DecoderSpec

    def tensor(self, key: str) -> Matrix:
        """A matrix (fp32 values or a GGUF tensor read on demand) or, for norms and biases, fp32 values."""

    def rotary(self, positions: int) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin [positions, head_dim / 2] in float32."""


def rotary_caches(rotary: Any, positions: int, freq_factors: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [positions, head_dim / 2] from a transformers rotary embedding module (its own
    inv_freq and attention scaling, so rope variants such as llama3's come for free; a GGUF's
    ``rope_freqs`` divide inv_freq, as llama.cpp does), in float32."""
    import torch

    inv_freq = rotary.inv_freq.detach().float()
    if freq_factors is not None:
        inv_freq = inv_freq / torch.from_numpy(np.asarray(freq_factors, np.float32))
    scaling = float(getattr(rotary, "attention_scaling", 1.0) or 1.0)
    angles = torch.arange(positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return (angles.cos() * scaling).numpy(), (angles.sin() * scaling).numpy()


class TorchDecoderWeights:
    """A transformers causal LM's weights, in fp32."""

    _LAYER = {"q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight", "v": "self_attn.v_proj.weight",
              "o": "self_attn.o_proj.weight", "q_bias": "self_attn.q_proj.bias", "k_bias": "self_attn.k_proj.bias",
              "v_bias": "self_attn.v_proj.bias", "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight",
              "down": "mlp.down_proj.weight", "input_norm": "input_layernorm.weight",
              "post_attention_norm": "post_attention_layernorm.weight"}

    def __init__(self, model: Any):
        self.model = model
        self.spec = DecoderSpec.of(model)

    def tensor(self, key: str) -> np.ndarray:
        inner = self.model.model
        if key == "embed":
            param = inner.embed_tokens.weight
        elif key == "lm_head":
            param = self.model.lm_head.weight
        elif key == "final_norm":
            param = inner.norm.weight
        else:
            _, layer, role = key.split(".")
            param = inner.layers[int(layer)].get_parameter(self._LAYER[role])
        return param.detach().float().numpy()

    def rotary(self, positions: int) -> tuple[np.ndarray, np.ndarray]:
        return rotary_caches(self.model.model.rotary_emb, positions)


@dataclass(frozen=True)
class GraphSummary:
    """What a written graph holds: projection nodes by storage, and per GGUF type how many
    tensors went in and how they are stored (empty for a transformers model)."""

    formats: dict[str, int]
    gguf_types: dict[str, dict[str, Any]]


def build_serving_graph(weights: DecoderWeights, path: Path, pack: bool = False, accuracy_level: int = 0,
                        native: bool = False, kiln_attention: bool = False, kv_halves: bool = False) -> GraphSummary:
    """Write the serving graph to ``path``, its weights to ``path.data`` as each is made. ``pack``:
    GGUF tensors stay in their own blocks where they have an exact MatMulNBits form; ``native``:
    the types the native operators read (``native.GGML_TYPES``) stay exactly as the file stores them;
    ``kiln_attention``: attention is kiln's native ``KilnAttention`` (module docstring); ``kv_halves``
    (with it): its KV cache holds float16 (``KilnAttentionF16``), half the bytes a token."""
    import onnx
    from onnx import TensorProto, helper

    if kv_halves and not kiln_attention:
        raise ValueError("a KV cache of halves is KilnAttention's (GroupQueryAttention's cache here is float32)")
    spec = weights.spec
    tensors = TensorFile(path)
    try:
        g = GraphBuilder(tensors, pack=pack, accuracy_level=accuracy_level, native=native)
        _write_nodes(g, weights, spec, kiln_attention, kv_halves)
    finally:
        tensors.close()
    past_shape: list[str | int] = ["batch", spec.kv_heads, "capacity", spec.head_dim]
    inputs = [helper.make_tensor_value_info(io.INPUT_IDS, TensorProto.INT64, ["batch", "sequence"])]
    if kiln_attention:
        inputs += [helper.make_tensor_value_info(io.CACHE_ROWS, TensorProto.INT64, ["batch", "sequence"]),
                   helper.make_tensor_value_info(io.POSITIONS, TensorProto.INT64, ["batch", "sequence"])]
    else:
        inputs += [helper.make_tensor_value_info(io.SEQLENS_K, TensorProto.INT32, ["batch"]),
                   helper.make_tensor_value_info(io.TOTAL_SEQUENCE_LENGTH, TensorProto.INT32, [])]
    inputs.append(helper.make_tensor_value_info(io.LOGIT_POSITIONS, TensorProto.INT64, ["positions"]))
    outputs = [helper.make_tensor_value_info(io.LOGITS, TensorProto.FLOAT, ["positions", spec.vocab])]
    cache_type = TensorProto.FLOAT16 if kv_halves else TensorProto.FLOAT
    for i in range(spec.layers):
        for name in (io.past_key_name(i), io.past_value_name(i)):
            inputs.append(helper.make_tensor_value_info(name, cache_type, past_shape))
        for name in (io.present_key_name(i), io.present_value_name(i)):
            outputs.append(helper.make_tensor_value_info(name, cache_type, past_shape))
    graph = helper.make_graph(g.nodes, "kiln_serving_decoder", inputs, outputs, g.initializers)
    domains = [MS_DOMAIN] + ([NATIVE_DOMAIN] if any(n.domain == NATIVE_DOMAIN for n in g.nodes) else [])
    onnx_model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", SERVING_GRAPH_OPSET)]
                                   + [helper.make_opsetid(d, 1) for d in domains])
    onnx_model.ir_version = 10
    onnx_model.metadata_props.add(key=io.GRAPH_KIND_KEY, value=io.SERVING_GRAPH)
    if kiln_attention:  # the engine keeps the key cache the way the nodes' key_blocks = 1 read it
        onnx_model.metadata_props.add(key=io.KEY_CACHE_KEY, value=io.KEY_BLOCKS)
    onnx.save_model(onnx_model, str(path))
    log.info("serving graph: %d nodes, weights %s", len(g.nodes), dict(g.formats))
    return GraphSummary(dict(g.formats), g.gguf_types)


def _values(weights: DecoderWeights, key: str) -> np.ndarray:
    """A norm's or a bias's fp32 values (``tensor`` gives a GgufMatrix for matrices only)."""
    values = weights.tensor(key)
    assert isinstance(values, np.ndarray), key
    return values


def _write_nodes(g: GraphBuilder, weights: DecoderWeights, spec: DecoderSpec, kiln_attention: bool,
                 kv_halves: bool) -> None:
    cos, sin = weights.rotary(spec.max_positions)
    g.constant("rotary.cos", cos)
    g.constant("rotary.sin", sin)
    embed, head = weights.tensor("embed"), weights.tensor("lm_head")
    x = g.embedding(io.INPUT_IDS, embed, tied=head is embed)
    residual = x
    first_norm = _values(weights, "layers.0.input_norm")
    h = g.node("SimplifiedLayerNormalization", [x, g.constant("layers.0.input_norm.weight", first_norm)],
               "layers.0.input_norm", axis=-1, epsilon=spec.rms_eps, stash_type=1)
    for i in range(spec.layers):
        w = lambda role: weights.tensor(f"layers.{i}.{role}")  # noqa: E731
        biases = [_values(weights, f"layers.{i}.{r}_bias") for r in "qkv"] if spec.qkv_bias else None
        # KilnAttention takes q, k and v apart; GroupQueryAttention one packed input, or three
        qkv = g.linear(h, f"layers.{i}.qkv", [w("q"), w("k"), w("v")], biases, parts=["q", "k", "v"],
                       apart=kiln_attention)
        q, k, v = qkv if len(qkv) == 3 else (qkv[0], "", "")
        outputs = [f"layers.{i}.attention", io.present_key_name(i), io.present_value_name(i)]
        if kiln_attention:
            op = "KilnAttentionF16" if kv_halves else "KilnAttention"
            attended = g.node(op, [q, k, v, io.past_key_name(i), io.past_value_name(i), io.CACHE_ROWS, io.POSITIONS,
                                   "rotary.cos", "rotary.sin"],
                              f"layers.{i}.attention", outputs=outputs, domain=NATIVE_DOMAIN, num_heads=spec.heads,
                              kv_num_heads=spec.kv_heads, key_blocks=1)
        else:
            attended = g.node("GroupQueryAttention",
                              [q, k, v, io.past_key_name(i), io.past_value_name(i), io.SEQLENS_K,
                               io.TOTAL_SEQUENCE_LENGTH, "rotary.cos", "rotary.sin"],
                              f"layers.{i}.attention", outputs=outputs, domain=MS_DOMAIN, num_heads=spec.heads,
                              kv_num_heads=spec.kv_heads, do_rotary=1, rotary_interleaved=0,
                              scale=float(spec.head_dim ** -0.5))
        out = g.linear(attended, f"layers.{i}.o_proj", [w("o")])[0]
        post_norm = _values(weights, f"layers.{i}.post_attention_norm")
        h, residual = g.skip_norm(out, residual, post_norm, spec.rms_eps, f"layers.{i}.post_attention_norm")
        gate, up = g.linear(h, f"layers.{i}.gate_up", [w("gate"), w("up")], parts=["gate", "up"], apart=True)
        silu = g.node("Mul", [gate, g.node("Sigmoid", [gate], f"layers.{i}.sigmoid")], f"layers.{i}.silu")
        out = g.linear_of_product(silu, up, f"layers.{i}.down_proj", w("down"), f"layers.{i}.act")
        last = i + 1 == spec.layers
        norm = _values(weights, "final_norm" if last else f"layers.{i + 1}.input_norm")
        h, residual = g.skip_norm(out, residual, norm, spec.rms_eps, "final_norm" if last else f"layers.{i + 1}.input_norm")
    tokens = g.node("Reshape", [h, g.constant("hidden_rows", np.asarray([-1, spec.hidden], np.int64))], "hidden_by_token")
    last_rows = g.node("Gather", [tokens, io.LOGIT_POSITIONS], "hidden_at_logit_positions", axis=0)
    g.lm_head(last_rows, head, io.LOGITS)
