"""Tiny text-generation artifacts for the engine and CLI tests, and tiny causal LMs / GGUF files for
the converter's tests. The decoder export is the product's (modelkiln.convert.generation.decoder_export);
``write_generation_artifact`` writes the manifest without the gate, so the CLI tests get an int8
variant even where the converter would drop it as not faster on a tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from modelkiln.convert.gguf.blocks import FP16_FIELDS
from modelkiln.samples import SAMPLE_TEXTS

CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                 "'<|im_end|>\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tiny_tokenizer(folder: Path):
    from tokenizers import ByteLevelBPETokenizer, Tokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(list(SAMPLE_TEXTS), vocab_size=400, min_frequency=1, special_tokens=SPECIALS)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tokenizer.json"
    tok.save(str(path))
    return Tokenizer.from_file(str(path))


def make_tiny_llama(folder: Path, hidden_size: int = 64, layers: int = 2) -> Path:
    """A saved Hugging Face folder: random Llama with grouped-query attention, byte-level BPE tokenizer
    (``hidden_size`` and ``layers`` larger for a model whose tokens take a few milliseconds)."""
    import torch
    import transformers as tf

    folder.mkdir(parents=True, exist_ok=True)
    tiny_tokenizer(folder)
    fast = tf.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), eos_token="<|im_end|>",
                                      bos_token="<|im_start|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=400, hidden_size=hidden_size, intermediate_size=hidden_size * 3 // 2,
                         num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         eos_token_id=fast.eos_token_id, bos_token_id=fast.bos_token_id, pad_token_id=fast.pad_token_id)
    model = tf.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # clear argmax decisions, as a trained model makes
    model.save_pretrained(folder)
    return folder


def export_decoder(model_folder: Path, path: Path) -> Path:
    """The product's exporter (modelkiln.convert.generation.decoder_export) on a saved folder, without the gate."""
    import transformers as tf

    from modelkiln.convert.generation.decoder_export import export_decoder as export

    path.parent.mkdir(parents=True, exist_ok=True)
    export(tf.AutoModelForCausalLM.from_pretrained(model_folder).eval(), path)
    return path


def export_tiny_llama(folder: Path) -> Path:
    return export_decoder(make_tiny_llama(folder / "hf"), folder / "model.onnx")


def write_generation_artifact(out: Path, model_folder: Path, precisions: tuple[str, ...] = ("fp32",)) -> Path:
    """An artifact folder as `kiln convert --task text-generation` writes one (no validation gate)."""
    from modelkiln.convert.variants import in_scratch_directory, quantize_int8
    from modelkiln.manifest import Manifest, TokenizerSpec, Variant

    out.mkdir(parents=True, exist_ok=True)
    fp32 = export_decoder(model_folder, out / "model.onnx")
    variants = [Variant("fp32", "fp32", "cpu", fp32.name, True)]
    if "int8" in precisions:
        in_scratch_directory(quantize_int8)(fp32, out / "model-int8.onnx", True)
        variants.append(Variant("int8", "int8", "cpu", "model-int8.onnx", True, reason="dynamic, per-channel"))
    (out / "tokenizer.json").write_bytes((model_folder / "tokenizer.json").read_bytes())
    config = json.loads((model_folder / "config.json").read_text())
    generation = {"eos_token_ids": [config["eos_token_id"]], "chat_template": CHAT_TEMPLATE,
                  "special_tokens": {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"},
                  "max_context": config["max_position_embeddings"], "defaults": {"max_new_tokens": 32},
                  "layers": config["num_hidden_layers"], "kv_heads": config["num_key_value_heads"],
                  "head_dim": config["hidden_size"] // config["num_attention_heads"]}
    n = config["num_hidden_layers"]
    Manifest(name=out.name, task="text-generation",
             input_names=["input_ids", "attention_mask", "position_ids"] + [f"past_key_values.{i}.{k}" for i in range(n) for k in ("key", "value")],
             output_names=["logits"] + [f"present.{i}.{k}" for i in range(n) for k in ("key", "value")],
             max_length=config["max_position_embeddings"], tokenizer=TokenizerSpec(pad_token="<|endoftext|>", pad_token_id=0),
             variants=variants, generation=generation, source={"model": str(model_folder)}).save(out)
    return out


# --- tiny causal LMs of several families, and a tiny GGUF, for `kiln convert --task text-generation` ---

def _save_tokenizer(folder: Path):
    import transformers as tf

    tiny_tokenizer(folder)
    fast = tf.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), eos_token="<|im_end|>",
                                      bos_token="<|im_start|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return fast


def make_tiny_causal_lm(folder: Path, family: str) -> Path:
    """A saved random ``family`` model (llama with GQA, gpt2, qwen2, gpt_neox) with the tiny tokenizer."""
    import torch
    import transformers as tf

    folder.mkdir(parents=True, exist_ok=True)
    fast = _save_tokenizer(folder)
    ids = dict(vocab_size=400, eos_token_id=fast.eos_token_id, bos_token_id=fast.bos_token_id,
               pad_token_id=fast.pad_token_id)
    # head size 16: the smallest GroupQueryAttention takes on CPU (the serving graph)
    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=1024, **ids)
    if family == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(num_key_value_heads=2, **common))
    elif family == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(num_key_value_heads=2, **common))
    elif family == "gpt_neox":
        model = tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**common))
    elif family == "gpt2":
        model = tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=1024, **ids))
    else:
        raise ValueError(family)
    torch.manual_seed(0)
    model.init_weights()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)  # clear argmax decisions, as a trained model makes
    model.eval().save_pretrained(folder)
    return folder


