"""`kiln convert` of a GGUF file: the Llama family read by tensor name (q/k rows as transformers
loads them), every matrix in its own blocks, the layer-by-layer reference agreeing with the whole
model, other architectures packed by value; and bad input: each a one-line error (exit 2) with
nothing left in --out, a killed convert leaving nothing that looks like an artifact."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from generation_helpers import write_tiny_gguf
from helpers import SRC, assert_one_line_error, kiln
from modelkiln.convert.pipeline import ConvertConfig, convert
from modelkiln.errors import ArtifactError, ModelLoadError, ModelTooLargeError, UnsupportedArchitectureError
from modelkiln.generation.engines.registry import EngineOptions
from modelkiln.generation.model import TextGenerationModel
from modelkiln.machine import cpu_flags, matrix_engine
from modelkiln.native import LAYOUT

PROMPT = "The quick brown fox jumps over the lazy dog"


def _convert(model, out, **options):
    options = {"gate_short": 2, "gate_squad": 1, "threads": 1, "timing_seconds": 0.2, "task": "text-generation", **options}
    return convert(ConvertConfig(model=str(model), out=out, **options))


def _torch_model(gguf_path):
    import torch
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                   dtype=torch.float32).eval()


def _assert_logits_near_pytorch(artifact_folder, gguf_path):
    """The packed variant's logits on PROMPT are PyTorch's on the same file to int8-activation
    rounding (activations are quantized to int8 per 256 or 32 inputs, as llama.cpp does, layer after
    layer): relative RMS under 3%, the same argmax at 80% of positions."""
    import torch

    artifact = TextGenerationModel(artifact_folder)
    ids = artifact.prompt_ids(PROMPT)
    with torch.no_grad():
        expected = _torch_model(gguf_path)(torch.tensor([ids])).logits[0].numpy()
    got = artifact.engine(None, EngineOptions(threads=1)).prefill("p", ids, all_logits=True)
    assert np.sqrt(np.mean((got - expected) ** 2)) < 0.03 * np.sqrt(np.mean(expected ** 2))
    assert (got.argmax(-1) == expected.argmax(-1)).mean() >= 0.8


def _decoder(gguf_path):
    from modelkiln.convert.gguf.decoder import GgufDecoder
    from modelkiln.convert.source import load_gguf_source

    return GgufDecoder(gguf_path, load_gguf_source(str(gguf_path), gguf_path, with_tokenizer=False).config)


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_weights_by_name_are_what_transformers_loads(tmp_path, architecture):
    """A Llama's q/k rows are permuted back (whole rows, blocks and all); Qwen2's are not, and its
    biases come along."""
    gguf_path = write_tiny_gguf(tmp_path / "tiny.gguf", matrices="Q4_K", embedding="Q6_K", architecture=architecture,
                                hidden=256, ff=256)
    decoder = _decoder(gguf_path)
    model = _torch_model(gguf_path)
    layer = model.model.layers[1]
    for role, param in [("q", layer.self_attn.q_proj.weight), ("k", layer.self_attn.k_proj.weight),
                        ("v", layer.self_attn.v_proj.weight), ("down", layer.mlp.down_proj.weight)]:
        matrix = decoder.tensor(f"layers.1.{role}")
        expected = param.detach().numpy()
        assert np.array_equal(matrix.full(), expected), role
        assert np.array_equal(matrix.blocks().dequantized(), expected), role  # the blocks moved with their rows
    if architecture == "qwen2":
        assert np.array_equal(decoder.tensor("layers.1.k_bias"), layer.self_attn.k_proj.bias.detach().numpy())
    assert decoder.tensor("lm_head") is decoder.tensor("embed")  # tied: one matrix


def test_the_layer_reference_agrees_with_the_whole_model(tmp_path):
    from modelkiln.convert.generation.reference import LayerReference, WholeModelReference
    from modelkiln.convert.generation.logit_store import LogitStore

    gguf_path = write_tiny_gguf(tmp_path / "tiny.gguf", matrices="Q4_1", embedding="Q8_0")
    rng = np.random.default_rng(0)
    sequences = [tuple(rng.integers(3, 400, n).tolist()) for n in (5, 17, 2, 40, 9)]
    paragraphs = [rng.integers(3, 400, n).tolist() for n in (30, 12, 21)]
    with LogitStore(400) as layered, LogitStore(400) as whole:
        ppl_layered = LayerReference(_decoder(gguf_path)).run(sequences, paragraphs, layered)
        ppl_whole = WholeModelReference(_torch_model(gguf_path)).run(sequences, paragraphs, whole)
        for s in sequences:
            a, b = layered.get(s), whole.get(s)
            assert a.shape == (len(s), 400)
            assert np.abs(a - b).max() < 1e-4 * np.abs(b).max()
            assert (a.argmax(-1) == b.argmax(-1)).all()
    assert ppl_layered == pytest.approx(ppl_whole, rel=1e-5)


def test_k_quants_mixed_in_projections_and_a_type_kept_fp32(tmp_path):
    """A Q4_K_M-like file: q/k Q4_K, v and down Q6_K, up Q5_K, gate IQ4_NL (no exact form: fp32,
    said so), the head Q6_K untied. The packed graph holds the file's weights: at accuracy level 0,
    PyTorch's logits to float rounding and its greedy tokens."""
    import onnx
    import torch

    gguf_path = write_tiny_gguf(tmp_path / "gguf" / "tiny.gguf", matrices="Q4_K", embedding="Q4_K", hidden=256, ff=256,
                                types={"attn_v": "Q6_K", "ffn_down": "Q6_K", "ffn_up": "Q5_K", "ffn_gate": "IQ4_NL",
                                       "output": "Q6_K"}, tied=False)
    out = tmp_path / "art"
    manifest = _convert(gguf_path, out, int4_accuracy_level=0, native_gguf=False)
    [packed] = manifest.variants
    assert packed.name == "gguf" and packed.kept, packed.reason
    assert packed.details["from_gguf"] == {
        "Q4_K": {"count": 7, "stored": "4-bit, block 32, min correction"},  # q, k, o of 2 layers and the embedding
        "Q6_K": {"count": 5, "stored": "8-bit, block 16"},
        "Q5_K": {"count": 2, "stored": "8-bit, block 32, min correction"},
        "IQ4_NL": {"count": 2, "stored": "fp32"}}
    assert packed.details["notes"] == ["IQ4_NL: 2 tensors dequantized to fp32 (no exact MatMulNBits form)"]
    assert "IQ4_NL" in packed.reason
    graph = onnx.load(str(out / "model.gguf.onnx"), load_external_data=False).graph
    attention = next(n for n in graph.node if n.op_type == "GroupQueryAttention")
    assert all(attention.input[:3]), "q, k and v as three inputs: v is stored otherwise"
    assert sum(n.op_type == "MatMulNBits" for n in graph.node) == 2 * 5 + 1  # qk, v, o, up, down per layer; head
    artifact = TextGenerationModel(out)
    ids = artifact.prompt_ids(PROMPT)
    model = _torch_model(gguf_path)
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0].numpy()
    got = artifact.engine(None, EngineOptions(threads=1)).prefill("p", ids, all_logits=True)
    assert np.abs(got - expected).max() < 1e-5 * np.abs(expected).max()


