"""How the serving graph's weights are stored, and the small node-writing helper it is built with.

A projection (``GraphBuilder.linear``) is an fp32 ``MatMul``, or, in the packed variant of a GGUF
source, ``MatMulNBits`` over the file's own blocks (``gguf/blocks.py``), plus, where the type has a
per-block minimum, the block-sum correction

    x·W = MatMulNBits(x; codes, scales) + blocksum(x) · C

with ``blocksum(x)`` the sums of ``x`` over each block of inputs (a Reshape and a ReduceSum: a
MatMul with a 0/1 matrix did the same in 63 µs against 4 µs for K = 4864, more than the projection
itself) and ``C`` [blocks, N]. Projections that read the same input (q/k/v, gate/up) are one node
when they are stored alike (bits, block, correction), else one node per storage: a Q4_K_M file
holds q and k as Q4_K and v as Q6_K.

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and Q2_K..Q6_K blocks, where kiln's native operators are built
(``native/``), keep the file's values and size: its rows, regrouped sixteen at a time
(``gguf/tiles.py``), are the initializer of a ``GgufMatMul`` node (Q4_K 4.5 and Q6_K 6.56 bits a
weight, against MatMulNBits' 6 and 10 for the same values; Q4_1 5 against 6 with its correction),
and a ``GgufGather`` dequantizes the embedding's rows from the same tiles exactly.
``GraphBuilder(native=False)`` writes MatMulNBits for them as before.

The token embedding of the packed variant stays quantized too: a token's row of codes and scales
is gathered and dequantized in the graph with gguf-py's own operations (exactly its values), and a
tied ``lm_head`` reads the same codes and scales.

Every initializer is written to the external-data file as it is made (``external_data.py``), a
matrix a range of rows at a time."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Union

import numpy as np

from ..external_data import TensorFile
from ..gguf.blocks import GgufMatrix, Storage
from ..gguf.tiles import TILE, tile_count, tiled_rows

MS_DOMAIN = "com.microsoft"
Matrix = Union[np.ndarray, GgufMatrix]  # [N, K]: fp32 values, or a GGUF tensor read on demand


@dataclass(frozen=True)
class AsStored:
    """A GGUF type kept in the file's own blocks, for kiln's native operators."""

    kind: str

    def __str__(self) -> str:
        return f"{self.kind} blocks as in the file, in tiles of 16 rows (GgufMatMul)"


@dataclass(frozen=True)
class QuantizedWeights:
    """The initializers of one MatMulNBits weight (several projections stacked along N)."""

    codes: str
    scales: str  # [N, blocks]
    correction: str | None  # [blocks, N]: what MatMulNBits leaves out (Blocks.correction)
    offsets: str | None  # [N, blocks]: the exact per-block offsets (the embedding's gather)
    zero: int  # the code of 0 (the embedding's gather; a single matrix's)
    storage: Storage
    k: int
    n: int


class GraphBuilder:
    """Collects nodes and initializers; names every tensor after the node that makes it. ``pack``:
    GGUF matrices of a type with an exact MatMulNBits form stay in their blocks, the rest are fp32."""

    def __init__(self, tensors: TensorFile, pack: bool = False, accuracy_level: int = 0, native: bool = False):
        self.tensors = tensors
        self.pack = pack
        self.native = native  # the types native.GGML_TYPES names as stored, for the native operators
        self.accuracy_level = accuracy_level
        self.nodes: list[Any] = []
        self.initializers: list[Any] = []
        self.formats: Counter[str] = Counter()  # projection nodes by storage
        self.gguf_types: dict[str, dict[str, Any]] = {}  # GGUF type → tensors of that type and how they are stored
        self._blocksums: dict[tuple[str, int], str] = {}
        self._counted: set[str] = set()
        self._embedding: tuple[GgufMatrix, QuantizedWeights | str] | None = None  # a tied head's weights

    # -- plain nodes ------------------------------------------------------------------------------
    def constant(self, name: str, value: np.ndarray) -> str:
        self.initializers.append(self.tensors.tensor(name, value))
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
        """RMSNorm of ``x + residual``; returns (normalized, the sum: the next residual). With the
        native operators, kiln's KilnSkipNorm: onnxruntime's bits, its rows' sums eight at a time."""
        total = f"{name}.residual"
        gamma = self.constant(f"{name}.weight", weight)
        if self.native:
            from ...native import DOMAIN

            normed = self.node("KilnSkipNorm", [x, residual, gamma], name, outputs=[name, total], domain=DOMAIN,
                               epsilon=eps)
        else:
            normed = self.node("SkipSimplifiedLayerNormalization", [x, residual, gamma], name,
                               outputs=[name, "", "", total], domain=MS_DOMAIN, epsilon=eps)
        return normed, total

    # -- projections ------------------------------------------------------------------------------
    def storage(self, matrix: Matrix) -> Storage | AsStored | None:
        """How ``matrix`` is stored in this graph: the file's blocks (native operators), their
        MatMulNBits form, or None for fp32."""
        if self.pack and isinstance(matrix, GgufMatrix) and matrix.packable:
            from ...native import GGML_TYPES
            from ..gguf.blocks import STORAGE

            if self.native and matrix.kind in GGML_TYPES:
                return AsStored(matrix.kind)
            return STORAGE[matrix.kind]
        return None

    def linear(self, x: str, name: str, weights: list[Matrix], biases: list[np.ndarray] | None = None,
               output: str | None = None, parts: list[str] | None = None, rank: int = 3,
               apart: bool = False) -> list[str]:
        """``x`` times the projections ``weights`` (each [N_i, K]). Returns one output when they share
        one node (stacked along N, in order) and ``apart`` is false, else one output per projection:
        where projections stored alike share a node, its GgufMatMul writes each one's columns to an
        output of its own (``_split_outputs``), or a Split node cuts them apart. ``rank``: of ``x``."""
        groups: dict[Storage | AsStored | None, list[int]] = {}
        for i, w in enumerate(weights):
            groups.setdefault(self.storage(w), []).append(i)
        parts = parts or [str(i) for i in range(len(weights))]
        if len(groups) == 1 and not apart:
            return [self._projection(x, name, weights, biases, output or name, next(iter(groups)), rank)]
        outputs: list[str] = [""] * len(weights)
        for storage, members in groups.items():
            group_name = name if len(groups) == 1 else f"{name}.{'_'.join(parts[m] for m in members)}"
            group = [weights[m] for m in members]
            group_biases = None if biases is None else [biases[m] for m in members]
            if len(members) > 1 and isinstance(storage, AsStored) and _split_outputs(group, group_biases):
                outputs_of_group = [f"{group_name}.part{j}" for j in range(len(members))]
                self._stored_matmul(x, group_name, group, storage, [w.shape[0] for w in group], outputs_of_group)
            else:
                out = self._projection(x, group_name, group, group_biases, group_name, storage, rank)
                outputs_of_group = [out] if len(members) == 1 else self.split(out, [w.shape[0] for w in group], group_name)
            for m, part in zip(members, outputs_of_group):
                outputs[m] = part
        return outputs

    def linear_of_product(self, x: str, times: str, name: str, weight: Matrix, product: str) -> str:
        """``(x · times) Wᵀ``, the product element by element: where W is kiln's GgufMatMul it takes
        ``times`` as its third input and multiplies as it reads X (a Mul's bits, no tensor written in
        between); else a Mul node named ``product``, then ``linear``."""
        storage = self.storage(weight)
        if isinstance(storage, AsStored):
            self._stored_matmul(x, name, [weight], storage, [weight.shape[0]], [name], times=times)
            return name
        return self.linear(self.node("Mul", [x, times], product), name, [weight])[0]

    def _projection(self, x: str, name: str, weights: list[Matrix], biases: list[np.ndarray] | None, out: str,
                    storage: Storage | AsStored | None, rank: int) -> str:
        product = out if biases is None else f"{name}.product"
        if isinstance(storage, AsStored):  # _stored_matmul counts its weights
            self._stored_matmul(x, name, weights, storage, [sum(w.shape[0] for w in weights)], [product])
        else:
            for w in weights:
                self._count(w, storage)
            if storage is None:
                self.formats["fp32"] += 1
                stacked = np.concatenate([_fp32(w) for w in weights]).T  # [K, ΣN]
                self.node("MatMul", [x, self.constant(f"{name}.weight", stacked)], f"{name}.matmul", outputs=[product])
            else:
                self.formats[str(storage)] += 1
                quantized = self._write_blocks(name, _gguf(weights), storage)
                self._matmul_nbits(x, name, quantized, product, rank)
        if biases is not None:
            self.node("Add", [product, self.constant(f"{name}.bias", np.concatenate(biases))], f"{name}.bias_add",
                      outputs=[out])
        return out

    def _stored_matmul(self, x: str, name: str, weights: list[Matrix], storage: AsStored, widths: list[int],
                       outs: list[str], times: str | None = None) -> None:
        """``weights`` stacked, the file's own rows in tiles, one GgufMatMul (``_gguf_matmul``)."""
        for w in weights:
            self._count(w, storage)
        self.formats[str(storage)] += 1
        self._gguf_matmul(x, name, self._write_tiles(name, _gguf(weights)), storage.kind, weights[0].shape[1], widths,
                          outs, times)

    def _write_tiles(self, stem: str, matrices: list[GgufMatrix]) -> str:
        """The file's own rows of ``matrices``, stacked along N, in the native operators' tiles of
        16 rows (streamed, a range of rows at a time)."""
        rows = (m.raw(a, b) for m in matrices for a, b in m.row_ranges())
        n = sum(m.shape[0] for m in matrices)
        proto = self.tensors.chunked(f"{stem}.tiles", (tile_count(n), matrices[0].row_bytes * TILE), np.uint8,
                                     tiled_rows(matrices[0].kind, rows))
        self.initializers.append(proto)
        return proto.name

    def _gguf_matmul(self, x: str, name: str, blocks: str, kind: str, k: int, widths: list[int], outs: list[str],
                     times: str | None = None) -> None:
        """One GgufMatMul; several ``widths``: its columns cut into that many outputs (split1, split2:
        where the second and third begin); ``times``: X multiplied by it first (its third input)."""
        from ...native import DOMAIN, GGML_TYPES

        starts = np.cumsum(widths)[:-1].tolist()
        splits = {f"split{j + 1}": int(at) for j, at in enumerate(starts)}
        self.node("GgufMatMul", [x, blocks] + ([times] if times else []), f"{name}.gguf_matmul", outputs=outs, domain=DOMAIN,
                  ggml_type=GGML_TYPES[kind], K=k, N=sum(widths), **splits)

    def _count(self, matrix: Matrix, storage: Storage | AsStored | None) -> None:
        if isinstance(matrix, GgufMatrix) and matrix.name not in self._counted:  # a tied head is the embedding
            self._counted.add(matrix.name)
            entry = self.gguf_types.setdefault(matrix.kind, {"count": 0, "stored": str(storage) if storage else "fp32"})
            entry["count"] += 1

    def _write_blocks(self, stem: str, matrices: list[GgufMatrix], storage: Storage, offsets: bool = False,
                      correction: bool = True) -> QuantizedWeights:
        """Codes (streamed, a range of rows at a time), scales and (for MatMulNBits) the correction
        of ``matrices`` stacked along N; with ``offsets``, the exact per-block offsets (the gather)."""
        scales: list[np.ndarray] = []
        corrections: list[np.ndarray] = []
        exact: list[np.ndarray] = []
        zero: list[int] = []
        k = matrices[0].shape[1]
        n = sum(m.shape[0] for m in matrices)
        blocks_per_row = k // storage.block

        def codes():  # decodes each range of rows once; keeps its (small) scales for after the codes
            for m in matrices:
                for a, b in m.row_ranges():
                    blocks = m.blocks(a, b)
                    scales.append(blocks.scale)
                    correction = blocks.correction()
                    corrections.append(np.zeros_like(blocks.scale) if correction is None else correction)
                    if offsets and blocks.offset is not None:
                        exact.append(blocks.offset)
                    zero.append(blocks.zero)
                    yield blocks.packed_codes()

        codes_proto = self.tensors.chunked(f"{stem}.codes", (n, blocks_per_row, storage.block * storage.bits // 8),
                                           np.uint8, codes())
        self.initializers.append(codes_proto)
        return QuantizedWeights(
            codes=codes_proto.name,
            scales=self.constant(f"{stem}.scales", np.concatenate(scales)),
            correction=self.constant(f"{stem}.block_offsets", np.ascontiguousarray(np.concatenate(corrections).T))
            if storage.correction and correction else None,
            offsets=self.constant(f"{stem}.offsets", np.concatenate(exact)) if exact else None,
            zero=zero[0], storage=storage, k=k, n=n)

    def _matmul_nbits(self, x: str, name: str, q: QuantizedWeights, out: str, rank: int) -> None:
        product = out if q.correction is None else f"{name}.from_codes"
        self.node("MatMulNBits", [x, q.codes, q.scales], f"{name}.matmul_nbits", outputs=[product], domain=MS_DOMAIN,
                  K=q.k, N=q.n, bits=q.storage.bits, block_size=q.storage.block, accuracy_level=self.accuracy_level)
        if q.correction is not None:
            shifted = self.node("MatMul", [self._blocksum(x, q.k, q.storage.block, rank), q.correction], f"{name}.offsets")
            self.node("Add", [product, shifted], f"{name}.add_offsets", outputs=[out])

    def _blocksum(self, x: str, k: int, block: int, rank: int) -> str:
        """Sums of ``x`` over each block of inputs, once per input tensor and block size."""
        if (x, block) not in self._blocksums:
            shape = [0] * (rank - 1) + [k // block, block]
            grouped = self.node("Reshape", [x, self.constant(f"{x}.blocks{block}.shape", np.asarray(shape, np.int64))],
                                f"{x}.blocks{block}")
            self._blocksums[x, block] = self.node(
                "ReduceSum", [grouped, self.constant(f"{x}.blocks{block}.axes", np.asarray([-1], np.int64))],
                f"{x}.blocksum{block}", keepdims=0)
        return self._blocksums[x, block]

    # -- the token embedding and the head ---------------------------------------------------------
    def embedding(self, ids: str, matrix: Matrix, tied: bool, name: str = "embed") -> str:
        """The rows of ``matrix`` [vocab, hidden] for token ids [batch, sequence]; ``tied``: the
        head multiplies by the same matrix (``lm_head``)."""
        storage = self.storage(matrix)
        self._count(matrix, storage)
        if storage is None:
            return self.node("Gather", [self.constant(f"{name}.weight", _fp32(matrix)), ids], name)
        assert isinstance(matrix, GgufMatrix)
        if isinstance(storage, AsStored):
            from ...native import DOMAIN, GGML_TYPES

            blocks = self._write_tiles(name, [matrix])
            self._embedding = (matrix, blocks)
            return self.node("GgufGather", [blocks, ids], name, domain=DOMAIN, ggml_type=GGML_TYPES[matrix.kind],
                             K=matrix.shape[1], N=matrix.shape[0])
        q = self._write_blocks(name, [matrix], storage, offsets=True, correction=tied)
        self._embedding = (matrix, q)
        codes = self.node("Gather", [q.codes, ids], f"{name}.row_codes")  # [batch, sequence, blocks, bytes]
        if storage.bits == 4:  # two codes a byte, the first in the low nibble
            low = self.node("BitwiseAnd", [codes, self.constant(f"{name}.low_mask", np.asarray(15, np.uint8))], f"{name}.low")
            high = self.node("BitShift", [codes, self.constant(f"{name}.shift", np.asarray(4, np.uint8))], f"{name}.high",
                             direction="RIGHT")
            last = self.constant(f"{name}.last_axis", np.asarray([-1], np.int64))
            pairs = self.node("Concat", [self.node("Unsqueeze", [low, last], f"{name}.low_pairs"),
                                         self.node("Unsqueeze", [high, last], f"{name}.high_pairs")], f"{name}.pairs", axis=-1)
            codes = self.node("Reshape", [pairs, self.constant(f"{name}.code_shape", np.asarray([0, 0, q.k // storage.block, storage.block], np.int64))],
                              f"{name}.unpacked")
        centered = self.node("Sub", [self.node("Cast", [codes], f"{name}.codes_float", to=1),
                                     self.constant(f"{name}.zero", np.asarray(q.zero, np.float32))], f"{name}.centered")
        last = self.constant(f"{name}.block_axis", np.asarray([-1], np.int64))
        scale = self.node("Unsqueeze", [self.node("Gather", [q.scales, ids], f"{name}.row_scales"), last], f"{name}.scale")
        values = self.node("Mul", [centered, scale], f"{name}.scaled")  # gguf-py: scale · code, then + offset
        if q.offsets is not None:
            offset = self.node("Unsqueeze", [self.node("Gather", [q.offsets, ids], f"{name}.row_offsets"), last], f"{name}.offset")
            values = self.node("Add", [values, offset], f"{name}.shifted")
        return self.node("Reshape", [values, self.constant(f"{name}.hidden_shape", np.asarray([0, 0, q.k], np.int64))], name)

    def lm_head(self, x: str, matrix: Matrix, output: str) -> str:
        """``x`` [positions, hidden] times ``matrix`` [vocab, hidden]; a tied head (the embedding's
        own GgufMatrix) reads the embedding's codes and scales."""
        if self._embedding is not None and matrix is self._embedding[0]:
            embedding, weights = self._embedding
            if isinstance(weights, str):  # the file's rows, for the native operators
                self.formats[str(AsStored(embedding.kind))] += 1
                self._gguf_matmul(x, "lm_head", weights, embedding.kind, embedding.shape[1], [embedding.shape[0]], [output])
            else:
                self.formats[str(weights.storage)] += 1
                self._matmul_nbits(x, "lm_head", weights, output, rank=2)
            return output
        return self.linear(x, "lm_head", [matrix], output=output, rank=2)[0]


# GgufMatMul's outputs at most (native/gguf_ops.c: MAX_PARTS)
MAX_SPLIT_OUTPUTS = 3


def _split_outputs(weights: list[Matrix], biases: list[np.ndarray] | None) -> bool:
    """Whether one GgufMatMul can write these projections to outputs of their own: no bias to add
    after it, each part but the last a whole number of tiles."""
    return biases is None and len(weights) <= MAX_SPLIT_OUTPUTS and all(w.shape[0] % TILE == 0 for w in weights[:-1])


def _gguf(matrices: list[Matrix]) -> list[GgufMatrix]:
    """Matrices stored as GGUF blocks: GGUF tensors all (``storage`` chooses blocks for no other)."""
    gguf = [m for m in matrices if isinstance(m, GgufMatrix)]
    assert len(gguf) == len(matrices)
    return gguf


def _fp32(matrix: Matrix) -> np.ndarray:
    return matrix.full() if isinstance(matrix, GgufMatrix) else np.asarray(matrix, np.float32)
