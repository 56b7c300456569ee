"""The torch decoder's kernels in Triton, each with the signature of its PyTorch form (``reference.py``);
imported only where they run (CUDA with triton) and by their tests (triton's interpreter on the CPU).

Batch invariance by construction: every program works on one row (one token) and its arithmetic has
the same shape whatever the grid, so a token's bits depend on its own inputs only. Attention reads
each token's keys in fixed blocks of ``KEY_BLOCK`` positions, starting at position 0, in position
order, with an online softmax (vLLM's ``triton_unified_attention`` does the same over its paged
cache): no block is split across programs, so a decode row and the same token inside a prompt chunk
of any length run the same loop over the same blocks.

Rounding follows the PyTorch forms where they round: an elementwise product or sum of two bf16
values is computed in fp32 and rounded, as PyTorch's CPU and CUDA kernels do."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

KEY_BLOCK = 32  # key positions per block of attention; the blocks start at position 0


# -- RMSNorm --------------------------------------------------------------------------------------------

@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, summed_ptr, width, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    columns = tl.arange(0, BLOCK)
    inside = columns < width
    x = tl.load(x_ptr + row * width + columns, mask=inside, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * width + columns, mask=inside, other=0.0)
        x = (residual.to(tl.float32) + x.to(tl.float32)).to(x.dtype)
        tl.store(summed_ptr + row * width + columns, x, mask=inside)
    x32 = x.to(tl.float32)
    variance = tl.sum(x32 * x32, axis=0) / width
    normed = (x32 * tl.rsqrt(variance + eps)).to(x.dtype)
    weight = tl.load(weight_ptr + columns, mask=inside, other=0.0)
    tl.store(out_ptr + row * width + columns, (weight.to(tl.float32) * normed.to(tl.float32)).to(x.dtype), mask=inside)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    _rms_norm_kernel[(x.shape[0],)](x, x, weight, out, out, x.shape[1], eps, HAS_RESIDUAL=False,
                                    BLOCK=triton.next_power_of_2(x.shape[1]))
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    x, residual = x.contiguous(), residual.contiguous()
    summed, out = torch.empty_like(x), torch.empty_like(x)
    _rms_norm_kernel[(x.shape[0],)](x, residual, weight, out, summed, x.shape[1], eps, HAS_RESIDUAL=True,
                                    BLOCK=triton.next_power_of_2(x.shape[1]))
    return summed, out


# -- rotary embedding and KV cache write ----------------------------------------------------------------

@triton.jit
def _product_sum(a, b, c, d, dtype):
    """a·b + c·d rounded to ``dtype`` after each product and after the sum, as PyTorch's kernels round."""
    return ((a * b).to(dtype).to(tl.float32) + (c * d).to(dtype).to(tl.float32)).to(dtype)


@triton.jit
def _rotate_half(x_ptr, heads, cos_first, cos_second, sin_first, sin_second,
                 HALF: tl.constexpr, HEADS: tl.constexpr, HALF_PAD: tl.constexpr):
    """The rotated halves of ``heads`` heads at x_ptr (head_dim = 2·HALF each), as transformers'
    ``x·cos + rotate_half(x)·sin`` rounds them: each product, then the sum."""
    rows = tl.arange(0, HEADS)[:, None]
    columns = tl.arange(0, HALF_PAD)[None, :]
    inside = (rows < heads) & (columns < HALF)
    first = tl.load(x_ptr + rows * 2 * HALF + columns, mask=inside, other=0.0)
    second = tl.load(x_ptr + rows * 2 * HALF + HALF + columns, mask=inside, other=0.0)
    dtype = first.dtype
    f32, s32 = first.to(tl.float32), second.to(tl.float32)
    rotated_first = _product_sum(f32, cos_first, -s32, sin_first, dtype)
    rotated_second = _product_sum(s32, cos_second, f32, sin_second, dtype)
    return rotated_first, rotated_second, rows, columns, inside