@pytest.mark.skipif(__import__("modelkiln.native", fromlist=["library_path"]).library_path() is None,
                    reason="the native library is not built on this machine")
def test_k_quants_as_stored_for_the_native_operators(tmp_path):
    """By default (--native-gguf), Q4_K, Q5_K and Q6_K stay the file's own rows (q and k one node, v another;
    gate and up apart, stored apart), the embedding is gathered from its blocks and the tied head reads the
    same rows. The logits are PyTorch's to int8-activation rounding, and the gate (alone = batched)
    passes. (With --no-native-gguf every type keeps its MatMulNBits form: test_gguf_blocks.py.)"""
    import onnx

    gguf_path = write_tiny_gguf(tmp_path / "gguf" / "tiny.gguf", matrices="Q4_K", embedding="Q6_K", hidden=256, ff=256,
                                types={"attn_v": "Q6_K", "ffn_up": "Q5_K"})
    out = tmp_path / "art"
    manifest = _convert(gguf_path, out)
    [packed] = manifest.variants
    assert packed.kept, packed.reason
    assert packed.details["native_ops"] == LAYOUT
    for kind in ("Q4_K", "Q5_K", "Q6_K"):
        assert packed.details["from_gguf"][kind]["stored"] == f"{kind} blocks as in the file, in tiles of 16 rows (GgufMatMul)"
    graph = onnx.load(str(out / "model.gguf.onnx"), load_external_data=False).graph
    ops = [n.op_type for n in graph.node]
    assert ops.count("GgufGather") == 1
    assert ops.count("GgufMatMul") == 2 * 6 + 1  # qk, v, o, gate, up, down per layer; the tied head
    assert ops.count("MatMulNBits") == 0
    # by default the KV cache holds halves (KilnAttentionF16), its keys in blocks
    assert packed.details["kv_cache"] == "f16" and ops.count("KilnAttentionF16") == 2
    past = next(i for i in graph.input if i.name == "past_key_values.0.key")
    assert past.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    assert TextGenerationModel(out).engine("gguf", EngineOptions(threads=1)).shape.halves
    _assert_logits_near_pytorch(out, gguf_path)

    # a graph of the operators' first layout (the file's rows, recorded as true) is refused, not run
    manifest_file = out / "kiln.json"
    recorded = json.loads(manifest_file.read_text())
    [entry] = [v for v in recorded["variants"] if v["name"] == packed.name]
    entry["details"]["native_ops"] = True
    manifest_file.write_text(json.dumps(recorded))
    with pytest.raises(ArtifactError, match="convert the model again"):
        TextGenerationModel(out).core(packed.name)


