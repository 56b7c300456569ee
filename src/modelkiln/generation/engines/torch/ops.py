"""The arithmetic of the torch decoder where batch invariance is decided: linear layers, RMSNorm's
reduction and decode attention. ``Kernels`` gives each in two forms: PyTorch's kernels as they come
(fastest), or batch-invariant (a row's bits do not depend on the other rows of the call).

Why PyTorch's own kernels are not batch-invariant (measured with torch 2.13 on an AMD EPYC, fp32,
1 and 2 threads, ``experiments/torch_batch_invariance``):
- ``F.linear`` takes one code path for M = 1 (a matrix-vector product), another for M = 2-3 and a
  third for M >= 4 rows: a row's output bits change with how many rows share the call. bf16 (oneDNN)
  gave every row the same bits for M = 1..300. On CUDA, cuBLAS picks its tiles and split-K by shape.
- ``scaled_dot_product_attention`` over a batch padded to the longest row changes a row's bits with
  the padded width and, with 2 threads, with the batch size (its key blocks are sized by the width).
- the mean over the last axis (RMSNorm) kept every row's bits for 1..300 rows on the CPU; on CUDA
  the reduction's launch shape depends on how many rows there are (several blocks per row when few).

The invariant forms, the ideas of Thinking Machines' ``batch_invariant_ops`` and vLLM's batch-invariant
mode written with PyTorch's own kernels:
- **linear**: ``calibrate`` asks the machine's library, at load and on the model's own weights,
  from how many rows on a product gives every row the bits it has alone (at row 0 of a call of that
  many rows), whatever the row count and the row's position: probed for 1 to 129 rows. Where such a
  floor exists a product pads to the floor and runs once; where none does (cuBLAS picks tiles and
  split-K by shape), every product runs in ``tile``-row pieces of one shape, the last padded, so
  the library takes one path for every call;
- **RMSNorm's sum of squares** as a fixed-tile product with a column of ones where the device's own
  reduction depends on the row count (CUDA); the CPU's mean is kept (measured invariant);
- **decode attention** split into fixed blocks of ``SPLIT`` key positions: the scores and the
  weighted values of a block are products of fixed shape, the maximum is exact in any order, and the
  blocks are added one after another in position order, so the blocks a longer neighbour adds
  (all masked: exact zeros) come after the row's own sum. On CUDA the decode rows go through
  ``scaled_dot_product_attention`` with the memory-efficient kernel forced instead (one pass over the
  keys per (row, head), no split of the keys across blocks: a padded key adds an exact zero); that
  it is invariant is to be shown on the GPU (docs/gpu.md).

A prompt chunk's attention runs for its sequence alone, whatever else is in the step, so it is the
same alone and under load by construction; so are the elementwise operations (RoPE, SiLU, residuals)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

TILE_ROWS = {"cpu": 16, "cuda": 64}  # rows of every matrix product in the invariant form, without a floor
FLOORS = (1, 2, 4, 8, 16)  # the row floors ``calibrate`` tries, fewest first
PROBE_ROWS = (1, 2, 3, 4, 5, 8, 9, 16, 17, 33, 64, 129)  # row counts it tries them with
PROBE_WIDTH = 4096
SPLIT = 128  # key positions per block of the invariant decode attention


class Kernels:
    """How one engine computes: ``invariant`` picks the batch-invariant forms. ``attention``
    ("split" or "sdpa") and ``norm`` ("mean" or "ones") override the device's choice (tests)."""

    def __init__(self, device: torch.device, invariant: bool = True, attention: str | None = None,
                 norm: str | None = None):
        self.device = device
        self.invariant = invariant
        self.tile = TILE_ROWS.get(device.type, 16)
        cuda = device.type == "cuda"
        self.attention = attention or ("sdpa" if cuda or not invariant else "split")
        self.norm = norm or ("ones" if cuda and invariant else "mean")
        self.floor: int | None = None  # rows from which one product keeps every row's bits (calibrate)
        self._ones: dict[int, torch.Tensor] = {}

    def calibrate(self, weights: list[torch.Tensor]) -> None:
        """Probe the library's matrix product on ``weights`` (the model's own shapes and dtype):
        ``floor`` becomes the fewest rows (of FLOORS) from which every row of a call gets the bits it
        gets alone at row 0 of a ``floor``-row call, for every row count of PROBE_ROWS; with no floor,
        products run in ``tile``-row pieces, and where a row's bits depend on its position even in
        a fixed-shape call, one row per call."""
        if not self.invariant:
            return
        if self.norm == "ones":
            weights = [*weights, self._ones_row(weights[0].shape[1], weights[0].device)]
        # at most PROBE_WIDTH output columns of each (the LM head's 49k would take seconds): the row
        # count and the reduction length, which decide the path, are the model's own
        weights = [w[:PROBE_WIDTH] for w in weights]
        generator = torch.Generator(device="cpu").manual_seed(0)
        rows = max(PROBE_ROWS) + max(FLOORS, default=1) + self.tile
        probes = [torch.randn(rows, w.shape[1], generator=generator).to(w.device, w.dtype) for w in weights]
        for floor in FLOORS:
            if all(_steady(x, w, floor) for x, w in zip(probes, weights)):
                self.floor = floor
                return
        self.floor = None
        if not all(_position_free(x, w, self.tile) for x, w in zip(probes, weights)):
            self.tile = 1

    def describe(self) -> str:
        if not self.invariant:
            return "PyTorch's kernels as they come"
        product = f"one call of at least {self.floor} rows" if self.floor else f"{self.tile}-row tiles"
        return f"matrix products: {product}; decode attention: {self.attention}; RMSNorm: {self.norm}"

    # -- linear layers ---------------------------------------------------------------------------
    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [rows, in] · weightᵀ [in, out] (+ bias)."""
        if not self.invariant:
            return F.linear(x, weight, bias)
        rows = x.shape[0]
        if self.floor is not None:
            if rows >= self.floor:
                return F.linear(x, weight, bias)
            return F.linear(F.pad(x, (0, 0, 0, self.floor - rows)), weight, bias)[:rows]
        tile = self.tile
        padded = -(-rows // tile) * tile
        if padded != rows:
            x = F.pad(x, (0, 0, 0, padded - rows))
        out = torch.empty(padded, weight.shape[0], dtype=x.dtype, device=x.device)
        transposed = weight.t()
        for start in range(0, padded, tile):
            if bias is None:
                torch.mm(x[start:start + tile], transposed, out=out[start:start + tile])
            else:
                torch.addmm(bias, x[start:start + tile], transposed, out=out[start:start + tile])
        return out[:rows]

    # -- RMSNorm -------------------------------------------------------------------------------------
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Llama's RMSNorm, computed in fp32 as transformers does: w · (x / sqrt(mean(x²) + eps))."""
        x32 = x.float()
        if self.norm == "ones":
            width = x32.shape[-1]
            variance = self.linear(x32 * x32, self._ones_row(width, x.device)) / width
        else:
            variance = x32.pow(2).mean(-1, keepdim=True)
        return weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype)

    def _ones_row(self, width: int, device: torch.device) -> torch.Tensor:
        ones = self._ones.get(width)
        if ones is None:
            ones = self._ones[width] = torch.ones(1, width, dtype=torch.float32, device=device)
        return ones

    # -- attention -------------------------------------------------------------------------------------
    def decode_attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
                         window: int | None = None) -> torch.Tensor:
        """One query per row: q [rows, heads, head_dim] over ``keys``/``values`` [rows, kv_heads,
        width, head_dim], row r attending to its first ``lengths[r]`` positions (its last ``window``
        of them when set). Returns [rows, heads, head_dim]."""
        rows, heads, head_dim = q.shape
        kv_heads, width = keys.shape[1], keys.shape[2]
        grouped = q.view(rows, kv_heads, heads // kv_heads, head_dim)  # query head h reads kv head h // groups
        positions = torch.arange(width, device=q.device)
        visible = positions[None, :] < lengths[:, None]
        if window is not None:
            visible &= positions[None, :] >= (lengths[:, None] - window)
        if self.attention == "split":
            out = _split_attention(grouped, keys, values, visible)
        else:
            with _sdpa_backend(self.invariant and q.device.type == "cuda"):
                out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=visible[:, None, None, :])
        return out.reshape(rows, heads, head_dim)

    @staticmethod
    def chunk_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                        window: int | None = None) -> torch.Tensor:
        """A prompt chunk of one sequence: q [n, heads, head_dim] at positions start..start+n-1 over
        keys/values [kv_heads, start + n, head_dim] (its cache, the chunk's own included), causal.
        Returns [n, heads, head_dim]."""
        n, heads, head_dim = q.shape
        kv_heads, width = keys.shape[0], keys.shape[1]
        groups = heads // kv_heads
        # [n, kv_heads, groups, d] → [1, kv_heads, groups · n, d]: the heads sharing a kv head are rows of one query block
        grouped = q.view(n, kv_heads, groups, head_dim).permute(1, 2, 0, 3).reshape(1, kv_heads, groups * n, head_dim)
        query_positions = start + torch.arange(n, device=q.device)
        key_positions = torch.arange(width, device=q.device)
        visible = key_positions[None, :] <= query_positions[:, None]
        if window is not None:
            visible &= key_positions[None, :] > (query_positions[:, None] - window)
        mask = visible.repeat(groups, 1)[None, None]
        out = F.scaled_dot_product_attention(grouped, keys[None], values[None], attn_mask=mask)
        return out.view(kv_heads, groups, n, head_dim).permute(2, 0, 1, 3).reshape(n, heads, head_dim)


