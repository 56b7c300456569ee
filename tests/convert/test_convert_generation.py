"""`kiln convert --task text-generation`: tiny random causal LMs of four families and a tiny GGUF,
each exported with its KV cache, through the gate on real text, and generating PyTorch's greedy
tokens through the engine; a forced gate failure; the error cases."""

from __future__ import annotations

import json

import numpy as np
import pytest

from generation_helpers import make_tiny_causal_lm, write_tiny_gguf
from modelkiln.convert.generation.gate import GateTolerance
from modelkiln.convert.generation.reference import WholeModelReference
from modelkiln.convert.generation.logit_store import LogitStore
from modelkiln.convert.pipeline import ConvertConfig, convert
from modelkiln.errors import ModelLoadError, ModelTooLargeError, UnsupportedArchitectureError, ValidationFailedError
from modelkiln.generation.engines.registry import EngineOptions
from modelkiln.generation.model import TextGenerationModel
from modelkiln.generation.engines.onnx.padded import PaddedEngine
from modelkiln.generation.engines.onnx.serving import ServingEngine

PROMPT = "The quick brown fox jumps over the lazy dog"


def _convert(model, out, **options):
    options = {"gate_short": 2, "gate_squad": 1, "threads": 1, "timing_seconds": 0.3, **options}
    return convert(ConvertConfig(model=str(model), out=out, **options))


def _engine_greedy(artifact, variant: str, ids: list[int], n: int, path=None) -> list[int]:
    path = path or artifact.variant_path(variant)[1]
    engine = artifact.engine_for_file(path, EngineOptions(threads=1))
    logits, tokens = engine.add(0, ids), []
    for _ in range(n):
        tokens.append(int(np.argmax(logits)))
        logits = engine.step({0: tokens[-1]})[0]
    return tokens


def _torch_greedy(model_folder, ids: list[int], n: int, **load) -> list[int]:
    import torch
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(str(model_folder), dtype=torch.float32, **load).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("family, graph", [("gpt2", "export"), ("qwen2", "serving"), ("gpt_neox", "export")])
def test_families_convert_and_generate_pytorchs_greedy_tokens(tmp_path, family, graph):
    """Qwen2 (q/k/v biases) gets the serving graph; GPT-2 and GPT-NeoX the torch export, and the
    manifest says why."""
    folder = make_tiny_causal_lm(tmp_path / "hf", family)
    manifest = _convert(folder, tmp_path / "art", precisions=["fp32"])  # --task auto: *ForCausalLM / *LMHeadModel
    assert manifest.task == "text-generation"
    assert manifest.generation["graph"]["kind"] == graph
    if graph == "export":
        assert family in manifest.generation["graph"]["why"] and manifest.opset == 23
    engine = TextGenerationModel(tmp_path / "art").engine("fp32", EngineOptions(threads=1))
    assert isinstance(engine, ServingEngine if graph == "serving" else PaddedEngine)
    fp32 = manifest.variants[0]
    assert fp32.kept and fp32.validation.agreement == 1.0 and fp32.validation.max_abs_diff < 1e-3
    assert abs(fp32.details["perplexity_change"]) < 1e-3
    artifact = TextGenerationModel(tmp_path / "art")
    ids = artifact.prompt_ids(PROMPT)
    assert _engine_greedy(artifact, "fp32", ids, 12) == _torch_greedy(folder, ids, 12)


def test_llama_gqa_every_variant_and_a_forced_gate_failure(tmp_path):
    folder = make_tiny_causal_lm(tmp_path / "hf", "llama")
    out = tmp_path / "art"
    # int8 must keep perplexity *below* PyTorch's by 100%: impossible, so the gate rejects it.
    manifest = _convert(folder, out, task="text-generation", precisions=["fp32", "int8", "int4", "fp16"],
                        int4_block_size=16, generation_gate={"int8": GateTolerance(-1.0, False)})
    by_name = {v.name: v for v in manifest.variants}
    assert set(by_name) == {"fp32", "int8", "int4", "fp16"}
    assert by_name["fp32"].kept and by_name["fp32"].validation.agreement == 1.0
    int8 = by_name["int8"]
    assert not int8.kept and int8.file is None and "perplexity" in int8.reason and not int8.validation.passed
    assert not (out / "model.int8.onnx").exists()
    int4 = by_name["int4"]
    assert int4.validation.passed and int4.details["block_size"] == 16 and int4.latency_ms is not None
    assert int4.kept == (int4.latency_ms < by_name["fp32"].latency_ms)  # kept only if faster
    for variant in (by_name["fp32"], int4):  # kept (or refused for speed only): batch-invariant
        assert variant.validation.batch_agreement == 1.0, variant.details["batch_invariance"]
    assert not by_name["fp16"].kept and "CUDA" in by_name["fp16"].reason
    saved = json.loads((out / "kiln.json").read_text())
    gen = saved["generation"]
    assert gen["layers"] == 2 and gen["kv_heads"] == 2 and gen["heads"] == 4 and gen["head_dim"] == 16
    assert gen["max_context"] == 1024 and gen["chat_template"] and gen["eos_token_ids"]
    assert gen["special_tokens"]["eos_token"] == "<|im_end|>"
    artifact = TextGenerationModel(out)
    assert artifact.tokenizer.token_to_id("<|im_end|>") in artifact.eos_ids
    ids = artifact.prompt_ids("Where is the dog?", chat=True)
    assert _engine_greedy(artifact, "fp32", ids, 10) == _torch_greedy(folder, ids, 10)


