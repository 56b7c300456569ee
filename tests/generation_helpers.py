"""A tiny causal LM for the generation tests: a random Llama with grouped-query attention, a
byte-level BPE tokenizer trained here and a chat template, converted once per session by the real
`kiln convert --task text-generation`."""

from __future__ import annotations

from pathlib import Path

import pytest

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
