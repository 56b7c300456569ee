"""The two generation engines on a tiny Llama (grouped-query attention): the serving graph's
(GroupQueryAttention, cache written in place) and the torch export's (left-padded batch). Batched
sequences of different lengths join and leave between steps and must match their lone runs (bit
for bit on the serving graph); then the engine core's sampling, stop strings and end of sequence."""

from __future__ import annotations

import numpy as np
import pytest

from generation_helpers import export_decoder
from modelkiln.errors import InvalidInputError
from modelkiln.generation.core import EngineCore, Request, complete, run_to_completion
from modelkiln.generation.text.detokenizer import IncrementalDetokenizer
from modelkiln.generation.engines.registry import EngineOptions
from modelkiln.generation.model import TextGenerationModel
from modelkiln.generation.engines.onnx.padded import PaddedEngine
from modelkiln.generation.sampling import SamplingParams, TokenChooser
from modelkiln.generation.sampling.selection import reference_draw
from modelkiln.generation.engines.onnx.serving import ServingEngine
from modelkiln.generation.text.stopping import StopStringMatcher

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 30], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51], [7]]


@pytest.fixture(scope="module")
def tiny(tiny_generation_artifact):
    return TextGenerationModel(tiny_generation_artifact)


@pytest.fixture(scope="module")
def exported_graph(tiny_generation_artifact, tmp_path_factory):
    """The same tiny Llama through the torch export (the fallback graph)."""
    return export_decoder(tiny_generation_artifact.parent / "hf", tmp_path_factory.mktemp("export") / "model.onnx")


@pytest.fixture(params=["serving", "export"])
def make_engine(request, tiny, exported_graph):
    def make(max_context=None, max_rows=8):
        path = tiny.variant_path("fp32")[1] if request.param == "serving" else exported_graph
        engine = tiny.engine_for_file(path, EngineOptions(threads=1, max_rows=max_rows))
        if max_context is not None:
            engine.max_context = max_context
        return engine
    make.kind = request.param
    return make


def greedy_alone(engine, prompt, n, logits_seen=None):
    logits, out = engine.add("solo", prompt), []
    for _ in range(n):
        if logits_seen is not None:
            logits_seen.append(logits.copy())
        out.append(int(np.argmax(logits)))
        logits = engine.step({"solo": out[-1]})[0]
    engine.remove("solo")
    return out


def test_each_graph_gets_its_engine(make_engine):
    assert isinstance(make_engine(), ServingEngine if make_engine.kind == "serving" else PaddedEngine)


def test_batched_sequences_join_and_leave_and_match_their_lone_runs(make_engine):
    steps = 12
    engine = make_engine()
    expected_logits: list[list[np.ndarray]] = [[] for _ in PROMPTS]
    expected = [greedy_alone(engine, p, steps, expected_logits[i]) for i, p in enumerate(PROMPTS)]
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
        if step == 6:  # one leaves mid-way (not the last row: the serving engine moves the last into its place)
            engine.remove(1)
            nxt.pop(1)
        logits = engine.step(nxt)
        for row, seq in enumerate(engine.rows):
            record(seq, logits[row])
    if make_engine.kind == "serving":
        assert worst == 0.0  # each row over its own length: bit for bit
    else:
        assert worst < 1e-4  # a padded batch: the same computation up to float summation order
    assert len(got[1]) == 7 and got[1] == expected[1][:7]
    for i in (0, 2, 3):
        assert got[i] == expected[i], f"sequence {i} differs from its lone run"


def test_a_ghost_row_changes_no_answer(tiny):
    """Where a machine's kernels round a lone row differently, the serving engine decodes a lone
    sequence with a throw-away row beside it: forced on here, the answers stay those of a lone row."""
    engine = tiny.engine("fp32", EngineOptions(threads=1))
    plain = [greedy_alone(engine, p, 8) for p in PROMPTS]
    engine.ghost_rows = True
    assert engine._rows_to_bind(1) == 2 and engine._rows_to_bind(2) == 2
    assert [greedy_alone(engine, p, 8) for p in PROMPTS] == plain