def random_gguf_blocks(kind: str, rows: int, cols: int, rng, scale: float = 0.1):
    """[rows, bytes] of valid ``kind`` blocks: every code random, the fp16 scales finite and set so
    that the weights' standard deviation is about ``scale`` (gguf-py cannot quantize K-quants)."""
    import gguf
    import numpy as np

    qtype = gguf.GGMLQuantizationType[kind]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)

    def set_scales(value: float) -> None:
        for at in FP16_FIELDS[kind]:
            raw[..., at:at + 2] = np.float16(value).reshape(1).view(np.uint8)

    set_scales(1.0)
    std = float(gguf.quants.dequantize(raw.reshape(rows, -1), qtype).std())
    set_scales(scale / std)
    return raw.reshape(rows, -1)


def write_tiny_gguf(path: Path, matrices: str = "F32", embedding: str = "F32", architecture: str = "llama",
                    hidden: int = 64, ff: int = 96, types: dict[str, str] | None = None,
                    shapes: dict[str, tuple[int, int]] | None = None, tied: bool | None = None) -> Path:
    """A tiny random decoder (GQA; ``architecture`` llama or qwen2, with q/k/v biases) as a GGUF
    file, byte-level BPE tokenizer and chat template in its metadata, written with the ``gguf``
    package the way llama.cpp's converter writes one. ``matrices`` / ``embedding``: the GGUF type
    of the layers' weight matrices / of the token embedding, tied to the LM head unless ``tied``
    says otherwise (by default a quantized embedding is tied, as in SmolLM2's Q4_1 file, whose
    embedding is Q8_0); ``types``: other types for some matrices by name (``attn_v``, ``ffn_down``,
    ``output``...); ``shapes``: other shapes [rows, columns] for some, a file that contradicts its config."""
    import gguf
    import numpy as np

    folder = path.parent / (path.stem + "-tokenizer")
    tok = tiny_tokenizer(folder)
    spec = json.loads((folder / "tokenizer.json").read_text())
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    layers, heads, kv_heads, n_vocab = 2, 4, 2, len(vocab)
    types, shapes = dict(types or {}), dict(shapes or {})
    tied = embedding != "F32" if tied is None else tied
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), architecture)
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(n_vocab)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t, _ in vocab])
    w.add_token_merges(merges)
    w.add_bos_token_id(tok.token_to_id("<|im_start|>"))
    w.add_eos_token_id(tok.token_to_id("<|im_end|>"))
    w.add_pad_token_id(tok.token_to_id("<|endoftext|>"))
    w.add_chat_template(CHAT_TEMPLATE)
    rng = np.random.default_rng(0)

    def tensor(name: str, rows: int, cols: int, kind: str, scale: float = 0.1) -> None:
        role = name.split(".")[-2]
        rows, cols = shapes.get(role, (rows, cols))
        kind = types.get(role, kind)
        if kind == "F32":
            w.add_tensor(name, (rng.standard_normal((rows, cols)) * scale).astype(np.float32))
            return
        qtype = gguf.GGMLQuantizationType[kind]
        if kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):  # gguf-py quantizes these itself
            raw = gguf.quantize((rng.standard_normal((rows, cols)) * scale).astype(np.float32), qtype)
        else:
            raw = random_gguf_blocks(kind, rows, cols, rng, scale)
        w.add_tensor(name, raw, raw_dtype=qtype)

    tensor("token_embd.weight", n_vocab, hidden, embedding, scale=1.0)
    head_dim = hidden // heads
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, dtype=np.float32))
        tensor(f"blk.{i}.attn_q.weight", hidden, hidden, matrices)
        tensor(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden, matrices)
        tensor(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden, matrices)
        if architecture == "qwen2":
            for role, rows in (("attn_q", hidden), ("attn_k", kv_heads * head_dim), ("attn_v", kv_heads * head_dim)):
                w.add_tensor(f"blk.{i}.{role}.bias", (rng.standard_normal(rows) * 0.1).astype(np.float32))
        tensor(f"blk.{i}.attn_output.weight", hidden, hidden, matrices)
        tensor(f"blk.{i}.ffn_gate.weight", ff, hidden, matrices)
        tensor(f"blk.{i}.ffn_up.weight", ff, hidden, matrices)
        tensor(f"blk.{i}.ffn_down.weight", hidden, ff, matrices)
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    if not tied:
        tensor("output.weight", n_vocab, hidden, "F32", scale=1.0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="session")
