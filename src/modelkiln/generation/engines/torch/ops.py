"""The matrix products of the torch decoder, where batch invariance is decided by the library that runs
them: ``Kernels.linear`` gives each in two forms, PyTorch's kernel as it comes (fastest) or batch-invariant
(a row's bits do not depend on the other rows of the call). The rest of a layer (RMSNorm, the rotary
embedding and the KV cache write, attention, SiLU·up) is this engine's own kernels (``kernels/``),
batch-invariant by construction.

Why PyTorch's own products are not batch-invariant (measured with torch 2.13 on an AMD EPYC, fp32,
1 and 2 threads, ``experiments/torch_batch_invariance``): ``F.linear`` takes one code path for M = 1
(a matrix-vector product), another for M = 2-3 and a third for M >= 4 rows, so a row's output bits
change with how many rows share the call. bf16 (oneDNN) gave every row the same bits for M = 1..300.
On CUDA, cuBLAS picks its tiles and split-K by shape.

The invariant form, the idea of Thinking Machines' ``batch_invariant_ops`` and vLLM's batch-invariant
mode written with PyTorch's own kernels: ``calibrate`` asks the machine's library, at load and on the
model's own layer shapes (with their biases), from how many rows on a product gives every row the
bits it has alone (at row 0 of a call of that many rows), whatever the row count and the row's
position: probed for 1 to 2048 rows. Where such a floor exists a product pads to the floor and runs
once; where none does (cuBLAS picks tiles and split-K by shape), every product runs in ``tile``-row
pieces of one shape, the last padded, so the library takes one path for every call. The decoder pads
a step's tokens to ``rows`` at its start, so that the products inside its layers pad nothing."""

from __future__ import annotations

import torch
import torch.nn.functional as F

TILE_ROWS = {"cpu": 16, "cuda": 64}  # rows of every matrix product in the invariant form, without a floor
FLOORS = (1, 2, 4, 8, 16)  # the row floors ``calibrate`` tries, fewest first
# row counts it tries them with: decode steps, and prompt chunks (the CPU's 128 tokens, CUDA's 2048)
PROBE_ROWS = (1, 2, 3, 4, 5, 8, 9, 16, 17, 33, 64, 129, 512, 2048)
PROBE_WIDTH = 4096


class Kernels:
    """How one engine's matrix products run: ``invariant`` picks the batch-invariant form."""

    def __init__(self, device: torch.device, invariant: bool = True):
        self.invariant = invariant
        self.tile = TILE_ROWS.get(device.type, 16)
        self.floor: int | None = None  # rows from which one product keeps every row's bits (calibrate)

    def calibrate(self, layers: list[tuple[torch.Tensor, torch.Tensor | None]]) -> None:
        """Probe the library's matrix product on ``layers`` (the model's own (weight, bias) shapes and
        dtype): ``floor`` becomes the fewest rows (of FLOORS) from which every row of a call gets the
        bits it gets alone at row 0 of a ``floor``-row call, for every row count of PROBE_ROWS; with no
        floor, products run in ``tile``-row pieces, and where a row's bits depend on its position even
        in a fixed-shape call, one row per call."""
        if not self.invariant:
            return
        # at most PROBE_WIDTH output columns of each (the LM head's 49k would take seconds): the row
        # count and the reduction length, which decide the path, are the model's own
        layers = [(w[:PROBE_WIDTH], None if b is None else b[:PROBE_WIDTH]) for w, b in layers]
        generator = torch.Generator(device="cpu").manual_seed(0)
        rows = max(PROBE_ROWS) + max(FLOORS, default=1) + self.tile
        probes = [torch.randn(rows, w.shape[1], generator=generator).to(w.device, w.dtype) for w, _ in layers]
        for floor in FLOORS:
            if all(_steady(x, w, b, floor) for x, (w, b) in zip(probes, layers)):
                self.floor = floor
                return
        self.floor = None
        if not all(_position_free(x, w, b, self.tile) for x, (w, b) in zip(probes, layers)):
            self.tile = 1

    def describe(self) -> str:
        if not self.invariant:
            return "PyTorch's matrix products as they come"
        return f"matrix products: one call of at least {self.floor} rows" if self.floor else \
            f"matrix products: {self.tile}-row tiles"

    def rows(self, tokens: int) -> int:
        """The rows a product of ``tokens`` rows runs with: what a step pads its tokens to."""
        if not self.invariant:
            return tokens
        if self.floor is not None:
            return max(tokens, self.floor)
        return -(-tokens // self.tile) * self.tile

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


def _steady(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, floor: int) -> bool:
    """Whether ``F.linear`` gives row i of every M-row call (M from PROBE_ROWS, at least ``floor``)
    the bits row i gets at row 0 of a ``floor``-row call whose other rows are something else. Row
    counts go up: the first difference ends the probe."""
    filler = x[len(x) - floor + 1:] if floor > 1 else x[:0]
    alone: dict[int, torch.Tensor] = {}
    for rows in (m for m in PROBE_ROWS if m >= floor):
        together = F.linear(x[:rows], weight, bias)
        for i in _probed_rows(rows):
            if i not in alone:
                alone[i] = F.linear(torch.cat([x[i:i + 1], filler]), weight, bias)[0]
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


def _position_free(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tile: int) -> bool:
    """Whether a ``tile``-row call gives a row the same bits at every position."""
    first = F.linear(x[:tile], weight, bias)[0]
    for position in range(1, tile):
        moved = x[tile:2 * tile].clone()
        moved[position] = x[0]
        if not torch.equal(F.linear(moved, weight, bias)[position], first):
            return False
    return True
