"""Task post-processing on hand-made outputs, where the right answer is known."""

from __future__ import annotations

import numpy as np
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from modelkiln.manifest import Manifest, Pooling, TokenizerSpec
from modelkiln.runtime.tokenizer import TextEncoder
from modelkiln.tasks.embeddings import pool, spearman
from modelkiln.tasks.question_answering import QuestionAnswering
from modelkiln.tasks.token_classification import TokenClassification

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "marie", "curie", "lived", "in", "paris", "who", "?", "where"]


def word_tokenizer(truncation: str) -> TextEncoder:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    spec = TokenizerSpec(pad_token="[PAD]", pad_token_id=0, truncation=truncation)
    return TextEncoder(tok, spec, ["input_ids", "attention_mask", "token_type_ids"], max_length=16)


def manifest(task: str, labels=None) -> Manifest:
    return Manifest(name="t", task=task, input_names=[], output_names=[], max_length=16, tokenizer=TokenizerSpec(),
                    variants=[], labels=labels)


def test_collate_pads_and_keeps_pairs_apart():
    enc = word_tokenizer("longest_first")
    feeds, encodings = enc.encode(["marie curie", ("who lived", "in paris")])
    assert feeds["input_ids"].tolist() == [[2, 4, 5, 3, 0, 0, 0], [2, 9, 6, 3, 7, 8, 3]]
    assert feeds["attention_mask"].tolist() == [[1, 1, 1, 1, 0, 0, 0], [1] * 7]
    assert feeds["token_type_ids"].tolist() == [[0] * 7, [0, 0, 0, 0, 1, 1, 1]]


def test_entities_are_grouped_with_character_offsets():
    text = "marie curie lived in paris"
    enc = word_tokenizer("longest_first")
    _, encodings = enc.encode([text])
    labels = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]
    tags = [0, 1, 2, 0, 0, 3, 0]  # [CLS] marie curie lived in paris [SEP]
    logits = np.full((1, 7, 5), -5.0, dtype=np.float32)
    for t, k in enumerate(tags):
        logits[0, t, k] = 5.0
    task = TokenClassification(manifest("token-classification", labels))
    (entities,) = task.postprocess({"logits": logits}, encodings, [text])
    assert [(e["entity_group"], e["word"], e["start"], e["end"]) for e in entities] == [
        ("PER", "marie curie", 0, 11), ("LOC", "paris", 21, 26)]
    assert all(0.99 < e["score"] <= 1.0 for e in entities)


def test_qa_span_stays_in_the_context():
    question, context = "who lived in paris ?", "marie curie lived in paris"
    enc = word_tokenizer("only_second")
    _, encodings = enc.encode([(question, context)])
    n = len(encodings[0].ids)  # [CLS] q(5) [SEP] c(5) [SEP] = 13
    start, end = np.zeros((1, n), np.float32), np.zeros((1, n), np.float32)
    start[0, 1] = end[0, 1] = 50.0  # the best logits point into the question: must be ignored
    start[0, 7], end[0, 8] = 10.0, 10.0  # "marie curie"
    task = QuestionAnswering(manifest("question-answering"))
    (answer,) = task.postprocess({"start_logits": start, "end_logits": end}, encodings, [(question, context)])
    assert answer["answer"] == "marie curie" and (answer["start"], answer["end"]) == (0, 11)
    assert 0.9 < answer["score"] <= 1.0


def test_pooling_modes_respect_the_mask():
    hidden = np.array([[[1.0, 0.0], [3.0, 2.0], [100.0, 100.0]]], dtype=np.float32)  # last token is padding
    mask = np.array([[1.0, 1.0, 0.0]], dtype=np.float32)
    np.testing.assert_allclose(pool(hidden, mask, Pooling("mean", False)), [[2.0, 1.0]])
    np.testing.assert_allclose(pool(hidden, mask, Pooling("max", False)), [[3.0, 2.0]])
    np.testing.assert_allclose(pool(hidden, mask, Pooling("cls", False)), [[1.0, 0.0]])
    np.testing.assert_allclose(np.linalg.norm(pool(hidden, mask, Pooling("mean", True))), 1.0, rtol=1e-6)


def test_spearman_matches_definition():
    a = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    assert spearman(a, a * 10) == 1.0
    assert spearman(a, -a) == -1.0
    assert abs(spearman(np.array([1.0, 2.0, 2.0, 3.0]), np.array([1.0, 2.0, 3.0, 4.0])) - 0.9486833) < 1e-6


def test_each_task_owns_its_protocol_contract():
    """Specs, tensors → inputs, answers → tensors and back, with no task name outside the class."""
    from modelkiln.tasks import TASKS
    from modelkiln.tasks import tensors as t

    answers = {
        "text-classification": [[{"label": "POS", "score": 0.75}, {"label": "NEG", "score": 0.25}]],
        "sentence-embeddings": [np.array([0.6, 0.8], dtype=np.float32)],
        "token-classification": [[{"entity_group": "PER", "score": 0.5, "word": "Marie", "start": 0, "end": 5}]],
        "question-answering": [{"answer": "Paris", "score": 0.5, "start": 3, "end": 8}],
    }
    inputs = {"text-classification": [("a", "b")], "sentence-embeddings": ["a"], "token-classification": ["a"],
              "question-answering": [("who?", "Marie")]}
    for name, cls in TASKS.items():
        task = cls(manifest(name, labels=["NEG", "POS"]))
        specs = task.output_specs({"last_hidden_state": (-1, -1, 2)})
        assert [s.name for s in specs] == list(cls.outputs) and all(s.shape[0] == -1 for s in specs)
        assert [s.name for s in task.input_specs() if not s.optional] == list(cls.inputs)
        request = cls.tensors_from_inputs(inputs[name])  # client side ...
        assert set(request) == {s.name for s in task.input_specs()}
        assert cls.inputs_from_tensors(request) == inputs[name]  # ... and back, server side
        tensors = task.answer_tensors(answers[name])
        assert {n: t.datatype(a) for n, a in tensors.items()} == {s.name: s.datatype for s in specs}
        back = cls.answers_from_tensors(["NEG", "POS"], tensors)
        if name == "sentence-embeddings":
            np.testing.assert_allclose(back[0], answers[name][0])
        elif name == "text-classification":
            assert back == [[{"label": "POS", "score": 0.75}, {"label": "NEG", "score": 0.25}]]
        else:
            assert back == answers[name]
    emb = TASKS["sentence-embeddings"](manifest("sentence-embeddings"))
    assert emb.output_specs({"last_hidden_state": (-1, -1, 384)})[0].shape == (-1, 384)
    assert TASKS["sentence-embeddings"].embeds and TASKS["question-answering"].answers_need_text
