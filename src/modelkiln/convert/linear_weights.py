"""How the serving graph's projections are stored, and the small node-writing helper it is built with.

A projection (``GraphBuilder.linear``) is one fp32 ``MatMul``, or one ``MatMulNBits`` over a
GGUF file's own quantized blocks (``gguf_blocks.py``): Q4_0 and Q8_0 as they are, Q4_1 with its
per-block minimum added back by a block-sum correction (``x·W = MatMulNBits(x) + blocksum(x)·C``,
explained in ``gguf_blocks.py``). Several projections that read the same input (q/k/v, gate/up) are
one node over their weights stacked along the output axis, when their blocks have one type."""

from __future__ import annotations

from collections import Counter
from typing import Any, Protocol

import numpy as np

from .gguf_blocks import BLOCK, Blocks, GgufRowIndex, packed_codes, read_gguf

MS_DOMAIN = "com.microsoft"


class WeightStore(Protocol):
    accuracy_level: int

    def blocks_for(self, weight: np.ndarray) -> Blocks | None:
        """The quantized blocks to use for a [K, N] MatMul weight, or None to keep it fp32."""


class Fp32Weights:
    """Every projection as an fp32 MatMul (the fp32 variant; int8/int4 are quantized from it)."""

    accuracy_level = 0

    def blocks_for(self, weight: np.ndarray) -> Blocks | None:
        return None


class GgufWeights:
    """Every projection whose weight is a Q4_0/Q4_1/Q8_0 tensor of the GGUF file, found by value
    (``GgufRowIndex``), as MatMulNBits over those blocks; the others fp32."""

    def __init__(self, gguf_path: Any, accuracy_level: int):
        self.index = GgufRowIndex(read_gguf(gguf_path))
        self.accuracy_level = accuracy_level

    def blocks_for(self, weight: np.ndarray) -> Blocks | None:
        return self.index.blocks_for(weight)


class GraphBuilder:
    """Collects nodes and initializers; names every tensor after the node that makes it."""

    def __init__(self, weights: WeightStore):
        self.weights = weights
        self.nodes: list[Any] = []
        self.initializers: list[Any] = []
        self.formats: Counter[str] = Counter()  # projections by storage (fp32, Q4_1, Q8_0, ...)
        self._blocksums: dict[str, str] = {}

    def constant(self, name: str, value: np.ndarray) -> str:
        from onnx import numpy_helper

        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name

    def node(self, op: str, inputs: list[str], name: str, outputs: list[str] | None = None, domain: str = "",
             **attributes: Any) -> str:
        """Add a node; returns its first named output (``name`` unless ``outputs`` says otherwise)."""
        from onnx import helper

        outputs = outputs or [name]
        self.nodes.append(helper.make_node(op, inputs, outputs, name=name, domain=domain, **attributes))
        return next(o for o in outputs if o)

    def split(self, x: str, sizes: list[int], name: str) -> list[str]:
        parts = [f"{name}.part{i}" for i in range(len(sizes))]
        self.node("Split", [x, self.constant(f"{name}.sizes", np.asarray(sizes, np.int64))], f"{name}.split",
                  outputs=parts, axis=-1)
        return parts

    def skip_norm(self, x: str, residual: str, weight: np.ndarray, eps: float, name: str) -> tuple[str, str]:
        """RMSNorm of ``x + residual``; returns (normalized, the sum: the next residual)."""
        total = f"{name}.residual"
        normed = self.node("SkipSimplifiedLayerNormalization", [x, residual, self.constant(f"{name}.weight", weight)],
                           name, outputs=[name, "", "", total], domain=MS_DOMAIN, epsilon=eps)
        return normed, total

    def linear(self, x: str, name: str, weights: list[np.ndarray], biases: list[np.ndarray] | None = None,
               output: str | None = None) -> str:
        """``x`` times the projections ``weights`` (each [N_i, K], torch's layout), stacked into one node."""
        out = output or name
        stacked = np.concatenate(weights).T  # [K, ΣN]
        parts = [self.weights.blocks_for(np.ascontiguousarray(w.T)) for w in weights]
        blocks = Blocks.concat(parts) if all(p is not None for p in parts) else None  # type: ignore[arg-type]
        product = out if biases is None else f"{name}.product"
        if blocks is None:
            if any(p is not None for p in parts):  # mixed storage cannot share a node: keep fp32 (rare, logged)
                self.formats["fp32 (mixed block types)"] += 1
            self.formats["fp32"] += 1
            self.node("MatMul", [x, self.constant(f"{name}.weight", stacked)], f"{name}.matmul", outputs=[product])
        else:
            self.formats[blocks.kind] += 1
            self._matmul_nbits(x, name, blocks, stacked.shape, product)
        if biases is not None:
            self.node("Add", [product, self.constant(f"{name}.bias", np.concatenate(biases))], f"{name}.bias_add",
                      outputs=[out])
        return out

    def _matmul_nbits(self, x: str, name: str, blocks: Blocks, shape: tuple[int, int], out: str) -> None:
        k, n = shape
        codes = self.constant(f"{name}.codes", packed_codes(blocks))
        scales = self.constant(f"{name}.scales", blocks.scale.reshape(-1).astype(np.float32))
        product = out if blocks.offset is None else f"{name}.from_codes"
        self.node("MatMulNBits", [x, codes, scales], f"{name}.matmul_nbits", outputs=[product], domain=MS_DOMAIN,
                  K=k, N=n, bits=blocks.bits, block_size=BLOCK, accuracy_level=self.weights.accuracy_level)
        if blocks.offset is not None:  # Q4_1: MatMulNBits took the codes from its default zero point 8
            correction = self.constant(f"{name}.block_offsets", (blocks.offset + 8.0 * blocks.scale).T.astype(np.float32))
            shifted = self.node("MatMul", [self._blocksum(x, k), correction], f"{name}.offsets")
            self.node("Add", [product, shifted], f"{name}.add_offsets", outputs=[out])

    def _blocksum(self, x: str, k: int) -> str:
        """Sums of ``x`` over each block of 32 inputs, once per input tensor."""
        if x not in self._blocksums:
            ones = f"blocksum_indicator_{k}"
            if not any(i.name == ones for i in self.initializers):
                self.constant(ones, np.kron(np.eye(k // BLOCK, dtype=np.float32), np.ones((BLOCK, 1), np.float32)))
            self._blocksums[x] = self.node("MatMul", [x, ones], f"{x}.blocksum")
        return self._blocksums[x]
