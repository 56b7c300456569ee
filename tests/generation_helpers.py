"""TEMPORARY tiny causal LM for the engine tests, until genconvert's exporter is merged
(then these tests use a converted tiny artifact instead)."""

from __future__ import annotations

from pathlib import Path

from modelkiln.samples import SAMPLE_TEXTS


def tiny_tokenizer(folder: Path):
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(list(SAMPLE_TEXTS), vocab_size=400, min_frequency=1, special_tokens=["<|endoftext|>"])
    path = folder / "tokenizer.json"
    tok.save(str(path))
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def export_tiny_llama(folder: Path) -> Path:
    import torch
    import transformers as tf
    from transformers import DynamicCache

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = tf.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # clear argmax decisions, as a trained model makes

    class Wrapper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, position_ids, *past):
            cache = DynamicCache(config=cfg)
            for i in range(cfg.num_hidden_layers):
                cache.update(past[2 * i], past[2 * i + 1], i)
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=cache, use_cache=True)
            return (out.logits, *[t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)])

    from torch.export import Dim

    n, b, s, p = cfg.num_hidden_layers, 2, 3, 4
    args = (torch.randint(0, 400, (b, s)), torch.ones(b, p + s, dtype=torch.long),
            torch.arange(p, p + s).expand(b, s), *[torch.randn(b, 2, p, 8) for _ in range(2 * n)])
    db, ds, dp, dt = Dim("batch", max=1024), Dim("seq", max=4096), Dim("past", max=4096), Dim("total", max=8192)
    shapes = {"input_ids": {0: db, 1: ds}, "attention_mask": {0: db, 1: dt}, "position_ids": {0: db, 1: ds},
              "past": tuple({0: db, 2: dp} for _ in range(2 * n))}
    names = ["input_ids", "attention_mask", "position_ids"] + [f"past_key_values.{i}.{k}" for i in range(n) for k in ("key", "value")]
    outs = ["logits"] + [f"present.{i}.{k}" for i in range(n) for k in ("key", "value")]
    path = folder / "model.onnx"
    torch.onnx.export(Wrapper().eval(), args, str(path), input_names=names, output_names=outs, dynamic_shapes=shapes,
                      dynamo=True, optimize=True, verbose=False)
    return path
