"""TEMPORARY tiny text-generation artifacts for the engine and CLI tests, until the converter's
`kiln convert --task text-generation` (branch genconvert) is merged; then the fixtures call it and
this export goes away (one exporter in the final code)."""

from __future__ import annotations

import json
from pathlib import Path

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


def make_tiny_llama(folder: Path) -> Path:
    """A saved Hugging Face folder: random Llama with grouped-query attention, byte-level BPE tokenizer."""
    import torch
    import transformers as tf

    folder.mkdir(parents=True, exist_ok=True)
    tiny_tokenizer(folder)
    fast = tf.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), eos_token="<|im_end|>",
                                      bos_token="<|im_start|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         eos_token_id=fast.eos_token_id, bos_token_id=fast.bos_token_id, pad_token_id=fast.pad_token_id)
    model = tf.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # clear argmax decisions, as a trained model makes
    model.save_pretrained(folder)
    return folder


def export_decoder(model_folder: Path, path: Path) -> Path:
    import torch
    import transformers as tf
    from torch.export import Dim
    from transformers import DynamicCache

    model = tf.AutoModelForCausalLM.from_pretrained(model_folder).eval()
    cfg = model.config
    n, kv, hd = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads

    class Wrapper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, position_ids, *past):
            cache = DynamicCache(config=cfg)
            for i in range(n):
                cache.update(past[2 * i], past[2 * i + 1], i)
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=cache, use_cache=True)
            return (out.logits, *[t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)])

    b, s, p = 2, 3, 4
    args = (torch.randint(0, cfg.vocab_size, (b, s)), torch.ones(b, p + s, dtype=torch.long),
            torch.arange(p, p + s).expand(b, s), *[torch.randn(b, kv, p, hd) for _ in range(2 * n)])
    db, ds, dp, dt = Dim("batch", max=1024), Dim("seq", max=4096), Dim("past", max=4096), Dim("total", max=8192)
    shapes = {"input_ids": {0: db, 1: ds}, "attention_mask": {0: db, 1: dt}, "position_ids": {0: db, 1: ds},
              "past": tuple({0: db, 2: dp} for _ in range(2 * n))}
    names = ["input_ids", "attention_mask", "position_ids"] + [f"past_key_values.{i}.{k}" for i in range(n) for k in ("key", "value")]
    outs = ["logits"] + [f"present.{i}.{k}" for i in range(n) for k in ("key", "value")]
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.onnx.export(Wrapper().eval(), args, str(path), input_names=names, output_names=outs, dynamic_shapes=shapes,
                      dynamo=True, optimize=True, verbose=False)
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
