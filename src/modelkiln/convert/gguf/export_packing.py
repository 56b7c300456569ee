"""The packed variant of a GGUF source whose architecture the serving graph does not cover.

Such a model is loaded by transformers (dequantized to fp32) and exported by torch
(``decoder_export.py``); its MatMul weights then carry no GGUF names. Which GGUF tensor is which
weight is found by value instead: every row of every packable tensor, dequantized as transformers
does it, is looked up among the columns of each MatMul weight; a weight whose columns are all rows
of one tensor becomes ``MatMulNBits`` over that tensor's blocks (``gguf/blocks.py``), the block-sum
correction added where the type needs one. Other MatMuls stay fp32.

The serving graph's architectures never come here: their GGUF files are read by tensor name
(``gguf/decoder.py``), without the fp32 model."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import ConversionError
from ...manifest import weights_file
from .blocks import STORAGE, Blocks, decode_blocks

log = logging.getLogger(__name__)

MS_DOMAIN = "com.microsoft"


class GgufRowIndex:
    """Every row of every packable GGUF tensor, dequantized the way transformers does it, keyed by its bytes."""

    def __init__(self, reader: Any) -> None:
        from gguf import dequantize

        self.tensors = {t.name: t for t in reader.tensors if t.tensor_type.name in STORAGE}
        self.rows: dict[bytes, list[tuple[str, int]]] = {}
        for name, t in self.tensors.items():
            values = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
            for i, row in enumerate(values):
                self.rows.setdefault(row.tobytes(), []).append((name, i))

    def match(self, weight: np.ndarray) -> tuple[str, np.ndarray] | None:
        """(tensor name, GGUF row of each column) for a [K, N] MatMul weight, or None."""
        columns = np.ascontiguousarray(weight.T, dtype=np.float32)
        found = [self.rows.get(c.tobytes()) for c in columns]
        matched = [f for f in found if f is not None]
        if len(matched) < len(found):
            return None
        names = set.intersection(*({n for n, _ in f} for f in matched))
        if not names:
            return None
        name = sorted(names)[0]
        return name, np.asarray([next(i for n, i in f if n == name) for f in matched])

    def blocks_for(self, weight: np.ndarray) -> Blocks | None:
        """The GGUF blocks that dequantize to exactly ``weight`` ([K, N], a MatMul's), or None."""
        found = self.match(weight) if weight.ndim == 2 else None
        if found is None:
            return None
        name, rows = found
        t = self.tensors[name]
        blocks = decode_blocks(t.tensor_type.name, np.asarray(t.data)[rows])
        if not np.array_equal(blocks.dequantized(), weight.T):
            raise ConversionError(f"GGUF tensor {name} does not reproduce a graph weight [{weight.shape[0]}, "
                                  f"{weight.shape[1]}]; cannot pack its blocks")
        return blocks


def pack_gguf_blocks(src: Path, dst: Path, gguf_path: Path, accuracy_level: int) -> dict[str, dict[str, Any]]:
    """Write ``dst``: the fp32 decoder ``src`` with every MatMul whose weight is a packable tensor
    of ``gguf_path`` turned into MatMulNBits over that tensor's own blocks. Returns, per GGUF
    type, how many MatMuls it holds and how they are stored (``fp32``: the MatMuls left as they were)."""
    import onnx
    from onnx import helper, numpy_helper

    from .decoder import read_gguf
    from ..variants import materialize_transposed_weights

    model = onnx.load(str(src))
    materialize_transposed_weights(model)
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    index = GgufRowIndex(read_gguf(gguf_path))
    blocksums: dict[tuple[str, int], str] = {}  # (MatMul input, block) → its per-block sums
    found: dict[str, dict[str, Any]] = {}
    new_nodes: list[Any] = []

    def blocksum(x: str, k: int, block: int) -> str:
        """A MatMul with a 0/1 matrix: unlike a Reshape, it works whatever the rank of ``x``."""
        if (x, block) not in blocksums:
            ones = f"gguf_blocksum_{k}_{block}"
            if ones not in inits:
                indicator = np.kron(np.eye(k // block, dtype=np.float32), np.ones((block, 1), np.float32))
                inits[ones] = numpy_helper.from_array(indicator, ones)
                graph.initializer.append(inits[ones])
            blocksums[x, block] = f"{x}.gguf_blocksum{block}"
            new_nodes.append(helper.make_node("MatMul", [x, ones], [blocksums[x, block]], name=f"{x}.gguf_blocksum{block}"))
        return blocksums[x, block]

    for node in graph.node:
        weight_init = inits.get(node.input[1]) if node.op_type == "MatMul" else None
        if weight_init is None:
            new_nodes.append(node)
            continue
        weight = numpy_helper.to_array(weight_init)
        blocks = index.blocks_for(weight)
        if blocks is None:
            found.setdefault("fp32", {"count": 0, "stored": "fp32"})["count"] += 1
            new_nodes.append(node)
            continue
        storage = blocks.storage
        k, n = weight.shape
        stem = f"{weight_init.name}.gguf_{blocks.kind.lower()}"
        packed = numpy_helper.from_array(blocks.packed_codes(), f"{stem}.codes")
        scales = numpy_helper.from_array(blocks.scale, f"{stem}.scales")
        graph.initializer.extend([packed, scales])
        x, out = node.input[0], node.output[0]
        correction = blocks.correction()
        product = out if correction is None else f"{out}.gguf_codes"
        new_nodes.append(helper.make_node("MatMulNBits", [x, packed.name, scales.name], [product], name=f"{node.name}.nbits",
                                          domain=MS_DOMAIN, K=k, N=n, bits=storage.bits, block_size=storage.block,
                                          accuracy_level=accuracy_level))
        if correction is not None:
            offsets = numpy_helper.from_array(np.ascontiguousarray(correction.T), f"{stem}.block_offsets")
            graph.initializer.append(offsets)
            shifted = f"{out}.gguf_offsets"
            new_nodes.append(helper.make_node("MatMul", [blocksum(x, k, storage.block), offsets.name], [shifted],
                                              name=f"{node.name}.offsets"))
            new_nodes.append(helper.make_node("Add", [product, shifted], [out], name=f"{node.name}.add_offsets"))
        found.setdefault(blocks.kind, {"count": 0, "stored": str(storage)})["count"] += 1
    if not set(found) - {"fp32"}:
        raise ConversionError(f"no MatMul weight of the graph matches a quantized tensor of {gguf_path.name}")
    del graph.node[:]
    graph.node.extend(_in_order(new_nodes, graph))
    used = {i for nd in graph.node for i in nd.input}
    keep = [i for i in graph.initializer if i.name in used]
    del graph.initializer[:]
    graph.initializer.extend(keep)
    if not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    onnx.save_model(model, str(dst), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=weights_file(dst).name, size_threshold=1024)
    log.info("packed GGUF blocks into MatMulNBits: %s", found)
    return found


def _in_order(nodes: list[Any], graph: Any) -> list[Any]:
    """The block sums are appended where first needed, after their input's producer and before
    their readers, so the list is already in order; checked here rather than assumed."""
    known = {i.name for i in graph.input} | {i.name for i in graph.initializer} | {""}
    for node in nodes:
        missing = [i for i in node.input if i not in known]
        if missing:
            raise ConversionError(f"packing GGUF blocks broke the graph's order at {node.name} ({missing})")
        known.update(node.output)
    return nodes