@pytest.mark.skipif(__import__("modelkiln.native", fromlist=["library_path"]).library_path() is None,
                    reason="the native library is not built on this machine")
def test_2_and_3_bit_k_quants_as_stored_for_the_native_operators(tmp_path):
    """A Q3_K_M / Q2_K-like file: Q3_K matrices and embedding, Q2_K up and down: the file's own rows,
    at its size (2.6 and 3.4 bits a weight, where MatMulNBits took 6); logits are PyTorch's to
    int8-activation rounding, and the gate passes."""
    import onnx

    gguf_path = write_tiny_gguf(tmp_path / "gguf" / "tiny.gguf", matrices="Q3_K", embedding="Q3_K", hidden=256, ff=256,
                                types={"ffn_up": "Q2_K", "ffn_down": "Q2_K"})
    out = tmp_path / "art"
    manifest = _convert(gguf_path, out)
    [packed] = [v for v in manifest.variants if v.name == "gguf"]
    assert packed.kept, packed.reason
    for kind in ("Q2_K", "Q3_K"):
        assert packed.details["from_gguf"][kind]["stored"] == f"{kind} blocks as in the file, in tiles of 16 rows (GgufMatMul)"
    graph = onnx.load(str(out / "model.gguf.onnx"), load_external_data=False).graph
    ops = [n.op_type for n in graph.node]
    assert ops.count("GgufGather") == 1 and "MatMulNBits" not in ops
    assert ops.count("GgufMatMul") == 2 * 5 + 1  # qkv (one type: one node), o, gate, up (apart: Q3_K, Q2_K), down per layer; the head
    weights = {t.name: t for t in graph.initializer}
    stored = sum(int(np.prod(t.dims)) for t in weights.values() if t.data_type == onnx.TensorProto.UINT8)
    on_file = sum(t.n_bytes for t in _decoder(gguf_path).tensors.values() if t.tensor_type.name in ("Q2_K", "Q3_K"))
    assert stored == on_file  # the tiles take the file's bytes (the tiny model's rows are whole tiles)
    _assert_logits_near_pytorch(out, gguf_path)


