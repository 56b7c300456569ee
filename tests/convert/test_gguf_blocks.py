"""Every GGUF type the graph packs, on random but valid blocks: the stored codes, scales and
offsets give gguf-py's own dequantized values bit for bit; MatMulNBits (plus the block-sum
correction) multiplies by them to float rounding; the quantized embedding's gather gives them
exactly; a type without an exact form stays fp32."""

from __future__ import annotations

import numpy as np
import pytest

from generation_helpers import random_gguf_blocks
from modelkiln.convert.external_data import TensorFile
from modelkiln.convert.gguf.blocks import STORAGE, GgufMatrix, decode_blocks
from modelkiln.convert.generation.linear_weights import GraphBuilder

KINDS = list(STORAGE)  # every type packed exactly


def _raw(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    return random_gguf_blocks(kind, rows, cols, np.random.default_rng(seed))


def _gguf_values(kind: str, raw: np.ndarray) -> np.ndarray:
    import gguf

    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind])


@pytest.mark.parametrize("kind", KINDS)
def test_stored_blocks_are_gguf_values_bit_for_bit(kind):
    raw = _raw(kind, 6, 512)
    blocks = decode_blocks(kind, raw)
    storage = STORAGE[kind]
    assert blocks.codes.shape == (6, 512 // storage.block, storage.block) and blocks.codes.dtype == np.uint8
    assert int(blocks.codes.max()) < 2 ** storage.bits
    assert (blocks.correction() is not None) == storage.correction
    expected = _gguf_values(kind, raw)
    assert np.isfinite(expected).all()
    assert np.array_equal(blocks.dequantized().view(np.uint32), expected.view(np.uint32))


def _run(builder: GraphBuilder, inputs: dict[str, np.ndarray], output: str | list[str], tmp_path):
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    builder.tensors.close()
    feeds = [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(v.dtype), list(v.shape))
             for name, v in inputs.items()]
    outputs = [output] if isinstance(output, str) else output
    graph = helper.make_graph(builder.nodes, "g", feeds, [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
                              builder.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    onnx.save_model(model, str(tmp_path / "g.onnx"))
    session = ort.InferenceSession(str(tmp_path / "g.onnx"), providers=["CPUExecutionProvider"])
    results = session.run(None, inputs)
    return results[0] if isinstance(output, str) else results


@pytest.mark.parametrize("kind", KINDS)
def test_matmulnbits_multiplies_by_the_blocks(kind, tmp_path):
    """Two projections of one type share a node (stacked along N), for 3-D and 2-D inputs."""
    k = 512
    raws = [_raw(kind, 48, k, seed=1), _raw(kind, 16, k, seed=2)]
    matrices = [GgufMatrix(f"w{i}", kind, raw, (len(raw), k)) for i, raw in enumerate(raws)]
    weights = np.concatenate([_gguf_values(kind, raw) for raw in raws]).astype(np.float64)
    x = np.random.default_rng(3).standard_normal((2, 5, k)).astype(np.float32)
    for rank in (3, 2):
        g = GraphBuilder(TensorFile(tmp_path / f"rank{rank}.onnx"), pack=True, accuracy_level=0)
        [out] = g.linear("x", "proj", matrices, rank=rank)
        assert sum(n.op_type == "MatMulNBits" for n in g.nodes) == 1
        feed = x if rank == 3 else x.reshape(-1, k)
        got = _run(g, {"x": feed}, out, tmp_path)
        expected = feed.astype(np.float64) @ weights.T
        assert np.abs(got - expected).max() <= 2e-5 * np.abs(expected).max(), kind


@pytest.mark.parametrize("kind", KINDS)
def test_the_quantized_embedding_gathers_gguf_values_exactly(kind, tmp_path):
    raw = _raw(kind, 40, 256)
    g = GraphBuilder(TensorFile(tmp_path / "embed.onnx"), pack=True)
    out = g.embedding("ids", GgufMatrix("token_embd.weight", kind, raw, (40, 256)), tied=True)
    ids = np.array([[3, 0, 39, 3], [17, 8, 1, 22]], dtype=np.int64)
    got = _run(g, {"ids": ids}, out, tmp_path)
    expected = _gguf_values(kind, raw)[ids]
    assert got.shape == (2, 4, 256)
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))
    assert not any(n.op_type == "MatMulNBits" for n in g.nodes)
    assert g.gguf_types == {kind: {"count": 1, "stored": str(STORAGE[kind])}}


def test_projections_stored_differently_get_a_node_each(tmp_path):
    """q and k as Q4_K, v as Q6_K (a Q4_K_M file): one node for q and k, split, and one for v."""
    k = 256
    kinds = ["Q4_K", "Q4_K", "Q6_K"]
    raws = [_raw(kind, 32, k, seed=i) for i, kind in enumerate(kinds)]
    matrices = [GgufMatrix(f"w{i}", kind, raw, (32, k)) for i, (kind, raw) in enumerate(zip(kinds, raws))]
    g = GraphBuilder(TensorFile(tmp_path / "qkv.onnx"), pack=True, accuracy_level=0)
    outputs = g.linear("x", "qkv", matrices, parts=["q", "k", "v"])
    assert len(outputs) == 3 and sum(n.op_type == "MatMulNBits" for n in g.nodes) == 2
    assert g.gguf_types == {"Q4_K": {"count": 2, "stored": "4-bit, block 32, min correction"},
                            "Q6_K": {"count": 1, "stored": "8-bit, block 16"}}
    x = np.random.default_rng(5).standard_normal((1, 3, k)).astype(np.float32)
    for got, raw, kind in zip(_run(g, {"x": x}, outputs, tmp_path), raws, kinds):
        expected = x.astype(np.float64) @ _gguf_values(kind, raw).astype(np.float64).T
        assert got.shape == (1, 3, 32) and np.abs(got - expected).max() <= 2e-5 * np.abs(expected).max()


def test_a_type_without_an_exact_form_stays_fp32(tmp_path):
    """IQ4_NL's codes index a non-uniform grid: dequantized to fp32 and counted as such, never re-quantized."""
    import gguf

    rng = np.random.default_rng(0)
    raw = random_gguf_blocks("IQ4_NL", 16, 128, rng)
    matrix = GgufMatrix("w", "IQ4_NL", raw, (16, 128))
    assert not matrix.packable
    g = GraphBuilder(TensorFile(tmp_path / "iq.onnx"), pack=True)
    [out] = g.linear("x", "proj", [matrix])
    assert [n.op_type for n in g.nodes] == ["MatMul"] and g.gguf_types == {"IQ4_NL": {"count": 1, "stored": "fp32"}}
    x = rng.standard_normal((2, 128)).astype(np.float32)
    expected = x @ gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.IQ4_NL).T
    assert np.allclose(_run(g, {"x": x}, out, tmp_path), expected, rtol=1e-5, atol=1e-5)