def test_chunked_prefill_equals_one_prefill(make_engine):
    engine = make_engine()
    whole = engine.prefill("a", PROMPTS[2])
    engine.prefill("b", PROMPTS[2][:5])
    chunked = engine.prefill("b", PROMPTS[2][5:])
    if make_engine.kind == "serving":
        np.testing.assert_array_equal(whole, chunked)
    else:
        np.testing.assert_allclose(whole, chunked, atol=1e-5)


def test_any_chunking_of_a_prompt_gives_the_same_bits(tiny):
    """However a prompt is cut into chunks (a prefix-cache hit leaves any remainder, one token
    included), its logits and the steps after it are the whole prompt's, bit for bit."""
    engine = tiny.engine("fp32", EngineOptions(threads=1))
    prompt = PROMPTS[2]

    def run(split):
        seq, start = ("split", tuple(split)), 0
        for n in split:
            logits = engine.prefill(seq, prompt[start:start + n])
            start += n
        engine.join(seq)
        seen = [logits.copy()]
        for _ in range(4):
            seen.append(engine.step({seq: int(np.argmax(seen[-1]))})[0].copy())
        engine.remove(seq)
        return seen

    whole = run([len(prompt)])
    n = len(prompt)
    for split in ([n - 1, 1], [1, n - 1], [5, 1, n - 6], [n - 2, 1, 1], [1] * n, [3] * (n // 3) + [n % 3] * bool(n % 3)):
        assert all(np.array_equal(a, b) for a, b in zip(whole, run(split))), split


def test_kv_accounting(make_engine):
    """The serving engine holds each sequence's own length; the padded one, rows × the longest."""
    engine = make_engine()
    engine.add("long", list(range(5, 45)))
    engine.add("short", [5, 6])
    if make_engine.kind == "serving":
        assert engine.cache_tokens == 42 and engine.kv_tokens_needed([40, 2]) == 42
    else:
        assert engine.width == 40 and engine.cache_tokens == 80 and engine.kv_tokens_needed([40, 2]) == 80
    engine.remove("long")
    assert engine.length("short") == 2 and engine.cache_tokens == 2


def test_step_needs_a_token_for_every_running_sequence(make_engine):
    engine = make_engine()
    engine.add("a", [5, 6])
    engine.add("b", [7])
    with pytest.raises(InvalidInputError):
        engine.step({"a": 1})


def test_context_limit_is_a_clear_error(make_engine):
    with pytest.raises(InvalidInputError, match="context"):
        make_engine(max_context=4).add("a", [1, 2, 3, 4, 5])


def test_first_chunks_of_several_prompts_in_one_call_equal_each_alone(make_engine):
    """New prompts of different lengths prefilled together (right-padded) then decoded: the logits of
    the call and of every later step are each prompt's own (bit for bit on the serving graph)."""
    engine = make_engine()
    alone_logits: list[list[np.ndarray]] = [[] for _ in PROMPTS]
    alone = [greedy_alone(engine, p, 6, alone_logits[i]) for i, p in enumerate(PROMPTS)]
    firsts = engine.prefill_first([(i, p) for i, p in enumerate(PROMPTS)])
    got = {i: [int(np.argmax(row))] for i, row in enumerate(firsts)}
    for i in range(len(PROMPTS)):
        engine.join(i)
    for _ in range(5):
        logits = engine.step({i: got[i][-1] for i in engine.rows})
        for row, i in enumerate(engine.rows):
            got[i].append(int(np.argmax(logits[row])))
    assert [got[i] for i in range(len(PROMPTS))] == alone
    for i, row in enumerate(firsts):
        if make_engine.kind == "serving":
            np.testing.assert_array_equal(row, alone_logits[i][0])
        else:
            np.testing.assert_allclose(row, alone_logits[i][0], atol=1e-5)


def test_a_burst_of_new_prompts_prefills_in_one_call(tiny):
    """Four prompts arriving together with no cached prefix: one engine call prefills them all, and
    each answer is its answer alone."""
    from modelkiln.generation.core import greedy

    engine = tiny.engine("fp32", EngineOptions(threads=1))
    calls = []
    first, single = engine.prefill_first, engine.prefill
    engine.prefill_first = lambda prompts: (calls.append(len(prompts)), first(prompts))[1]
    engine.prefill = lambda *a, **k: (calls.append(1), single(*a, **k))[1]
    core = EngineCore(engine, tiny.tokenizer, tiny.eos_ids, prefill_chunk=128)
    together = complete(core, [Request(i, p, greedy(8)) for i, p in enumerate(PROMPTS)])
    assert calls == [len(PROMPTS)]
    alone = [complete(core, [Request(i, p, greedy(8))])[0] for i, p in enumerate(PROMPTS)]
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]


def test_a_prefix_cache_hit_changes_no_answer(tiny):
    """Prompts sharing a chat-template prefix: through a core whose engine caches prefixes, later
    prompts restore the shared blocks and prefill only the rest; their tokens and every logit equal
    those of an engine without the cache, bit for bit, alone and all together."""
    from modelkiln.generation.core import greedy

    texts = ["The quick brown fox", "Hello there, how are you?", "Once upon a time there was a", "Hi!"]
    prompts = [tiny.prompt_ids(t, chat=True, system="You are a helpful assistant who answers in one short sentence.")
               for t in texts]

    def run(prefix_cache: bool, together: bool):
        engine = tiny.engine("fp32", EngineOptions(threads=1, prefix_cache_tokens=4096 if prefix_cache else 0,
                                                   keep_logits=True))
        core = EngineCore(engine, tiny.tokenizer, tiny.eos_ids, prefill_chunk=8)
        requests = [Request(i, p, greedy(12)) for i, p in enumerate(prompts)]
        done = complete(core, requests) if together else [complete(core, [r])[0] for r in requests]
        return done, engine

    shared = min(next(i for i, (x, y) in enumerate(zip(prompts[0], p)) if x != y) for p in prompts[1:])
    plain, _ = run(False, together=False)
    for together in (False, True):
        cached, engine = run(True, together)
        if not together:  # each prompt after the first restores the full blocks of the shared system prompt
            size = engine.prefixes.block_tokens
            assert engine.prefixes.hit_tokens >= (len(prompts) - 1) * (shared // size) * size > 0
        for a, b in zip(plain, cached):
            assert a.token_ids == b.token_ids
            assert all(np.array_equal(x, y) for x, y in zip(a.logits, b.logits))


def test_the_prefix_cache_evicts_least_recently_used_chains():
    from modelkiln.generation.prefix_cache import PrefixCache

    def blocks(cache, ids):
        return [b.tokens for b in cache.lookup(ids)[0]]

    cache = PrefixCache(max_tokens=100, block_tokens=2)
    kv = lambda a, b: np.full((1, 1, b - a, 1), a, np.float32)  # noqa: E731
    cache.insert([1, 2, 3, 4, 5], kv)  # blocks [1,2] and [1,2,3,4]
    cache.insert([7, 8, 9], kv)  # block [7,8]
    assert cache.tokens == 6
    assert blocks(cache, [1, 2, 3, 4, 6]) == [(1, 2), (3, 4)]  # now the most recent
    assert blocks(cache, [1, 2, 3, 4]) == [(1, 2)]  # the last token is never restored without a whole entry
    assert cache.evict(1) == 2 and cache.tokens == 4  # [7,8] went first
    assert cache.evict(1) == 2 and cache.tokens == 2  # then [1,2,3,4], used less recently than its start [1,2]
    assert blocks(cache, [1, 2, 3]) == [(1, 2)]
    cache.insert([1, 2, 3, 4, 5], kv)
    cache.lookup([1, 2, 3, 4, 6])  # the start, then its child: the start is now the older of the two
    assert cache.evict(1) == 4 and cache.tokens == 0  # the start goes, and its child with it (unreachable)
    assert blocks(cache, [1, 2, 3]) == []
    small = PrefixCache(max_tokens=4, block_tokens=2)  # a bound: the oldest chain makes room
    small.insert([1, 2, 3, 4], kv)
    small.insert([5, 6, 7, 8], kv)
    assert small.tokens == 4 and blocks(small, [5, 6, 7, 8, 9]) == [(5, 6), (7, 8)]


def test_a_prompt_seen_whole_is_restored_whole_with_its_last_logits():
    from modelkiln.generation.prefix_cache import PrefixCache

    cache = PrefixCache(max_tokens=100, block_tokens=2)
    kv = lambda a, b: np.full((1, 1, b - a, 1), a, np.float32)  # noqa: E731
    logits = np.arange(4, dtype=np.float32)
    cache.insert([1, 2, 3, 4, 5], kv, logits)
    assert cache.tokens == 5  # two blocks and the one-token tail
    found, whole = cache.lookup([1, 2, 3, 4, 5])
    assert [b.tokens for b in found] == [(1, 2), (3, 4)] and whole is not None
    assert whole.tail_kv.shape[2] == 1 and whole.tail_kv[0, 0, 0, 0] == 4 and np.array_equal(whole.logits, logits)
    assert cache.cached_tokens([1, 2, 3, 4, 5]) == 5 and cache.cached_tokens([1, 2, 3, 4, 6]) == 4
    cache.insert([1, 2, 3, 4], kv, logits)  # a whole prompt ending on a block boundary: an empty tail
    assert cache.cached_tokens([1, 2, 3, 4]) == 4
    cache.evict(1)  # whole entries go first
    assert cache.lookup([1, 2, 3, 4, 5])[1] is None and cache.cached_tokens([1, 2, 3, 4, 5]) == 4


# --- the engine core: sampling, seeds, stop strings ---------------------------------------------------


@pytest.fixture(scope="module")
def core(tiny):
    return EngineCore(tiny.engine("fp32", EngineOptions(threads=1)), tiny.tokenizer, eos_ids=[0], max_running=4)


def prompt_ids(core, text):
    return core.tokenizer.encode(text).ids


def test_seeded_sampling_is_reproducible_alone_or_in_a_batch(core):
    params = SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.95, seed=7, ignore_eos=True)
    ids = prompt_ids(core, "The quick brown fox")
    alone = complete(core, [Request("r", ids, params)])[0].token_ids
    again = complete(core, [Request("r", ids, params)])[0].token_ids
    crowd = complete(core, [Request("x", prompt_ids(core, "Hi!"), SamplingParams(max_new_tokens=5)),
                            Request("r", ids, params),
                            Request("y", ids, SamplingParams(max_new_tokens=20, temperature=1.0, seed=1, ignore_eos=True))])
    other_seed = complete(core, [Request("r", ids, SamplingParams(**{**params.__dict__, "seed": 8}))])[0].token_ids
    assert alone == again == crowd[1].token_ids
    assert other_seed != alone


def test_a_first_token_comes_out_before_the_decode_step(core):
    """step_parts: the prefill's first token is handed out before the decode step of every running
    sequence runs (serve sends it then), and the two parts together are what step() returns."""
    ids = prompt_ids(core, "The quick brown fox")
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    expected = complete(core, [Request("r", ids, params)])[0].token_ids
    core.add_request(Request("r", ids, params))
    parts = core.step_parts()
    first = next(parts)
    assert [o.delta.token_id for o in first] == expected[:1]
    assert core.decoding == 1  # joined the decode batch, not yet stepped
    second = next(parts)
    assert [o.delta.token_id for o in second] == expected[1:2]
    assert next(parts, None) is None
    tokens = expected[:2]
    while core.has_work():
        tokens += [o.delta.token_id for o in core.step()]
    assert tokens == expected


def test_max_new_tokens_and_finish_reason(core):
    ids = prompt_ids(core, "Hi!")
    out = complete(core, [Request("r", ids, SamplingParams(max_new_tokens=5, ignore_eos=True))])[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_stop_string_cuts_the_text_and_finishes(core):
    ids = prompt_ids(core, "The quick brown fox")
    full = complete(core, [Request("r", ids, SamplingParams(max_new_tokens=24, ignore_eos=True))])[0]
    assert len(full.text) > 6, full.text
    stop = full.text[3:6]  # very likely spans a token boundary in a 400-token vocabulary
    cut = complete(core, [Request("r", ids, SamplingParams(max_new_tokens=24, ignore_eos=True, stop=(stop,)))])[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]


def test_eos_token_finishes_with_stop(core):
    ids = prompt_ids(core, "The quick brown fox")
    first = complete(core, [Request("r", ids, SamplingParams(max_new_tokens=3, ignore_eos=True))])[0].token_ids
    out = complete(core, [Request("r", ids, SamplingParams(max_new_tokens=3, stop_token_ids=(first[1],)))])[0]
    assert out.token_ids == first[:2] and out.finish_reason == "stop"


# --- units: sampling, stop matcher, detokenizer ---------------------------------------------------


def test_top_k_1_and_tiny_top_p_are_greedy():
    logits = np.random.default_rng(0).normal(size=100).astype(np.float32)
    for params in (SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, top_p=1e-6)):
        chooser = TokenChooser(params, seed=3)
        assert {chooser.choose(logits) for _ in range(20)} == {int(np.argmax(logits))}


def test_top_k_samples_only_among_the_k_best():
    logits = np.random.default_rng(1).normal(size=50).astype(np.float32)
    chooser = TokenChooser(SamplingParams(temperature=5.0, top_k=3), seed=0)
    assert {chooser.choose(logits) for _ in range(200)} == set(np.argsort(-logits)[:3].tolist())


def test_a_masked_choice_is_the_whole_rows_with_the_others_at_minus_infinity():
    """With a grammar's mask the chooser works on the allowed tokens alone; the token is the one the
    whole row gives with every other token at -inf, for greedy and sampled settings and masks from
    one allowed token to nearly all."""
    rng = np.random.default_rng(5)
    vocab = 1000
    settings = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.6, top_k=7),
                dict(temperature=1.4, top_p=0.7), dict(temperature=1.0, repetition_penalty=1.3, logit_bias=((4, 3.0),))]
    for case in range(300):
        params = SamplingParams(seed=case, **settings[case % len(settings)])
        logits = (rng.standard_normal(vocab) * 4).astype(np.float32)
        allowed = rng.random(vocab) < [0.001, 0.02, 0.3, 0.97][case % 4]
        allowed[rng.integers(vocab)] = True
        words = np.packbits(np.concatenate([allowed, np.zeros(-vocab % 32, bool)]), bitorder="little").view(np.int32)
        history = rng.integers(0, vocab, 5).tolist()
        masked = TokenChooser(params, case, history).choose(logits, words)
        whole = TokenChooser(params, case, history)
        scores = whole._processed(logits).astype(np.float32, copy=True)
        scores[~allowed] = -np.inf
        expected = int(np.argmax(scores)) if params.greedy else reference_draw(scores, params, whole._uniform())
        assert masked == expected, f"case {case}"
        assert allowed[masked]