def test_blocks_of_32_as_stored_for_the_native_operators(tmp_path):
    """The types with a scale per 32 weights stay the file's own rows too (SmolLM2's file: Q4_1
    matrices, a Q8_0 embedding tied to the head; and Q4_0, Q5_0, Q5_1), widths that are not a
    multiple of 256 included (the MLP's 480); logits are PyTorch's to int8-activation rounding; the gate passes."""
    import onnx

    gguf_path = write_tiny_gguf(tmp_path / "gguf" / "tiny.gguf", matrices="Q4_1", embedding="Q8_0", hidden=256, ff=480,
                                types={"attn_v": "Q5_0", "ffn_down": "Q5_1", "ffn_up": "Q4_0"})
    out = tmp_path / "art"
    manifest = _convert(gguf_path, out, kv_cache="f32")
    [packed] = [v for v in manifest.variants if v.name == "gguf"]
    assert packed.kept, packed.reason
    assert packed.details["kv_cache"] == "f32"  # --kv-cache f32: KilnAttention over floats
    for kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        assert packed.details["from_gguf"][kind]["stored"] == f"{kind} blocks as in the file, in tiles of 16 rows (GgufMatMul)"
    # int8 dot products: VNNI where the CPU has it, AVX2's pair products elsewhere (convert's table names it)
    assert packed.details["matrix_engine"] == matrix_engine("int8", "cpu", cpu_flags())
    graph = onnx.load(str(out / "model.gguf.onnx"), load_external_data=False).graph
    ops = [n.op_type for n in graph.node]
    assert ops.count("GgufGather") == 1 and "MatMulNBits" not in ops
    assert ops.count("GgufMatMul") == 2 * 6 + 1  # qk, v, o, gate, up (apart: Q4_1 and Q4_0), down per layer; the tied head
    assert ops.count("KilnAttention") == 2 and "KilnAttentionF16" not in ops
    _assert_logits_near_pytorch(out, gguf_path)


def test_another_architecture_is_exported_and_packed_by_value(tmp_path):
    """A head size GroupQueryAttention cannot take (24): transformers loads the file, torch
    exports it, and the packed variant finds each MatMul's GGUF tensor by value."""
    gguf_path = write_tiny_gguf(tmp_path / "tiny.gguf", matrices="Q8_0", embedding="F32", hidden=96, ff=96)
    manifest = _convert(gguf_path, tmp_path / "art", precisions=["fp32", "gguf"])
    assert manifest.generation["graph"]["kind"] == "export" and "head size 24" in manifest.generation["graph"]["why"]
    assert "whole transformers model" in manifest.generation["reference"]
    by_name = {v.name: v for v in manifest.variants}
    assert by_name["gguf"].validation.passed, by_name["gguf"].reason
    assert by_name["gguf"].details["from_gguf"]["Q8_0"] == {"count": 14, "stored": "8-bit, block 32"}


def test_fp32_variants_of_a_model_too_large_are_refused_before_any_work(tmp_path):
    gguf_path = write_tiny_gguf(tmp_path / "tiny.gguf", matrices="Q4_1", embedding="Q8_0")
    with pytest.raises(ModelTooLargeError, match="--precision gguf") as err:
        _convert(gguf_path, tmp_path / "art", precisions=["gguf", "int4"], max_model_gb=1e-6)
    assert "int4" in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "art").exists() and not list(tmp_path.glob(".art.tmp-*"))


