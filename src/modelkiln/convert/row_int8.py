"""Batch-invariant int8: every MatMul with a constant weight becomes an integer matmul whose
activation scale is computed per row (per token) instead of per tensor.

Why not ONNX Runtime's ``quantize_dynamic``: its DynamicQuantizeLinear picks one scale and zero point
for the whole activation tensor, i.e. for every token of every text in the batch, padding included.
A text's answer then depends on what it was batched with (all-MiniLM-L6-v2: cosine 0.95 to 0.99
between a sentence alone and the same sentence under load). Here each row of the activation
(one token of one text) is scaled by its own largest magnitude, so a row's result reads that row
only. The weights are int8 with one symmetric scale per output column, computed once here.

For each ``Y = MatMul(X, W)`` with ``W`` a constant [K, N] float matrix::

    s   = max(ReduceMax(|X|, last axis), tiny) / 127        # [..., 1]: one scale per row
    Xq  = Cast<int8>(Round(X / s))                          # |X / s| <= 127, so no clipping
    Y   = Cast<float>(MatMulInteger(Xq, Wq)) * s * w_scale  # w_scale: [N], per output column

Both zero points are 0 (symmetric), so MatMulInteger needs none. MatMuls inside fused contrib ops
(``Attention``'s packed QKV weight) are left in float: quantize the unfused graph to cover them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..manifest import weights_file
from .export import has_external_data

# Rows of zeros (or denormal noise) would divide by zero; any scale works for them, since every
# element quantizes to 0 anyway.
_TINY = np.float32(1e-12)
_QMAX = np.float32(127.0)


def _float_weights(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    return {init.name: numpy_helper.to_array(init) for init in graph.initializer
            if init.data_type == TensorProto.FLOAT and len(init.dims) == 2}


def quantize_weight(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 per output column: (int8 [K, N], float32 scales [N])."""
    scale = np.maximum(np.abs(w).max(axis=0), _TINY) / _QMAX
    q = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
    return q, scale.astype(np.float32)


def _row_max(p: str, opset: int) -> onnx.NodeProto:
    # ReduceMax takes its axes as an attribute before opset 18 and as an input from 18 on.
    if opset >= 18:
        return helper.make_node("ReduceMax", [f"{p}/abs", "row_int8/last_axis"], [f"{p}/amax"], name=f"{p}/ReduceMax",
                                keepdims=1)
    return helper.make_node("ReduceMax", [f"{p}/abs"], [f"{p}/amax"], name=f"{p}/ReduceMax", axes=[-1], keepdims=1)


def _rewrite(node: onnx.NodeProto, wq_name: str, ws_name: str, opset: int) -> list[onnx.NodeProto]:
    x, (y,) = node.input[0], node.output
    p = (node.name or y) + "/row_int8"
    return [
        helper.make_node("Abs", [x], [f"{p}/abs"], name=f"{p}/Abs"),
        _row_max(p, opset),
        helper.make_node("Max", [f"{p}/amax", "row_int8/tiny"], [f"{p}/amax_safe"], name=f"{p}/Max"),
        helper.make_node("Div", [f"{p}/amax_safe", "row_int8/qmax"], [f"{p}/scale"], name=f"{p}/Scale"),
        helper.make_node("Div", [x, f"{p}/scale"], [f"{p}/scaled"], name=f"{p}/Div"),
        helper.make_node("Round", [f"{p}/scaled"], [f"{p}/rounded"], name=f"{p}/Round"),
        helper.make_node("Add", [f"{p}/rounded", "row_int8/offset"], [f"{p}/shifted"], name=f"{p}/Shift"),
        helper.make_node("Cast", [f"{p}/shifted"], [f"{p}/xq"], name=f"{p}/CastUint8", to=TensorProto.UINT8),
        helper.make_node("MatMulInteger", [f"{p}/xq", wq_name, "row_int8/zero_point"], [f"{p}/acc"],
                         name=f"{p}/MatMulInteger"),
        helper.make_node("Cast", [f"{p}/acc"], [f"{p}/accf"], name=f"{p}/CastFloat", to=TensorProto.FLOAT),
        helper.make_node("Mul", [f"{p}/accf", f"{p}/scale"], [f"{p}/rowscaled"], name=f"{p}/RowScale"),
        helper.make_node("Mul", [f"{p}/rowscaled", ws_name], [y], name=f"{p}/ColumnScale"),
    ]


def quantize_per_row(src: Path, dst: Path, min_size: int = 0) -> int:
    """Rewrite ``src`` into ``dst``; returns how many MatMuls were quantized. Weights with fewer than
    ``min_size`` elements stay float (the cost of quantizing activations outweighs tiny matmuls)."""
    model = onnx.load(str(src))
    graph = model.graph
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    weights = _float_weights(graph)
    readers: dict[str, int] = {}
    for n in graph.node:
        for name in n.input:
            readers[name] = readers.get(name, 0) + 1

    nodes: list[onnx.NodeProto] = []
    replaced: set[str] = set()
    count = 0
    for node in graph.node:
        w = weights.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
        if w is None or w.size < min_size:
            nodes.append(node)
            continue
        wq, ws = quantize_weight(w)
        wq_name, ws_name = f"{node.input[1]}/int8", f"{node.input[1]}/scale"
        if wq_name not in {i.name for i in graph.initializer}:
            graph.initializer.extend([numpy_helper.from_array(wq, wq_name), numpy_helper.from_array(ws, ws_name)])
        readers[node.input[1]] -= 1
        replaced.add(node.input[1])
        nodes.extend(_rewrite(node, wq_name, ws_name, opset))
        count += 1
    if not count:
        raise ValueError("no MatMul with a constant 2-D float weight to quantize")

    unused = {name for name in replaced if readers[name] == 0}
    kept = [init for init in graph.initializer if init.name not in unused]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    graph.initializer.extend([numpy_helper.from_array(np.array(_TINY), "row_int8/tiny"),
                              numpy_helper.from_array(np.array(_QMAX), "row_int8/qmax"),
                              numpy_helper.from_array(np.array(128.0, dtype=np.float32), "row_int8/offset"),
                              numpy_helper.from_array(np.array(128, dtype=np.uint8), "row_int8/zero_point")])
    if opset >= 18:  # ReduceMax's axes input; below 18 an unused initializer makes ORT warn at every load
        graph.initializer.append(numpy_helper.from_array(np.array([-1], dtype=np.int64), "row_int8/last_axis"))
    del graph.node[:]
    graph.node.extend(nodes)
    if has_external_data(src):  # keep the artifact's layout: weights beside the graph
        onnx.save(model, str(dst), save_as_external_data=True, location=weights_file(dst).name)
    else:
        onnx.save(model, str(dst))
    return count