def test_repetition_penalty_lowers_seen_tokens():
    logits = np.array([2.0, -2.0, 1.9], dtype=np.float32)
    assert TokenChooser(SamplingParams(), seed=0, prompt_ids=[0, 1]).choose(logits) == 0
    chooser = TokenChooser(SamplingParams(repetition_penalty=2.0), seed=0, prompt_ids=[0, 1])
    assert chooser.choose(logits) == 2  # 2.0 / 2 < 1.9
    assert chooser.choose(np.array([2.2, -2.0, 2.1], dtype=np.float32)) == 0  # token 2 is seen now: 1.05 < 1.1


def test_invalid_sampling_settings_are_typed_errors():
    nan, inf = float("nan"), float("inf")
    for bad in (dict(max_new_tokens=0), dict(temperature=-1), dict(top_p=0), dict(top_k=-1), dict(stop=("",)),
                dict(temperature=nan), dict(temperature=inf), dict(top_p=nan), dict(repetition_penalty=nan),
                dict(repetition_penalty=inf), dict(seed=-1), dict(seed=2**64)):
        with pytest.raises(InvalidInputError):
            SamplingParams(**bad)


def test_extreme_but_valid_settings_still_choose_a_token():
    """A tiny temperature or a tiny/huge penalty overflows float arithmetic (inf - inf = NaN made
    numpy refuse the probabilities: the request failed, and with it every stream in its batch)."""
    logits = np.random.default_rng(2).normal(size=100).astype(np.float32) * 10
    seen = list(range(100))
    for params in (dict(temperature=1e-300), dict(temperature=1e300), dict(repetition_penalty=1e-300),
                   dict(repetition_penalty=1e300), dict(temperature=1e-300, repetition_penalty=1e-300),
                   dict(frequency_penalty=2.0, presence_penalty=-2.0), dict(logit_bias=((3, 100.0), (4, -100.0)))):
        chooser = TokenChooser(SamplingParams(**{"temperature": 1.0, **params}), seed=0, prompt_ids=seen,
                               generated=seen)
        assert 0 <= chooser.choose(logits) < 100
    # a tiny temperature is greedy
    assert TokenChooser(SamplingParams(temperature=1e-300), seed=0).choose(logits) == int(np.argmax(logits))


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
    tokenizer = tiny.tokenizer
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
    from modelkiln.generation.chat.templates import chat_messages, render_chat

    assert render_chat(CHATML, chat_messages("Hi?", "Be brief.")) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\n")
    assert render_chat(CHATML, chat_messages("Hi?")).startswith("<|im_start|>system\nYou are a helpful AI assistant")