@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox"])  # rotary (GQA), absolute, parallel
def test_batched_reference_equals_one_sequence_at_a_time(tmp_path, family):
    """The gate's whole-model reference runs sequences of different lengths together, left-padded:
    each sequence's logits and the paragraphs' perplexity must be what it gets alone."""
    import torch
    import transformers as tf

    folder = make_tiny_causal_lm(tmp_path / "hf", family)
    model = tf.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    rng = np.random.default_rng(0)
    sequences = [tuple(rng.integers(3, 400, n).tolist()) for n in (5, 17, 2, 40, 9)]
    paragraphs = [rng.integers(3, 400, n).tolist() for n in (30, 12, 21)]
    with LogitStore(400) as alone, LogitStore(400) as together:
        ppl_alone = WholeModelReference(model, batch=1).run(sequences, paragraphs, alone)
        ppl_together = WholeModelReference(model, batch=4).run(sequences, paragraphs, together)
        for s in sequences:
            a, b = alone.get(s), together.get(s)
            assert a.shape == (len(s), 400) and np.isfinite(b).all() and np.abs(a - b).max() < 1e-4
    assert ppl_together == pytest.approx(ppl_alone, rel=1e-6)


def test_tiny_gguf_converts_with_its_tokenizer_and_chat_template(tmp_path):
    gguf_path = write_tiny_gguf(tmp_path / "gguf" / "tiny.gguf")
    manifest = _convert(gguf_path.parent, tmp_path / "art", precisions=["fp32"])  # a folder holding one GGUF
    assert manifest.task == "text-generation" and manifest.source["gguf_file"] == "tiny.gguf"
    assert manifest.variants[0].kept and manifest.variants[0].validation.agreement == 1.0
    artifact = TextGenerationModel(tmp_path / "art")
    assert artifact.chat_template and "<|im_start|>" in artifact.chat_prompt("hi")
    ids = artifact.prompt_ids(PROMPT)
    expected = _torch_greedy(gguf_path.parent, ids, 8, gguf_file=gguf_path.name)
    assert _engine_greedy(artifact, "fp32", ids, 8) == expected


def test_a_file_that_is_not_gguf(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        _convert(fake, tmp_path / "art")
    assert not (tmp_path / "art").exists()


def test_unknown_architecture(tmp_path):
    folder = make_tiny_causal_lm(tmp_path / "hf", "llama")
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="no-such-llm", architectures=["NoSuchLLMForCausalLM"])
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match="no-such-llm"):
        _convert(folder, tmp_path / "art", task="text-generation")


def test_a_model_too_large_for_the_options(tmp_path):
    folder = make_tiny_causal_lm(tmp_path / "hf", "llama")
    with pytest.raises(ModelTooLargeError, match="--max-model-gb"):
        _convert(folder, tmp_path / "art", max_model_gb=1e-6)
    assert not (tmp_path / "art").exists()


@pytest.mark.slow
def test_no_variant_passing_fails_and_writes_nothing(tmp_path):
    folder = make_tiny_causal_lm(tmp_path / "hf", "qwen2")
    with pytest.raises(ValidationFailedError, match="no variant passed"):
        _convert(folder, tmp_path / "art", precisions=["fp32"], generation_gate={"fp32": GateTolerance(-1.0, True)})
    assert not (tmp_path / "art").exists()


