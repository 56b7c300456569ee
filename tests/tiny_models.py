"""Tiny random Hugging Face models with tokenizers trained here, for every architecture × task.

Nothing is downloaded: the tokenizers are trained on the project's sample texts and the weights
are random (seeded). Each folder looks exactly like a model saved by ``save_pretrained``."""

from __future__ import annotations

import json
from pathlib import Path

from modelkiln.samples import SAMPLE_QA, SAMPLE_TEXTS

ARCHITECTURES = ("bert", "roberta", "distilbert", "mpnet")
TASKS = ("text-classification", "sentence-embeddings", "token-classification", "question-answering")

CLASS_LABELS = ["negative", "positive"]
NER_LABELS = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]

_CORPUS = list(SAMPLE_TEXTS) + [q for q, _ in SAMPLE_QA]
_SPECIAL_WORDPIECE = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
_SPECIAL_BPE = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]


def _wordpiece_vocab(folder: Path, special_tokens: list[str]) -> dict[str, int]:
    from tokenizers import BertWordPieceTokenizer

    tok = BertWordPieceTokenizer(lowercase=True)
    tok.train_from_iterator(_CORPUS, vocab_size=400, min_frequency=1, special_tokens=special_tokens)
    return tok.get_vocab()


def _bpe_files(folder: Path) -> tuple[Path, Path]:
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(_CORPUS, vocab_size=400, min_frequency=1, special_tokens=_SPECIAL_BPE)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save_model(str(folder))
    return folder / "vocab.json", folder / "merges.txt"


def make_tokenizer(arch: str, folder: Path):
    import transformers as tf

    # transformers >= 5 takes the vocabulary itself (``vocab``/``merges``), not file names.
    if arch == "roberta":
        vocab, merges = _bpe_files(folder)
        return tf.RobertaTokenizerFast(vocab=str(vocab), merges=str(merges), model_max_length=128)
    if arch == "mpnet":  # MPNet mixes RoBERTa-style specials with a WordPiece [UNK]
        return tf.MPNetTokenizerFast(vocab=_wordpiece_vocab(folder, [*_SPECIAL_BPE, "[UNK]"]), model_max_length=128)
    cls = {"bert": tf.BertTokenizerFast, "distilbert": tf.DistilBertTokenizerFast}[arch]
    return cls(vocab=_wordpiece_vocab(folder, _SPECIAL_WORDPIECE), model_max_length=128)


def make_config(arch: str, vocab_size: int, tokenizer, **extra):
    import transformers as tf

    common = dict(vocab_size=vocab_size, max_position_embeddings=130 if arch in ("roberta", "mpnet") else 128, **extra)
    if arch == "distilbert":
        return tf.DistilBertConfig(dim=32, n_layers=2, n_heads=4, hidden_dim=64, pad_token_id=tokenizer.pad_token_id, **common)
    cfg_cls = {"bert": tf.BertConfig, "roberta": tf.RobertaConfig, "mpnet": tf.MPNetConfig}[arch]
    return cfg_cls(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                   pad_token_id=tokenizer.pad_token_id, **common)


def make_model(arch: str, task: str, folder: Path, sentence_transformers: bool = True, pooling: str = "mean") -> Path:
    """Write a tiny random model for (arch, task) into ``folder``; returns the folder."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    folder = Path(folder)
    tokenizer = make_tokenizer(arch, folder / "_vocab")
    extra: dict = {}
    if task == "text-classification":
        extra = dict(id2label=dict(enumerate(CLASS_LABELS)), label2id={l: i for i, l in enumerate(CLASS_LABELS)})
    elif task == "token-classification":
        extra = dict(id2label=dict(enumerate(NER_LABELS)), label2id={l: i for i, l in enumerate(NER_LABELS)})
    config = make_config(arch, len(tokenizer), tokenizer, **extra)
    auto = {
        "text-classification": tf.AutoModelForSequenceClassification,
        "token-classification": tf.AutoModelForTokenClassification,
        "question-answering": tf.AutoModelForQuestionAnswering,
        "sentence-embeddings": tf.AutoModel,
    }[task]
    model = auto.from_config(config)
    _scale_up_head(model, task)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if task == "sentence-embeddings" and sentence_transformers:
        write_sentence_transformers_config(folder, pooling=pooling, normalize=True)
    return folder


def _scale_up_head(model, task: str) -> None:
    """Random heads give near-uniform logits whose argmax flips at the slightest change; scale them
    so a tiny model makes decisions as clearly as a trained one (validation checks the decisions)."""
    import torch

    head = {"text-classification": "classifier", "token-classification": "classifier", "question-answering": "qa_outputs"}.get(task)
    if head is None:
        return
    module = getattr(model, head, None)
    linear = module.out_proj if hasattr(module, "out_proj") else module
    with torch.no_grad():
        linear.weight.mul_(20.0)


def write_sentence_transformers_config(folder: Path, pooling: str, normalize: bool) -> None:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 32,
        "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean",
        "pooling_mode_max_tokens": pooling == "max",
    }))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 64}))