def test_chat_template_errors_are_typed():
    from modelkiln.generation.chat.templates import render_chat

    with pytest.raises(InvalidInputError, match="roles must alternate"):
        render_chat("{{ raise_exception('roles must alternate') }}", [])
    with pytest.raises(InvalidInputError, match="no chat template"):
        render_chat("", [])


def test_the_bench_times_a_batch_larger_than_its_steps(tiny):
    """kiln bench's decode cell for 8 sequences and 2 timed steps: prompts join one step at a time
    (the prefill budget), so the first must still run when the last joins (it looped for ever)."""
    from modelkiln.bench.generation import OnnxBackend

    backend = OnnxBackend(tiny, "fp32", 1, max_batch=8)
    backend.core.prefill_chunk = 8  # one prompt per step
    samples = backend.decode_step_seconds([list(range(5, 15))] * 8, steps=2)
    assert len(samples) == 2 and backend.core.running == 0


def test_the_bench_samples_its_decode_cells_when_asked(tiny):
    """kiln bench --sampled: each decode sequence draws with the settings `kiln loadtest --sampled`
    sends and its row as its seed (greedy otherwise), end-of-sequence ignored either way."""
    from modelkiln.bench.generation import OnnxBackend
    from modelkiln.loadtest.streaming import SAMPLED

    backend = OnnxBackend(tiny, "fp32", 1, max_batch=4)
    asked: list[SamplingParams] = []
    add = backend.core.add_request
    backend.core.add_request = lambda request: (asked.append(request.params), add(request))[1]
    for sampled in (True, False):
        samples = backend.decode_step_seconds([list(range(5, 15))] * 3, steps=2, sampled=sampled)
        assert len(samples) == 2 and backend.core.running == 0
    drawn, greedy_ones = asked[:3], asked[3:]
    assert [(p.temperature, p.top_p, p.seed) for p in drawn] == [(SAMPLED["temperature"], SAMPLED["top_p"], row)
                                                                 for row in range(3)]
    assert all(p.greedy for p in greedy_ones) and all(p.ignore_eos for p in asked)


