"""int4 straight from a GGUF file's own quantized blocks.

A GGUF Q4_1 weight is stored in blocks of 32 along the input dimension: codes ``q`` in 0..15, a
scale ``d`` and a minimum ``m`` per block (both fp16), and ``w = d·q + m``. transformers loads the
file dequantized to exactly those fp32 values, which the decoder export writes as MatMul weights.
Re-quantizing them with onnxruntime's symmetric 4-bit grid throws the GGUF grid away and adds a
second rounding (SmolLM2: perplexity +28%). Packing the GGUF's own codes into ``MatMulNBits``
instead loses nothing: the int4 graph computes the same weights as the fp32 graph.

MatMulNBits computes ``w = scale · (q − zero_point)``. Float zero points (``−m/d``) would express
Q4_1 directly, but onnxruntime 1.32's CPU kernel takes them only on its unpacked path (measured
8 ms against 0.24 ms for one 576×1536 MatMul), so a Q4_1 MatMul is split the way llama.cpp's
own Q4_1 dot product is:

    x·W = MatMulNBits(x; q, d, zero point 8) + blocksum(x) · C,   C = m + 8·d per block

where ``blocksum(x)`` sums ``x`` over each block of 32 inputs (a MatMul with a 0/1 matrix,
computed once per distinct input: q/k/v and gate/up share theirs) and ``C`` is [blocks, N] fp32,
one value per 32 weights. Q4_0 (``w = d·(q − 8)``) and Q8_0 (``w = d·q``, codes shifted to
unsigned with zero point 128) are MatMulNBits' own symmetric formats, packed as they are.

Which GGUF tensor is which graph weight is found by value, not by name: every row of the
dequantized GGUF tensor is looked up among the columns of the graph's weights. That also recovers
the row order transformers changes when it loads a Llama's q/k projections (it undoes llama.cpp's
rotary permutation), and works for any architecture transformers reads from GGUF."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConversionError

log = logging.getLogger(__name__)

BLOCK = 32  # weights per block in every GGUF type packed here
MS_DOMAIN = "com.microsoft"
PACKABLE = ("Q4_0", "Q4_1", "Q8_0")  # GGUF types MatMulNBits can take as they are


@dataclass(frozen=True)
class Blocks:
    """One GGUF tensor's blocks as MatMulNBits wants them: ``codes`` [N, blocks, 32] unsigned,
    ``scale`` [N, blocks]; the weight is ``scale · (codes − zero) + offset``."""

    kind: str
    codes: np.ndarray
    scale: np.ndarray
    bits: int
    zero: int
    offset: np.ndarray | None = None  # Q4_1's minimum m per block

    @staticmethod
    def concat(parts: list[Blocks]) -> Blocks | None:
        """Several weights' blocks stacked along N (fused projections), or None when their types differ."""
        first = parts[0]
        if any((p.kind, p.bits, p.zero) != (first.kind, first.bits, first.zero) for p in parts):
            return None
        offset = None if first.offset is None else np.concatenate([p.offset for p in parts])  # type: ignore[misc]
        return Blocks(first.kind, np.concatenate([p.codes for p in parts]), np.concatenate([p.scale for p in parts]),
                      first.bits, first.zero, offset)

    def take_rows(self, rows: np.ndarray) -> Blocks:
        return Blocks(self.kind, self.codes[rows], self.scale[rows], self.bits, self.zero,
                      None if self.offset is None else self.offset[rows])

    def dequantized(self) -> np.ndarray:
        """[N, K] float32, as MatMulNBits (plus the Q4_1 correction) computes it."""
        w = self.scale[..., None] * (self.codes.astype(np.float32) - self.zero)
        if self.offset is not None:
            w = w + self.offset[..., None]
        return w.reshape(w.shape[0], -1)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """GGUF's 16 bytes per block → 32 codes: the low nibbles are elements 0..15, the high 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def read_blocks(tensor: Any) -> Blocks | None:
    """A ``gguf.ReaderTensor`` of type Q4_0, Q4_1 or Q8_0 as Blocks; None for any other type."""
    from gguf import GGMLQuantizationType as T

    kind = tensor.tensor_type
    if kind.name not in PACKABLE:
        return None
    raw = np.asarray(tensor.data)
    rows = raw.shape[0]
    per_block = {T.Q4_0: 18, T.Q4_1: 20, T.Q8_0: 34}[kind]
    blocks = raw.reshape(rows, -1, per_block)

    def half(lo: int) -> np.ndarray:
        return blocks[..., lo:lo + 2].copy().view(np.float16)[..., 0].astype(np.float32)

    if kind == T.Q4_0:
        return Blocks("Q4_0", _nibbles(blocks[..., 2:]), half(0), bits=4, zero=8)
    if kind == T.Q4_1:
        return Blocks("Q4_1", _nibbles(blocks[..., 4:]), half(0), bits=4, zero=0, offset=half(2))
    signed = blocks[..., 2:].copy().view(np.int8)
    return Blocks("Q8_0", (signed.astype(np.int16) + 128).astype(np.uint8), half(0), bits=8, zero=128)


def has_packable_blocks(gguf_path: Path) -> bool:
    """Whether the file holds any Q4_0/Q4_1 tensor (the int4 this module builds)."""
    from gguf import GGMLQuantizationType as T

    return any(t.tensor_type in (T.Q4_0, T.Q4_1) for t in read_gguf(gguf_path).tensors)


def read_gguf(path: Path) -> Any:
    """The file's ``GGUFReader``: the one transformers' loading parsed already (``source.one_gguf_parse``:
    parsing SmolLM2's vocabulary alone takes seconds)."""
    import gguf

    from .source import one_gguf_parse

    with one_gguf_parse():
        return gguf.GGUFReader(str(path))


class GgufRowIndex:
    """Every row of every packable GGUF tensor, dequantized the way transformers does it
    (``gguf.dequantize``), keyed by its bytes."""

    def __init__(self, reader: Any) -> None:
        from gguf import dequantize

        self._blocks: dict[str, Blocks] = {}
        self.tensors = {t.name: t for t in reader.tensors if t.tensor_type.name in PACKABLE}
        self.rows: dict[bytes, list[tuple[str, int]]] = {}
        for name, t in self.tensors.items():
            values = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
            for i, row in enumerate(values):
                self.rows.setdefault(row.tobytes(), []).append((name, i))

    def match(self, weight: np.ndarray) -> tuple[str, np.ndarray] | None:
        """(tensor name, GGUF row of each column) for a [K, N] MatMul weight, or None."""
        columns = np.ascontiguousarray(weight.T, dtype=np.float32)
        found = [self.rows.get(c.tobytes()) for c in columns]
        if any(f is None for f in found):
            return None
        names = set.intersection(*({n for n, _ in f} for f in found))  # type: ignore[union-attr]
        if not names:
            return None
        name = sorted(names)[0]
        return name, np.asarray([next(i for n, i in f if n == name) for f in found])  # type: ignore[union-attr]

    def blocks_for(self, weight: np.ndarray) -> Blocks | None:
        """The GGUF blocks that dequantize to exactly ``weight`` ([K, N], a MatMul's), or None."""
        found = self.match(weight) if weight.ndim == 2 and weight.shape[0] % BLOCK == 0 else None
        if found is None:
            return None
        name, rows = found
        if name not in self._blocks:
            self._blocks[name] = read_blocks(self.tensors[name])  # type: ignore[assignment]
        blocks = self._blocks[name].take_rows(rows)
        error = float(np.abs(blocks.dequantized() - weight.T).max())
        if error > 1e-5 * max(float(np.abs(weight).max()), 1.0):
            raise ConversionError(f"GGUF tensor {name} does not reproduce a graph weight [{weight.shape[0]}, "
                                  f"{weight.shape[1]}] (max |Δ| {error:.3g}); cannot pack its blocks")
        return blocks


def packed_codes(blocks: Blocks) -> np.ndarray:
    """MatMulNBits' B: [N, blocks, 32·bits/8] bytes, 4-bit codes two to a byte, the first in the low nibble."""
    if blocks.bits == 8:
        return blocks.codes
    return (blocks.codes[..., 0::2] | (blocks.codes[..., 1::2] << 4)).astype(np.uint8)


def pack_gguf_blocks(src: Path, dst: Path, gguf_path: Path, accuracy_level: int) -> dict[str, int]:
    """Write ``dst``: the fp32 decoder ``src`` with every MatMul whose weight is a Q4_0/Q4_1/Q8_0
    tensor of ``gguf_path`` turned into MatMulNBits over that tensor's own blocks (Q4_1 with its
    block-minimum correction). Other MatMuls stay fp32. Returns counts per GGUF type (and ``fp32``
    for the MatMuls left as they were)."""
    import onnx
    from onnx import helper, numpy_helper

    from .variants import materialize_transposed_weights

    model = onnx.load(str(src))
    materialize_transposed_weights(model)
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    index = GgufRowIndex(read_gguf(gguf_path))
    blocksums: dict[str, str] = {}  # MatMul input → its per-block sums
    counts: Counter[str] = Counter()
    new_nodes: list[Any] = []

    def blocksum(x: str, k: int) -> str:
        if x not in blocksums:
            ones = f"gguf_blocksum_{k}"
            if ones not in inits:
                indicator = np.kron(np.eye(k // BLOCK, dtype=np.float32), np.ones((BLOCK, 1), np.float32))
                inits[ones] = numpy_helper.from_array(indicator, ones)
                graph.initializer.append(inits[ones])
            blocksums[x] = f"{x}.gguf_blocksum"
            new_nodes.append(helper.make_node("MatMul", [x, ones], [blocksums[x]], name=f"{x}.gguf_blocksum"))
        return blocksums[x]

    for node in graph.node:
        weight_init = inits.get(node.input[1]) if node.op_type == "MatMul" else None
        if weight_init is None:
            new_nodes.append(node)
            continue
        weight = numpy_helper.to_array(weight_init)
        blocks = index.blocks_for(weight)
        if blocks is None:
            counts["fp32"] += 1
            new_nodes.append(node)
            continue
        k, n = weight.shape
        stem = f"{weight_init.name}.gguf_{blocks.kind.lower()}"
        packed = numpy_helper.from_array(packed_codes(blocks), f"{stem}.codes")
        scales = numpy_helper.from_array(blocks.scale.reshape(-1).astype(np.float32), f"{stem}.scales")
        graph.initializer.extend([packed, scales])
        x, out = node.input[0], node.output[0]
        product = out if blocks.offset is None else f"{out}.gguf_codes"
        new_nodes.append(helper.make_node("MatMulNBits", [x, packed.name, scales.name], [product], name=f"{node.name}.nbits",
                                          domain=MS_DOMAIN, K=k, N=n, bits=blocks.bits, block_size=BLOCK,
                                          accuracy_level=accuracy_level))
        if blocks.offset is not None:  # Q4_1: MatMulNBits took the codes from its default zero point 8
            correction = (blocks.offset + 8.0 * blocks.scale).T.astype(np.float32)  # [blocks, N]
            codes_from_8 = numpy_helper.from_array(correction, f"{stem}.block_offsets")
            graph.initializer.append(codes_from_8)
            shifted = f"{out}.gguf_offsets"
            new_nodes.append(helper.make_node("MatMul", [blocksum(x, k), codes_from_8.name], [shifted], name=f"{node.name}.offsets"))
            new_nodes.append(helper.make_node("Add", [product, shifted], [out], name=f"{node.name}.add_offsets"))
        counts[blocks.kind] += 1
    if not any(counts[k] for k in ("Q4_0", "Q4_1")):
        raise ConversionError(f"no MatMul weight of the graph matches a Q4_0/Q4_1 tensor of {gguf_path.name}")
    del graph.node[:]
    graph.node.extend(_topological(new_nodes, graph))
    used = {i for nd in graph.node for i in nd.input}
    keep = [i for i in graph.initializer if i.name in used]
    del graph.initializer[:]
    graph.initializer.extend(keep)
    if not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    onnx.save_model(model, str(dst), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=dst.name + ".data", size_threshold=1024)
    log.info("packed GGUF blocks into MatMulNBits: %s", dict(counts))
    return dict(counts)


def _topological(nodes: list[Any], graph: Any) -> list[Any]:
    """The block sums are appended where first needed, after their input's producer and before
    their readers, so the list is already in order; checked here rather than assumed."""
    known = {i.name for i in graph.input} | {i.name for i in graph.initializer} | {""}
    for node in nodes:
        missing = [i for i in node.input if i not in known]
        if missing:
            raise ConversionError(f"packing GGUF blocks broke the graph's order at {node.name} ({missing})")
        known.update(node.output)
    return nodes
