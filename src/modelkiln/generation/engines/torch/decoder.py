"""A Llama-family causal LM (Llama, Mistral, Qwen2) as PyTorch tensors on a device, and its forward
pass over one engine step's tokens, packed: decode rows (one token each) and prompt chunks in one
sequence of tokens, so every linear layer runs once per layer for the whole step.

The weights are a torch variant's file (``model.torch-<precision>.safetensors``: transformers' own
names, in the variant's precision) and the artifact's ``config.json``; transformers' module for the
same model is the reference the tests and the gate compare with. Query/key/value and gate/up are
concatenated at load, so a layer is four matrix products and five of the engine's own kernels
(``kernels/``): RMSNorm (with the residual added), the rotary embedding with each token's key and value
written into the engine's cache (``KVCache``) at its sequence's slot and position, attention over that
cache read in place, RMSNorm again and SiLU·up."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ....errors import ArtifactError, UnsupportedArchitectureError
from . import kernels as fused
from .ops import Kernels

FAMILIES = ("llama", "mistral", "qwen2")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # static tables; dynamic NTK and longrope change with the length


@dataclass(frozen=True)
class DecoderConfig:
    family: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    eps: float
    max_positions: int
    windows: tuple[int | None, ...]  # per layer: sliding window (keys visible to a query), None: all

    @classmethod
    def of(cls, config: Any) -> DecoderConfig:
        """From a transformers config; an architecture this forward does not cover is a typed error."""
        family = getattr(config, "model_type", "")
        if family not in FAMILIES:
            raise UnsupportedArchitectureError(f"the torch engine runs {', '.join(FAMILIES)} decoders, not {family!r}")
        rope = (getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        if rope_type not in ROPE_TYPES:
            raise UnsupportedArchitectureError(f"the torch engine's rotary table is static; rope type {rope_type!r} is not")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise UnsupportedArchitectureError(f"the torch engine's MLP is SiLU-gated, not {config.hidden_act!r}")
        heads = config.num_attention_heads
        window = getattr(config, "sliding_window", None)
        kinds = getattr(config, "layer_types", None) or []
        if kinds:
            windows = tuple(window if kind == "sliding_attention" else None for kind in kinds)
        else:
            windows = (window,) * config.num_hidden_layers
        return cls(family, config.num_hidden_layers, config.hidden_size, heads,
                   getattr(config, "num_key_value_heads", None) or heads,
                   getattr(config, "head_dim", None) or config.hidden_size // heads, config.vocab_size,
                   float(config.rms_norm_eps), int(config.max_position_embeddings), windows)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim


def load_config(folder: Path) -> Any:
    """The artifact's config.json as a transformers config (its rotary parameters are computed from it)."""
    from transformers import AutoConfig

    if not (folder / "config.json").is_file():
        raise ArtifactError(f"{folder} has no config.json (a torch variant needs the model's configuration)")
    try:
        return AutoConfig.from_pretrained(str(folder))
    except (ValueError, OSError) as exc:
        raise ArtifactError(f"cannot read {folder / 'config.json'}: {str(exc).splitlines()[0]}") from exc


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    out: torch.Tensor
    out_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None
    window: int | None


@dataclass
class StepTokens:
    """One step's tokens, packed: decode rows (one token per sequence) and prompt chunks alike, each
    token with its sequence's slot and its position. ``select``: the token indices whose logits are
    wanted (None: all)."""

    ids: torch.Tensor  # [tokens] int64
    positions: torch.Tensor  # [tokens] int64
    slots: torch.Tensor  # [tokens] int64
    select: torch.Tensor | None = None