# --- the seam: what a request can ask of the engine beyond tokens -------------------------------------


def test_logprobs_are_the_models_own_and_top_ones_are_sorted(tiny):
    """logprobs=k: each token comes with the model's log-probability of it and the k most likely
    tokens at that step (from the same logits the token was chosen from, kept for the check)."""
    from modelkiln.generation.sampling import log_softmax

    core = EngineCore(tiny.engine("fp32", EngineOptions(threads=1, keep_logits=True)), tiny.tokenizer)
    params = SamplingParams(max_new_tokens=6, temperature=0.8, seed=3, logprobs=3, ignore_eos=True)
    outputs = list(run_to_completion(core, [Request("r", prompt_ids(core, "The quick brown fox"), params)]))
    assert len(outputs) == 6
    for output in outputs:
        expected = log_softmax(output.logits)
        delta = output.delta
        assert delta.logprob == pytest.approx(expected[delta.token_id], abs=1e-9)
        assert [t for t, _ in delta.top_logprobs] == np.argsort(-expected, kind="stable")[:3].tolist()
        assert [lp for _, lp in delta.top_logprobs] == sorted((lp for _, lp in delta.top_logprobs), reverse=True)
    plain = complete(core, [Request("r", prompt_ids(core, "The quick brown fox"), SamplingParams(
        max_new_tokens=6, temperature=0.8, seed=3, ignore_eos=True))])[0]
    assert plain.token_ids == [o.delta.token_id for o in outputs]  # asking for logprobs changes no token