def tiny_generation_artifact(tmp_path_factory) -> Path:
    """The tiny Llama converted by `kiln convert --task text-generation` (fp32; int8 is built and
    kept only if faster), shared by the engine and CLI tests."""
    from modelkiln.convert.pipeline import ConvertConfig, convert

    root = tmp_path_factory.mktemp("tiny-generation")
    out = root / "tiny-llama"
    convert(ConvertConfig(model=str(make_tiny_llama(root / "hf")), out=out, task="text-generation",
                          precisions=["fp32", "int8"], threads=1, timing_seconds=0.02))
    return out


def _kiln_attention_graph(artifact: Path, folder: Path, kv_halves: bool) -> Path:
    import transformers

    from modelkiln.convert.generation.serving_graph import TorchDecoderWeights, build_serving_graph

    model = transformers.AutoModelForCausalLM.from_pretrained(str(artifact.parent / "hf"))
    build_serving_graph(TorchDecoderWeights(model), folder / "model.onnx", kiln_attention=True, kv_halves=kv_halves)
    return folder / "model.onnx"


@pytest.fixture(scope="session")
def tiny_kiln_attention_graph(tiny_generation_artifact, tmp_path_factory) -> Path:
    """The tiny Llama's serving graph built with KilnAttention (fp32 weights, fp32 KV cache): run it
    with ``TextGenerationModel(tiny_generation_artifact).engine_for_file``."""
    return _kiln_attention_graph(tiny_generation_artifact, tmp_path_factory.mktemp("kiln-attention"), False)


@pytest.fixture(scope="session")
def tiny_kiln_attention_graph_f16(tiny_generation_artifact, tmp_path_factory) -> Path:
    """The same with a KV cache of halves (KilnAttentionF16), as GGUF artifacts keep it by default."""
    return _kiln_attention_graph(tiny_generation_artifact, tmp_path_factory.mktemp("kiln-attention-f16"), True)


def with_graph(artifact: Path, graph: Path, out: Path) -> Path:
    """A copy of a text-generation artifact whose fp32 variant's graph (model.onnx) is ``graph`` (one
    built with KilnAttention), made its default variant: the variant a draft model runs."""
    import shutil

    shutil.copytree(artifact, out)
    for name in ("model.onnx", "model.onnx.data"):
        shutil.copy(graph.parent / name, out / name)
    manifest = json.loads((out / "kiln.json").read_text())
    manifest["generation"]["default_variant"] = "fp32"
    (out / "kiln.json").write_text(json.dumps(manifest, indent=1))
    return out


@pytest.fixture(scope="session")
def tiny_torch_artifact(tmp_path_factory) -> Path:
    """The tiny Llama converted by `kiln convert --task text-generation --engine torch` (torch-fp32,
    on the CPU), shared by the torch engine's tests and the CLI tests."""
    from modelkiln.convert.pipeline import ConvertConfig, convert

    root = tmp_path_factory.mktemp("tiny-torch")
    out = root / "tiny-llama-torch"
    convert(ConvertConfig(model=str(make_tiny_llama(root / "hf")), out=out, task="text-generation", engine="torch",
                          precisions=["fp32"], threads=1, timing_seconds=0.02))
    return out


def make_tiny_mistral(folder: Path, sliding_window: int = 12) -> Path:
    """A saved random Mistral with a short sliding window (attention sees the last ``sliding_window``
    positions), so that prompts and answers of a few dozen tokens cross it."""
    import torch
    import transformers as tf

    folder.mkdir(parents=True, exist_ok=True)
    fast = _save_tokenizer(folder)
    torch.manual_seed(0)
    model = tf.MistralForCausalLM(tf.MistralConfig(
        vocab_size=400, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, sliding_window=sliding_window,
        eos_token_id=fast.eos_token_id, bos_token_id=fast.bos_token_id, pad_token_id=fast.pad_token_id))
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.eval().save_pretrained(folder)
    return folder


# --- grammars: walking a grammar's masks --------------------------------------------------------------------

PADDED_WORDS = 16  # 512 bits: the model's vocabulary padded past the tokenizer's 400


def allowed(words: np.ndarray) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little"))


def random_walk(grammar, tokenizer, eos: int, rng: np.random.Generator, max_steps: int = 600) -> str:
    """Pick uniformly among the allowed tokens until end-of-sequence; the text written."""
    matcher, words, ids = grammar.matcher(), np.zeros(PADDED_WORDS, dtype=np.int32), []
    for _ in range(max_steps):
        matcher.fill_bitmask(words)
        tokens = allowed(words)
        assert tokens.size and tokens.max() < tokenizer.get_vocab_size(), "padded rows must never be allowed"
        token = int(rng.choice(tokens))
        if token == eos:
            return tokenizer.decode(ids, skip_special_tokens=False)
        assert token not in (0, 1), "special tokens other than end-of-sequence are never allowed"
        assert matcher.accept(token), matcher.error
        ids.append(token)
        if matcher.is_terminated():
            matcher.fill_bitmask(words)
            assert list(allowed(words)) == [eos]
    raise AssertionError(f"no end within {max_steps} steps: {tokenizer.decode(ids)!r}")
