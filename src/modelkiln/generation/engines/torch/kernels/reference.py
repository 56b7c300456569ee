"""The kernels of the torch decoder written with PyTorch's own operations: what the CPU runs, and
what the Triton kernels (``triton_kernels.py``) are tested against.

Each is batch-invariant on the CPU: a row's (a token's) bits do not depend on the other rows of the
call. The norms reduce each row on its own (the CPU's mean over the last axis kept every row's bits
for 1 to 300 rows, ops.py); the rotary embedding and SiLU·up are elementwise; attention runs one
call per query token, whose shapes are the token's own (its query, its slot's keys up to its
position), so nothing else in the step, nor whether it came as a decode row or inside a prompt
chunk, reaches its arithmetic.

Tokens with a negative slot are padding (``TorchDecoder`` pads a step to the rows its matrix
products want): nothing is written for them and their attention is zeros."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm, computed in fp32 as transformers does: w · (x / sqrt(mean(x²) + eps))."""
    x32 = x.float()
    variance = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream after adding ``x`` to it, and its RMSNorm."""
    summed = residual + x
    return summed, rms_norm(summed, weight, eps)


def rotary_kv_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                    slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """qkv [tokens, (heads + 2·kv_heads)·head_dim], one layer's q/k/v projections: the queries rotated
    ([tokens, heads, head_dim]); the keys, rotated, and the values written into ``keys``/``values``
    [slots, kv_heads, max_length, head_dim] at each token's (slot, position). cos/sin [max_length,
    head_dim]: the rotary tables, by position."""
    tokens = qkv.shape[0]
    kv_heads, head_dim = keys.shape[1], keys.shape[3]
    heads = qkv.shape[1] // head_dim - 2 * kv_heads
    q = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim)
    cos_t, sin_t = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    kept = (slots >= 0).nonzero().squeeze(1)
    slot, position = slots[kept], positions[kept]
    keys[slot, :, position] = _rotate(k, cos_t, sin_t)[kept]
    values[slot, :, position] = v[kept]
    return _rotate(q, cos_t, sin_t)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding as transformers applies it (``rotate_half``)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) · up, gate and up the two halves of the MLP's concatenated projection."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
              slots: torch.Tensor, window: int | None) -> torch.Tensor:
    """q [tokens, heads, head_dim]: each token's queries over its slot's keys and values ([slots,
    kv_heads, max_length, head_dim], already holding the token's own), causal (positions 0 to its
    own; its last ``window`` ones when set). Query head h reads kv head h // (heads / kv_heads).
    Returns [tokens, heads, head_dim]."""
    tokens, heads, head_dim = q.shape
    kv_heads = keys.shape[1]
    out = torch.zeros_like(q)
    for token, (slot, position) in enumerate(zip(slots.tolist(), positions.tolist())):
        if slot < 0:
            continue
        first = 0 if window is None else max(0, position - window + 1)
        # the heads sharing a kv head are the query rows of one attention over its keys: no mask needed
        grouped = q[token].view(1, kv_heads, heads // kv_heads, head_dim)
        k, v = keys[slot, :, first:position + 1], values[slot, :, first:position + 1]
        out[token] = F.scaled_dot_product_attention(grouped, k[None], v[None]).reshape(heads, head_dim)
    return out