def test_a_repeated_prompt_takes_its_first_token_from_the_cache(tiny):
    """A prompt seen whole before computes nothing: the engine runs no prefill for it, and its tokens
    and every logit equal a cold run's."""
    from modelkiln.generation.core import greedy

    engine = tiny.engine("fp32", EngineOptions(threads=1, prefix_cache_tokens=4096, keep_logits=True))
    core = EngineCore(engine, tiny.tokenizer)
    ids = prompt_ids(core, "Hello there, how are you today?")
    cold = complete(core, [Request("a", ids, greedy(6))])[0]
    calls = []
    single, first = engine.prefill, engine.prefill_first
    engine.prefill = lambda *a, **k: (calls.append("prefill"), single(*a, **k))[1]
    engine.prefill_first = lambda *a, **k: (calls.append("prefill_first"), first(*a, **k))[1]
    warm = complete(core, [Request("b", ids, greedy(6))])[0]
    assert calls == [] and engine.prefixes.hit_tokens >= len(ids)
    assert warm.token_ids == cold.token_ids
    assert all(np.array_equal(x, y) for x, y in zip(warm.logits, cold.logits))


@pytest.mark.parametrize("sampled", [False, True])
def test_a_resumed_request_continues_exactly(tiny, sampled):
    """A request resumed elsewhere as prompt + the tokens already sent (``resume_ids``, with the
    original seed) gives the rest of the uninterrupted answer, token for token and text for text:
    draws are keyed by (seed, position), penalties count the resumed tokens."""
    core = EngineCore(tiny.engine("fp32", EngineOptions(threads=1)), tiny.tokenizer)
    ids = prompt_ids(core, "The quick brown fox")
    extra = dict(temperature=0.9, top_p=0.95, frequency_penalty=0.5, seed=11) if sampled else {}
    params = SamplingParams(max_new_tokens=16, ignore_eos=True, **extra)
    whole = list(run_to_completion(core, [Request("w", ids, params)]))
    for cut in (1, 7, 15):
        sent = [o.delta.token_id for o in whole[:cut]]
        rest = list(run_to_completion(core, [Request("r", ids, params, resume_ids=sent, seed=whole[0].request.seed)]))
        assert [o.delta.token_id for o in rest] == [o.delta.token_id for o in whole[cut:]]
        assert "".join(o.delta.text for o in rest) == "".join(o.delta.text for o in whole[cut:])
        assert rest[-1].delta.finish_reason == whole[-1].delta.finish_reason