@triton.jit
def _rotary_kv_kernel(qkv_ptr, cos_ptr, sin_ptr, positions_ptr, slots_ptr,
                      q_ptr, keys_ptr, values_ptr, heads, kv_heads, slot_stride, head_stride,
                      HALF: tl.constexpr, HEADS_PAD: tl.constexpr, KV_HEADS_PAD: tl.constexpr,
                      HALF_PAD: tl.constexpr):
    token = tl.program_id(0)
    position = tl.load(positions_ptr + token)
    slot = tl.load(slots_ptr + token)
    head_dim = 2 * HALF
    half = tl.arange(0, HALF_PAD)[None, :]
    in_table = half < HALF
    table = position * head_dim + half
    cos_first = tl.load(cos_ptr + table, mask=in_table, other=0.0).to(tl.float32)
    cos_second = tl.load(cos_ptr + table + HALF, mask=in_table, other=0.0).to(tl.float32)
    sin_first = tl.load(sin_ptr + table, mask=in_table, other=0.0).to(tl.float32)
    sin_second = tl.load(sin_ptr + table + HALF, mask=in_table, other=0.0).to(tl.float32)
    row = qkv_ptr + token * (heads + 2 * kv_heads) * head_dim

    first, second, rows, columns, inside = _rotate_half(row, heads, cos_first, cos_second, sin_first, sin_second,
                                                        HALF, HEADS_PAD, HALF_PAD)
    out = q_ptr + token * heads * head_dim + rows * head_dim + columns
    tl.store(out, first, mask=inside)
    tl.store(out + HALF, second, mask=inside)

    first, second, rows, columns, inside = _rotate_half(row + heads * head_dim, kv_heads, cos_first, cos_second,
                                                        sin_first, sin_second, HALF, KV_HEADS_PAD, HALF_PAD)
    written = inside & ((rows + columns) * 0 + slot >= 0)  # padding tokens have no slot: nothing is written
    at = slot * slot_stride + rows * head_stride + position * head_dim + columns
    tl.store(keys_ptr + at, first, mask=written)
    tl.store(keys_ptr + at + HALF, second, mask=written)
    value = row + (heads + kv_heads) * head_dim + rows * head_dim + columns
    tl.store(values_ptr + at, tl.load(value, mask=inside, other=0.0), mask=written)
    tl.store(values_ptr + at + HALF, tl.load(value + HALF, mask=inside, other=0.0), mask=written)


