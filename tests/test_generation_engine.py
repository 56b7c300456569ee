"""The generation engine on a tiny exported Llama (grouped-query attention): batched sequences of
different lengths, joining and leaving between steps, sampling, stop strings, detokenization."""

from __future__ import annotations

import numpy as np
import pytest

from modelkiln.errors import InvalidInputError
from modelkiln.generation.decoder import DecoderSession
from modelkiln.generation.detokenizer import IncrementalDetokenizer
from modelkiln.generation.engine import GenerationEngine
from modelkiln.generation.generator import Generator, Request
from modelkiln.generation.sampling import Sampler, SamplingParams, apply_repetition_penalty
from modelkiln.generation.stopping import StopStringMatcher

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 30], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51], [7]]


@pytest.fixture(scope="module")
def tiny(tiny_generation_artifact):
    from tokenizers import Tokenizer

    folder = tiny_generation_artifact
    return folder / "model.onnx", Tokenizer.from_file(str(folder / "tokenizer.json"))


@pytest.fixture(scope="module", params=[True, False], ids=["ortvalue", "numpy"])
def decoder(tiny, request):
    return DecoderSession(tiny[0], threads=1, io_binding=request.param)


def greedy_alone(decoder, prompt, n, logits_seen=None):
    engine = GenerationEngine(decoder)
    logits, out = engine.add("solo", prompt), []
    for _ in range(n):
        if logits_seen is not None:
            logits_seen.append(logits)
        out.append(int(np.argmax(logits)))
        logits = engine.step({"solo": out[-1]})[0]
    return out


def test_decoder_reads_the_model_shape(decoder):
    assert (decoder.layers, decoder.kv_heads, decoder.head_dim) == (2, 2, 8)


def test_batched_sequences_join_and_leave_and_match_their_lone_runs(decoder):
    steps = 12
    expected_logits: list[list[np.ndarray]] = [[] for _ in PROMPTS]
    expected = [greedy_alone(decoder, p, steps, expected_logits[i]) for i, p in enumerate(PROMPTS)]
    engine = GenerationEngine(decoder)
    got: dict[int, list[int]] = {i: [] for i in range(len(PROMPTS))}
    nxt: dict[int, int] = {}
    worst = 0.0  # largest logit difference between a batched step and the same step alone

    def record(i, logits):
        nonlocal worst
        if len(got[i]) < steps:
            worst = max(worst, float(np.abs(logits - expected_logits[i][len(got[i])]).max()))
            got[i].append(int(np.argmax(logits)))
        nxt[i] = int(np.argmax(logits))

    def admit(i):
        record(i, engine.add(i, PROMPTS[i]))

    admit(0), admit(1)
    for step in range(16):
        if step == 3:  # two sequences join a running batch, one shorter and one longer than it
            admit(2), admit(3)
        if step == 6:  # one leaves mid-way; the others go on
            engine.remove(1)
            nxt.pop(1)
        logits = engine.step(nxt)
        for row, seq in enumerate(engine.rows):
            record(seq, logits[row])
    assert worst < 1e-4  # the same computation, up to float summation order
    assert len(got[1]) == 7 and got[1] == expected[1][:7]
    for i in (0, 2, 3):
        assert got[i] == expected[i], f"sequence {i} differs from its lone run"


def test_leaving_trims_padding_no_row_needs(decoder):
    engine = GenerationEngine(decoder)
    engine.add("long", list(range(5, 45)))
    engine.add("short", [5, 6])
    assert engine.width == 40 and engine.cache_tokens == 80
    engine.remove("long")
    assert engine.width == 2 and engine.length("short") == 2 and engine.cache_tokens == 2


def test_chunked_prefill_equals_one_prefill(decoder):
    engine = GenerationEngine(decoder)
    whole = engine.prefill("a", PROMPTS[2])
    engine.prefill("b", PROMPTS[2][:5])
    chunked = engine.prefill("b", PROMPTS[2][5:])
    np.testing.assert_allclose(whole, chunked, atol=1e-5)


def test_step_needs_a_token_for_every_running_sequence(decoder):
    engine = GenerationEngine(decoder)
    engine.add("a", [5, 6])
    engine.add("b", [7])
    with pytest.raises(InvalidInputError):
        engine.step({"a": 1})


def test_context_limit_is_a_clear_error(decoder):
    with pytest.raises(InvalidInputError, match="context"):
        GenerationEngine(decoder, max_context=4).add("a", [1, 2, 3, 4, 5])


# --- generator: sampling, seeds, stop strings ---------------------------------------------------


@pytest.fixture(scope="module")
def generator(tiny):
    decoder = DecoderSession(tiny[0], threads=1)
    return Generator(GenerationEngine(decoder), tiny[1], eos_ids=[0], max_batch=4)


def prompt_ids(generator, text):
    return generator.tokenizer.encode(text).ids