# --- bad input ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["truncated", "corrupt header"])
def test_a_gguf_that_cannot_be_parsed(tmp_path, damage):
    gguf_path = write_tiny_gguf(tmp_path / "tiny.gguf", matrices="Q4_1", embedding="Q8_0")
    data = bytearray(gguf_path.read_bytes())
    if damage == "truncated":
        data = data[:len(data) * 2 // 3]
    else:
        data[40:4000] = np.random.default_rng(0).integers(0, 256, 3960, dtype=np.uint8).tobytes()
    gguf_path.write_bytes(bytes(data))
    res = kiln("convert", str(gguf_path), "--task", "text-generation", "--out", str(tmp_path / "art"))
    assert_one_line_error(res, "tiny.gguf is not a readable GGUF file")
    assert not (tmp_path / "art").exists() and not list(tmp_path.glob(".art.tmp-*"))


def test_a_tensor_shape_the_config_contradicts(tmp_path):
    gguf_path = write_tiny_gguf(tmp_path / "tiny.gguf", matrices="Q8_0", embedding="Q8_0", shapes={"ffn_up": (128, 64)})
    res = kiln("convert", str(gguf_path), "--task", "text-generation", "--out", str(tmp_path / "art"))
    assert_one_line_error(res, "blk.0.ffn_up.weight", "[128, 64]", "[96, 64]")
    assert not (tmp_path / "art").exists()


def test_a_gguf_too_big_for_this_machine(tmp_path):
    """A valid header and 1 TB of (sparse) file: refused from its size, before anything is read or written."""
    gguf_path = write_tiny_gguf(tmp_path / "tiny.gguf", matrices="Q8_0", embedding="Q8_0")
    os.truncate(gguf_path, 1 << 40)
    res = kiln("convert", str(gguf_path), "--task", "text-generation", "--out", str(tmp_path / "art"))
    assert_one_line_error(res, "1099.5 GB GGUF", "2200.5 GB of memory", "this machine has")
    assert not (tmp_path / "art").exists()


def test_an_unknown_kv_cache_type_is_refused_before_any_work(tmp_path):
    result = kiln("convert", str(tmp_path / "missing.gguf"), "--out", str(tmp_path / "art"), "--kv-cache", "f8")
    assert_one_line_error(result, "unknown KV cache type 'f8' (choose from f16, f32)")
    assert not (tmp_path / "art").exists()


def test_an_unknown_architecture(tmp_path):
    gguf_path = write_tiny_gguf(tmp_path / "tiny.gguf", architecture="nosuchllm")
    with pytest.raises(UnsupportedArchitectureError, match="nosuchllm"):
        _convert(gguf_path, tmp_path / "art")
    assert not (tmp_path / "art").exists()


def test_non_finite_scales(tmp_path):
    import gguf

    gguf_path = write_tiny_gguf(tmp_path / "tiny.gguf", matrices="Q8_0", embedding="Q8_0")
    reader = gguf.GGUFReader(str(gguf_path), "r+")
    tensor = next(t for t in reader.tensors if t.name == "blk.1.attn_v.weight")
    tensor.data[0, 0:2] = np.array([np.inf], np.float16).view(np.uint8)  # a block's scale
    tensor.data.flush()
    del reader
    with pytest.raises(ModelLoadError, match="blk.1.attn_v.weight .* non-finite"):
        _convert(gguf_path, tmp_path / "art")
    assert not (tmp_path / "art").exists() and not list(tmp_path.glob(".art.tmp-*"))


def test_a_killed_convert_leaves_nothing_that_looks_like_an_artifact(tmp_path):
    """SIGKILL mid-conversion: no --out; the hidden temporary folder holds no variant (nothing can
    serve it), and the next conversion to the same --out removes it."""
    gguf_path = write_tiny_gguf(tmp_path / "tiny.gguf", matrices="Q4_1", embedding="Q8_0")
    out = tmp_path / "art"
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    proc = subprocess.Popen([sys.executable, "-m", "modelkiln", "convert", str(gguf_path), "--task", "text-generation",
                             "--out", str(out), "--gate-prompts", "2,1"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if any((d / "model.gguf.onnx").exists() for d in tmp_path.glob(".art.tmp-*")):
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the conversion ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not out.exists()
    [left] = list(tmp_path.glob(".art.tmp-*"))
    manifest = json.loads((left / "kiln.json").read_text()) if (left / "kiln.json").exists() else {"variants": []}
    assert manifest["variants"] == []
    _convert(gguf_path, out)
    assert (out / "kiln.json").exists() and not list(tmp_path.glob(".art.tmp-*"))