@pytest.mark.parametrize("sampled", [False, True])
def test_a_resumed_request_computes_the_same_numbers(tiny, sampled):
    """Not only the same tokens: the same logits, bit for bit, at every position after the cut. The
    resumed tokens go through decode steps, as the first run computed them; a prefill of them gives
    other numbers (here ~1e-6, on SmolLM2's int4 variant 0.5 to 0.9: other tokens)."""
    core = EngineCore(tiny.engine("fp32", EngineOptions(threads=1, keep_logits=True)), tiny.tokenizer)
    ids = prompt_ids(core, "The quick brown fox")
    extra = dict(temperature=0.9, top_p=0.95, repetition_penalty=1.2, seed=5) if sampled else {}
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, **extra)
    whole = complete(core, [Request("w", ids, params)])[0]
    for cut in (1, 7):
        rest = complete(core, [Request("r", ids, params, resume_ids=whole.token_ids[:cut])])[0]
        assert rest.token_ids == whole.token_ids[cut:]
        assert all(np.array_equal(a, b) for a, b in zip(rest.logits, whole.logits[cut:])), cut


def test_a_request_without_a_seed_gets_one_that_reproduces_it(tiny):
    core = EngineCore(tiny.engine("fp32", EngineOptions(threads=1)), tiny.tokenizer)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, ignore_eos=True)
    first = Request("a", prompt_ids(core, "Hi!"), params)
    tokens = complete(core, [first])[0].token_ids
    assert first.seed is not None
    again = complete(core, [Request("b", prompt_ids(core, "Hi!"), params, seed=first.seed)])[0].token_ids
    assert again == tokens