class TorchDecoder:
    """The weights, in the file's own precision, on ``device``; rotary tables for ``max_length`` positions."""

    def __init__(self, weights: Path, config: Any, device: torch.device, kernels: Kernels, max_length: int):
        from safetensors.torch import load_file

        self.config = DecoderConfig.of(config)
        self.device, self.kernels = device, kernels
        try:
            tensors = load_file(str(weights), device=str(device))
        except Exception as exc:  # safetensors raises its own errors for missing or corrupt files
            raise ArtifactError(f"cannot load {weights}: {exc}") from exc
        if "model.embed_tokens.weight" not in tensors:
            raise ArtifactError(f"{weights} has no 'model.embed_tokens.weight': not a {self.config.family} checkpoint")
        self.dtype = tensors["model.embed_tokens.weight"].dtype
        dtype = self.dtype
        self.layers = [self._layer(tensors, i) for i in range(self.config.layers)]
        self.embed = self._take(tensors, "model.embed_tokens.weight")
        self.norm = self._take(tensors, "model.norm.weight")
        lm_head = tensors.pop("lm_head.weight", None)
        self.lm_head = self.embed if lm_head is None else lm_head.to(dtype)
        self.cos, self.sin = _rotary_tables(config, max_length, device, dtype)
        products = [(self.lm_head, None)] + [product for layer in self.layers for product in (
            (layer.qkv, layer.qkv_bias), (layer.out, layer.out_bias), (layer.gate_up, layer.gate_up_bias),
            (layer.down, layer.down_bias))]
        kernels.calibrate(list({_shape(w, b): (w, b) for w, b in products}.values()))

    def _take(self, tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        if name not in tensors:
            raise ArtifactError(f"the weights file has no {name!r}: not a {self.config.family} checkpoint")
        return tensors.pop(name).to(self.dtype)

    def _layer(self, tensors: dict[str, torch.Tensor], i: int) -> _Layer:
        p = f"model.layers.{i}."

        def weight(names: list[str]) -> torch.Tensor:
            return torch.cat([self._take(tensors, f"{p}{n}.weight") for n in names])

        def bias(names: list[str]) -> torch.Tensor | None:
            keys = [f"{p}{n}.bias" for n in names]
            if not any(k in tensors for k in keys):
                return None
            return torch.cat([self._take(tensors, k) for k in keys])

        qkv, gate_up = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["mlp.gate_proj", "mlp.up_proj"]
        return _Layer(self._take(tensors, p + "input_layernorm.weight"),
                      weight(qkv), bias(qkv),
                      self._take(tensors, p + "self_attn.o_proj.weight"), bias(["self_attn.o_proj"]),
                      self._take(tensors, p + "post_attention_layernorm.weight"),
                      weight(gate_up), bias(gate_up),
                      self._take(tensors, p + "mlp.down_proj.weight"), bias(["mlp.down_proj"]),
                      self.config.windows[i])

    # -- the forward pass ----------------------------------------------------------------------------
    def forward(self, step: StepTokens, cache: Any) -> torch.Tensor:
        """Logits (fp32) [selected tokens, vocab]; writes every token's key and value into ``cache``."""
        c, k = self.config, self.kernels
        tokens = step.ids.shape[0]
        ids, positions, slots = step.ids, step.positions, step.slots
        rows = k.rows(tokens)
        if rows > tokens:  # padding rows, so that no product pads: token 0 at position 0 with no slot (-1)
            padding = (0, rows - tokens)
            ids, positions, slots = F.pad(ids, padding), F.pad(positions, padding), F.pad(slots, padding, value=-1)
        h = F.embedding(ids, self.embed)
        x = fused.rms_norm(h, self.layers[0].input_norm, c.eps)
        # each layer ends with its MLP's output added to the residual stream and the next norm (the
        # next layer's, the final one after the last)
        next_norms = [layer.input_norm for layer in self.layers[1:]] + [self.norm]
        for i, (layer, next_norm) in enumerate(zip(self.layers, next_norms)):
            keys, values = cache.layer(i)  # [slots, kv_heads, max_length, head_dim] each
            q = fused.rotary_kv_write(k.linear(x, layer.qkv, layer.qkv_bias), self.cos, self.sin, positions, slots,
                                      keys, values)
            attended = fused.attention(q, keys, values, positions, slots, layer.window)
            h, x = fused.add_rms_norm(k.linear(attended.view(rows, -1), layer.out, layer.out_bias), h,
                                      layer.post_norm, c.eps)
            mlp = k.linear(fused.silu_mul(k.linear(x, layer.gate_up, layer.gate_up_bias)), layer.down, layer.down_bias)
            h, x = fused.add_rms_norm(mlp, h, next_norm, c.eps)
        x = x[:tokens] if step.select is None else x.index_select(0, step.select)
        return k.linear(x, self.lm_head).float()


def _shape(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[Any, ...]:
    """What decides a product's path in the library: the weight's shape and dtype, and whether it has a bias."""
    return tuple(weight.shape), weight.dtype, bias is not None


def _rotary_tables(config: Any, length: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [length, head_dim] for every position, from transformers' own rotary module (every
    static rope type computes its frequencies there), in the model's dtype as transformers casts them."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(config).to(device)
    cos, sin = rotary(torch.empty(0, dtype=dtype, device=device), torch.arange(length, device=device)[None])
    return cos[0], sin[0]