def _steady(x: torch.Tensor, weight: torch.Tensor, floor: int) -> bool:
    """Whether ``F.linear`` gives row i of every M-row call (M from PROBE_ROWS, at least ``floor``)
    the bits row i gets at row 0 of a ``floor``-row call whose other rows are something else. Row
    counts go up: the first difference ends the probe."""
    filler = x[len(x) - floor + 1:] if floor > 1 else x[:0]
    alone: dict[int, torch.Tensor] = {}
    for rows in (m for m in PROBE_ROWS if m >= floor):
        together = F.linear(x[:rows], weight)
        for i in _probed_rows(rows):
            if i not in alone:
                alone[i] = F.linear(torch.cat([x[i:i + 1], filler]), weight)[0]
            if not torch.equal(together[i], alone[i]):
                return False
    return True


def _probed_rows(rows: int) -> list[int]:
    """The rows a probe compares: the first ones, those around power-of-two boundaries (where kernels
    split rows between blocks and threads), the middle and the last ones."""
    picked = {0, 1, 2, 3, rows // 2, rows - 2, rows - 1}
    edge = 4
    while edge < rows:
        picked |= {edge - 1, edge}
        edge *= 2
    return sorted(i for i in picked if 0 <= i < rows)


def _position_free(x: torch.Tensor, weight: torch.Tensor, tile: int) -> bool:
    """Whether a ``tile``-row call gives a row the same bits at every position."""
    first = F.linear(x[:tile], weight)[0]
    for position in range(1, tile):
        moved = x[tile:2 * tile].clone()
        moved[position] = x[0]
        if not torch.equal(F.linear(moved, weight)[position], first):
            return False
    return True


def _split_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """q [rows, kv_heads, groups, d]; keys/values [rows, kv_heads, width, d], width a multiple of
    SPLIT; visible [rows, width]. Attention in blocks of SPLIT positions, in fp32, blocks added in order."""
    rows, kv_heads, width, head_dim = keys.shape
    blocks = width // SPLIT
    q32 = q.float().unsqueeze(2)  # [rows, kv_heads, 1, groups, d]
    k32 = keys.float().view(rows, kv_heads, blocks, SPLIT, head_dim)
    v32 = values.float().view(rows, kv_heads, blocks, SPLIT, head_dim)
    scores = torch.matmul(q32, k32.transpose(-1, -2)) * (1.0 / math.sqrt(head_dim))  # [rows, kv, blocks, groups, SPLIT]
    scores = scores.masked_fill(~visible.view(rows, 1, blocks, 1, SPLIT), float("-inf"))
    top = scores.amax(dim=(-1, -3), keepdim=True)  # the row's maximum: exact in any order
    weights = torch.exp(scores - top)
    sums = weights.sum(-1)  # [rows, kv, blocks, groups]
    weighted = torch.matmul(weights, v32)  # [rows, kv, blocks, groups, d]
    numerator, denominator = weighted[:, :, 0], sums[:, :, 0]
    for block in range(1, blocks):  # in position order: a neighbour's extra blocks add exact zeros last
        numerator = numerator + weighted[:, :, block]
        denominator = denominator + sums[:, :, block]
    return (numerator / denominator[..., None]).to(q.dtype)


class _sdpa_backend:
    """The memory-efficient SDPA kernel where decode attention must be batch-invariant on CUDA."""

    def __init__(self, force: bool):
        self.context: Any = None
        if force:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            self.context = sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION])

    def __enter__(self) -> None:
        if self.context is not None:
            self.context.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self.context is not None:
            self.context.__exit__(*exc)


def padded_width(longest: int, step: int = SPLIT) -> int:
    """The key width a decode step attends over: the longest row, rounded up to ``step``."""
    return max(step, -(-longest // step) * step)