def test_seeded_sampling_is_reproducible_alone_or_in_a_batch(generator):
    params = SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.95, seed=7, ignore_eos=True)
    ids = prompt_ids(generator, "The quick brown fox")
    alone = generator.generate([Request("r", ids, params)])[0].token_ids
    again = generator.generate([Request("r", ids, params)])[0].token_ids
    crowd = generator.generate([Request("x", prompt_ids(generator, "Hi!"), SamplingParams(max_new_tokens=5)),
                                Request("r", ids, params),
                                Request("y", ids, SamplingParams(max_new_tokens=20, temperature=1.0, seed=1, ignore_eos=True))])
    other_seed = generator.generate([Request("r", ids, SamplingParams(**{**params.__dict__, "seed": 8}))])[0].token_ids
    assert alone == again == crowd[1].token_ids
    assert other_seed != alone


def test_max_new_tokens_and_finish_reason(generator):
    ids = prompt_ids(generator, "Hi!")
    out = generator.generate([Request("r", ids, SamplingParams(max_new_tokens=5, ignore_eos=True))])[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_stop_string_cuts_the_text_and_finishes(generator):
    ids = prompt_ids(generator, "The quick brown fox")
    full = generator.generate([Request("r", ids, SamplingParams(max_new_tokens=24, ignore_eos=True))])[0]
    assert len(full.text) > 6, full.text
    stop = full.text[3:6]  # very likely spans a token boundary in a 400-token vocabulary
    cut = generator.generate([Request("r", ids, SamplingParams(max_new_tokens=24, ignore_eos=True, stop=(stop,)))])[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]


def test_eos_token_finishes_with_stop(generator):
    ids = prompt_ids(generator, "The quick brown fox")
    first = generator.generate([Request("r", ids, SamplingParams(max_new_tokens=3, ignore_eos=True))])[0].token_ids
    out = generator.generate([Request("r", ids, SamplingParams(max_new_tokens=3, stop_token_ids=(first[1],)))])[0]
    assert out.token_ids == first[:2] and out.finish_reason == "stop"


# --- units: sampling, stop matcher, detokenizer ---------------------------------------------------


def test_top_k_1_and_tiny_top_p_are_greedy():
    logits = np.random.default_rng(0).normal(size=100).astype(np.float32)
    for params in (SamplingParams(temperature=1.0, top_k=1, seed=3), SamplingParams(temperature=1.0, top_p=1e-6, seed=3)):
        sampler = Sampler(params)
        assert {sampler(logits) for _ in range(20)} == {int(np.argmax(logits))}


def test_top_k_samples_only_among_the_k_best():
    logits = np.random.default_rng(1).normal(size=50).astype(np.float32)
    sampler = Sampler(SamplingParams(temperature=5.0, top_k=3, seed=0))
    assert {sampler(logits) for _ in range(200)} == set(np.argsort(-logits)[:3].tolist())


def test_repetition_penalty_lowers_seen_tokens():
    logits = np.array([2.0, -2.0, 1.0], dtype=np.float32)
    np.testing.assert_allclose(apply_repetition_penalty(logits, [0, 1], 2.0), [1.0, -4.0, 1.0])


def test_invalid_sampling_settings_are_typed_errors():
    for bad in (dict(max_new_tokens=0), dict(temperature=-1), dict(top_p=0), dict(top_k=-1), dict(stop=("",))):
        with pytest.raises(InvalidInputError):
            SamplingParams(**bad)


def test_stop_matcher_holds_a_possible_prefix_across_chunks():
    m = StopStringMatcher(["\nUser:"])
    assert m.feed("Hello") == "Hello"
    assert m.feed(" there\nUs") == " there"  # "\nUs" might begin the stop string
    assert m.feed("ually") == "\nUsually"
    assert m.feed("\nU") == ""
    assert m.feed("ser: hi") == "" and m.stopped


def test_stop_matcher_releases_the_held_tail_at_the_end():
    m = StopStringMatcher(["###"])
    assert m.feed("a ##") == "a "
    assert m.flush() == "##"


def test_detokenizer_never_emits_half_a_character(tiny):
    tokenizer = tiny[1]
    text = "Ünïcödé: 東京の天気 — Москва 🎸🔥 naïve café"
    ids = tokenizer.encode(text).ids
    assert len(ids) > len(text) / 2  # the tiny vocabulary splits most characters into bytes
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push(i) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces  # some tokens ended mid-character and were held back
    assert "".join(pieces) + detok.flush() == tokenizer.decode(ids)


# --- chat templates -----------------------------------------------------------------------------

CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\\nYou are a helpful AI assistant<|im_end|>\\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_chat_template_renders_like_transformers():
    from modelkiln.generation.chat import chat_messages, render_chat

    assert render_chat(CHATML, chat_messages("Hi?", "Be brief.")) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\n")
    assert render_chat(CHATML, chat_messages("Hi?")).startswith("<|im_start|>system\nYou are a helpful AI assistant")


def test_chat_template_errors_are_typed():
    from modelkiln.generation.chat import render_chat

    with pytest.raises(InvalidInputError, match="roles must alternate"):
        render_chat("{{ raise_exception('roles must alternate') }}", [])
    with pytest.raises(InvalidInputError, match="no chat template"):
        render_chat("", [])