def rotary_kv_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                    slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    tokens = qkv.shape[0]
    kv_heads, head_dim = keys.shape[1], keys.shape[3]
    heads = qkv.shape[1] // head_dim - 2 * kv_heads
    assert keys.stride() == values.stride() and keys.stride(3) == 1 and keys.stride(2) == head_dim
    q = torch.empty(tokens, heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    _rotary_kv_kernel[(tokens,)](qkv.contiguous(), cos.contiguous(), sin.contiguous(), positions, slots, q, keys,
                                 values, heads, kv_heads, keys.stride(0), keys.stride(1),
                                 HALF=head_dim // 2, HEADS_PAD=triton.next_power_of_2(heads),
                                 KV_HEADS_PAD=triton.next_power_of_2(kv_heads),
                                 HALF_PAD=triton.next_power_of_2(head_dim // 2))
    return q


# -- SiLU(gate) · up ------------------------------------------------------------------------------------------

@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, width, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = columns < width
    gate = tl.load(gate_up_ptr + row * 2 * width + columns, mask=inside, other=0.0)
    up = tl.load(gate_up_ptr + row * 2 * width + width + columns, mask=inside, other=0.0)
    g32 = gate.to(tl.float32)
    silu = (g32 / (1.0 + tl.exp(-g32))).to(gate.dtype)
    tl.store(out_ptr + row * width + columns, (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=inside)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate_up = gate_up.contiguous()
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, width, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(width))
    _silu_mul_kernel[(rows, triton.cdiv(width, block))](gate_up, out, width, BLOCK=block)
    return out


# -- attention ------------------------------------------------------------------------------------------------

@triton.jit
def _attention_kernel(q_ptr, keys_ptr, values_ptr, positions_ptr, slots_ptr, out_ptr,
                      heads, slot_stride, head_stride, scale, window,
                      GROUPS: tl.constexpr, GROUPS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                      HEAD_DIM_PAD: tl.constexpr, BLOCK: tl.constexpr, HAS_WINDOW: tl.constexpr,
                      PRECISION: tl.constexpr):
    """One program per (query token, kv head): the GROUPS query heads that read the kv head, over the
    token's slot, key blocks of BLOCK positions from the one holding its first visible key to the one
    holding its own position."""
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    position = tl.load(positions_ptr + token)
    slot = tl.load(slots_ptr + token)
    rows = tl.arange(0, GROUPS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    row_inside, dim_inside = rows < GROUPS, dims < HEAD_DIM
    query_heads = kv_head * GROUPS + rows
    q = tl.load(q_ptr + (token * heads + query_heads[:, None]) * HEAD_DIM + dims[None, :],
                mask=row_inside[:, None] & dim_inside[None, :], other=0.0)
    first = 0
    if HAS_WINDOW:
        first = tl.maximum(position - window + 1, 0)
    end = tl.where(slot >= 0, position + 1, 0)  # padding tokens (no slot) read nothing
    cache = slot * slot_stride + kv_head * head_stride
    top = tl.full([GROUPS_PAD], float("-inf"), dtype=tl.float32)
    total = tl.zeros([GROUPS_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUPS_PAD, HEAD_DIM_PAD], dtype=tl.float32)
    # every block the loop visits holds at least one visible key: the maximum is finite from the first
    for start in range(first // BLOCK * BLOCK, end, BLOCK):
        key_positions = start + tl.arange(0, BLOCK)
        visible = (key_positions >= first) & (key_positions < end)
        k = tl.load(keys_ptr + cache + key_positions[None, :] * HEAD_DIM + dims[:, None],
                    mask=visible[None, :] & dim_inside[:, None], other=0.0)  # [HEAD_DIM_PAD, BLOCK]
        scores = tl.dot(q, k, input_precision=PRECISION) * scale
        scores = tl.where(visible[None, :], scores, float("-inf"))
        new_top = tl.maximum(top, tl.max(scores, axis=1))
        weights = tl.exp(scores - new_top[:, None])
        rescale = tl.exp(top - new_top)
        total = total * rescale + tl.sum(weights, axis=1)
        v = tl.load(values_ptr + cache + key_positions[:, None] * HEAD_DIM + dims[None, :],
                    mask=visible[:, None] & dim_inside[None, :], other=0.0)  # [BLOCK, HEAD_DIM_PAD]
        acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v, input_precision=PRECISION)
        top = new_top
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out_ptr + (token * heads + query_heads[:, None]) * HEAD_DIM + dims[None, :], out.to(q.dtype),
             mask=row_inside[:, None] & dim_inside[None, :])


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
              slots: torch.Tensor, window: int | None) -> torch.Tensor:
    tokens, heads, head_dim = q.shape
    kv_heads = keys.shape[1]
    assert keys.stride() == values.stride() and keys.stride(3) == 1 and keys.stride(2) == head_dim
    q = q.contiguous()
    out = torch.empty_like(q)
    groups = heads // kv_heads
    _attention_kernel[(tokens, kv_heads)](
        q, keys, values, positions, slots, out, heads, keys.stride(0), keys.stride(1), head_dim ** -0.5,
        window or 0, GROUPS=groups, GROUPS_PAD=max(16, triton.next_power_of_2(groups)), HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)), BLOCK=KEY_BLOCK, HAS_WINDOW=window is not None,
        # fp32 products in fp32 (not TF32), as the PyTorch form computes them
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    return out