@pytest.mark.parametrize("accuracy_level", [0, pytest.param(4, marks=pytest.mark.slow)])
def test_q4_1_gguf_packs_the_files_own_blocks(tmp_path, accuracy_level):
    """A GGUF source's default variant is ``gguf``: its own blocks; without the native operators
    (``--no-native-gguf``, or where they are not built) in MatMulNBits (Q4_1 with the
    block-minimum correction, the tied Q8_0 embedding gathered and its head 8-bit), the same
    weights as PyTorch's, so the same logits (to float rounding at accuracy level 0; level 4
    quantizes activations to int8 inside the kernel) and the same greedy tokens."""
    import onnx
    import torch
    import transformers as tf

    gguf_path = write_tiny_gguf(tmp_path / "gguf" / "tiny.gguf", matrices="Q4_1", embedding="Q8_0")
    out = tmp_path / "art"
    manifest = _convert(gguf_path, out, int4_accuracy_level=accuracy_level, native_gguf=False)
    assert [v.name for v in manifest.variants] == ["gguf"]
    packed = manifest.variants[0]
    assert packed.kept and packed.validation.passed and packed.details["accuracy_level"] == accuracy_level
    # 2 layers × 7 matrices and the embedding, which the head shares
    assert packed.details["from_gguf"] == {"Q4_1": {"count": 14, "stored": "4-bit, block 32, min correction"},
                                           "Q8_0": {"count": 1, "stored": "8-bit, block 32"}}
    assert manifest.generation["default_variant"] == "gguf"
    assert "layer by layer" in manifest.generation["reference"]
    graph = onnx.load(str(out / "model.gguf.onnx"), load_external_data=False).graph
    # 2 layers × (q/k/v, o, gate/up, down: four projections, fused) and the head
    assert sum(n.op_type == "MatMulNBits" for n in graph.node) == 9
    assert not any(i.name == "embed.weight" for i in graph.initializer)  # the embedding stays quantized
    artifact = TextGenerationModel(out)
    ids = artifact.prompt_ids(PROMPT)
    model = tf.AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                    dtype=torch.float32).eval()
    with torch.no_grad():
        expected_logits = model(torch.tensor([ids])).logits[0].numpy()
    logits = artifact.engine("gguf", EngineOptions(threads=1)).prefill("p", ids, all_logits=True)
    scale = float(np.abs(expected_logits).max())
    diff = float(np.abs(logits - expected_logits).max())
    assert diff < (1e-5 if accuracy_level == 0 else 0.02) * scale, (diff, scale)
    assert (logits.argmax(-1) == expected_logits.argmax(-1)).all()
    assert _engine_greedy(artifact, "gguf", ids, 8) == _torch_greedy(gguf_path.parent, ids, 8, gguf_file=gguf_path.name)


def _leak_the_batch_into_logits(src, dst, *_options) -> None:
    """A deliberately batch-variant decoder: every row's logits become the batch's element-wise
    maximum, the way a batch-wide activation scale leaks neighbours into a row (only far more
    visibly). Alone, a row is its own maximum: its logits, and so the lone gate run, are exact."""
    import onnx
    from onnx import helper

    model = onnx.load(str(src))
    raw = "logits/own_row"
    for node in model.graph.node:
        node.output[:] = [raw if o == "logits" else o for o in node.output]
    axis = onnx.numpy_helper.from_array(np.array([0], dtype=np.int64), "batch_axis")
    model.graph.initializer.append(axis)
    model.graph.node.extend([
        helper.make_node("ReduceMax", [raw, "batch_axis"], ["logits/batch_max"], keepdims=1),
        helper.make_node("Shape", [raw], ["logits/shape"]),
        helper.make_node("Expand", ["logits/batch_max", "logits/shape"], ["logits"]),
    ])
    onnx.save(model, str(dst))


def test_the_gate_refuses_a_batch_variant_decoder(tmp_path, monkeypatch):
    from modelkiln.convert import variants

    monkeypatch.setattr(variants, "quantize_int8_weights", _leak_the_batch_into_logits)
    folder = make_tiny_causal_lm(tmp_path / "hf", "llama")
    out = tmp_path / "art"
    manifest = _convert(folder, out, task="text-generation", precisions=["fp32", "int8"])
    fp32, int8 = manifest.variants
    assert fp32.kept and fp32.validation.batch_agreement == 1.0, fp32.details["batch_invariance"]
    # Alone the planted graph equals fp32: the accuracy checks pass, the batch check alone refuses it.
    assert int8.details["greedy_tokens_equal"] == fp32.details["greedy_tokens_equal"]
    assert not int8.kept and int8.file is None and not int8.validation.passed
    assert "batch-variant" in int8.reason and "perplexity" not in int8.reason, int8.reason
    assert int8.validation.batch_agreement < 1.0 and int8.details["batch_invariance"]["prompts_differing"]
    assert not (out / "model.int8.onnx").exists()
    saved = json.loads((out / "kiln.json").read_text())
    assert saved["variants"][1]["validation"]["batch_agreement"] == int8.validation.batch_agreement