def test_answers_to_one_prompt_compute_it_once(tiny):
    """Requests with the same prompt arriving together (OpenAI's n): the first computes the prompt,
    the others wait for it to be in the prefix cache and take their first token from it; each answer
    equals its answer alone."""
    engine = tiny.engine("fp32", EngineOptions(threads=1, prefix_cache_tokens=4096))
    core = EngineCore(engine, tiny.tokenizer, max_running=4)
    ids = prompt_ids(core, "Once upon a time there was a little fox")
    params = [SamplingParams(max_new_tokens=8, temperature=1.0, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    alone = [complete(core, [Request(i, ids, p)])[0].token_ids for i, p in enumerate(params)]
    engine.use_prefix_cache(4096)  # empty again
    computed = []
    single, first = engine.prefill, engine.prefill_first
    engine.prefill = lambda seq, tokens, **k: (computed.append(len(tokens)), single(seq, tokens, **k))[1]
    engine.prefill_first = lambda prompts: (computed.extend(len(t) for _, t in prompts), first(prompts))[1]
    together = complete(core, [Request(i, ids, p) for i, p in enumerate(params)])
    assert computed == [len(ids)]
    assert [c.token_ids for c in together] == alone


def test_constrained_answers_close_within_max_tokens(tiny):
    """A random model writes long strings: near max_tokens its constrained answer is closed by the
    grammar's shortest completion, so every answer parses and ends with "stop", greedy or sampled,
    and is the same among unconstrained streams; a budget too small to close ends with "length"."""
    import json

    from modelkiln.generation.structured_output.grammars import Grammars, compile_constraint
    from modelkiln.generation.structured_output.vocabulary import Vocabulary

    schema = {"type": "object", "properties": {
        "name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        "kind": {"enum": ["cat", "dog"]}}, "required": ["name", "tags", "kind"]}
    grammar = compile_constraint("json_schema", {"schema": schema, "strict": True},
                                 Grammars(Vocabulary(tiny.tokenizer, tiny.eos_ids)))
    core = EngineCore(tiny.engine("fp32", EngineOptions(threads=1)), tiny.tokenizer, tiny.eos_ids, max_running=4)
    ids = prompt_ids(core, "The quick brown fox")
    for extra in ({}, dict(temperature=1.0, seed=1), dict(temperature=1.0, seed=2)):
        params = SamplingParams(max_new_tokens=grammar.shortest_answer + 20, constraint=grammar, **extra)
        alone = complete(core, [Request("g", ids, params)])[0]
        crowd = complete(core, [Request("x", ids, SamplingParams(max_new_tokens=60, ignore_eos=True)),
                                Request("g", ids, params)])[1]
        answer = json.loads(alone.text)
        assert set(answer) == {"name", "tags", "kind"} and answer["kind"] in ("cat", "dog") and answer["tags"]
        assert alone.finish_reason == "stop" and len(alone.token_ids) <= params.max_new_tokens
        assert crowd.token_ids == alone.token_ids
    short = complete(core, [Request("s", ids, SamplingParams(max_new_tokens=5, constraint=grammar))])[0]
    assert short.finish_reason == "length" and len(short.token_ids) == 5
