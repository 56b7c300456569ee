"""The torch engine (generation/engines/torch/engine.py) on tiny random decoders, on the CPU: transformers'
greedy tokens through the engine core (Llama, Qwen2 with biases, Mistral with a sliding window), an
answer's bits the same alone and among others (rows joining and leaving, prompts prefilled in chunks
while others decode, decode steps replayed in padded buckets), sampling with TokenChooser's semantics
on the device, reproducible and resumable, log-probabilities, grammar masks, slots given back."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from generation_helpers import make_tiny_causal_lm, make_tiny_mistral
from modelkiln.convert.generation.gate import GatePrompts, candidate_run, check_batch_invariance
from modelkiln.convert.generation.torch_weights import save_weights
from modelkiln.errors import InvalidInputError
from modelkiln.generation.core import EngineCore, Request, complete, greedy, prompt_logits, run_to_completion
from modelkiln.generation.model import CoreOptions, TextGenerationModel
from modelkiln.generation.plan import EngineOptions, ModelShape
from modelkiln.generation.sampling import SamplingParams, TokenChooser, log_softmax
from modelkiln.generation.engines.torch.engine import StepGraphs, TorchEngine, open_torch_engine
from modelkiln.generation.engines.torch.ops import Kernels
from modelkiln.generation.sampling.device import DeviceSampler

RNG = np.random.default_rng(0)
PROMPTS = [RNG.integers(3, 400, int(n)).tolist() for n in (7, 2, 40, 1, 23, 130, 11, 64)]


def hf_greedy(model, prompt: list[int], steps: int) -> list[int]:
    """transformers' own forward, the whole sequence recomputed at every step: the reference."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def open_engine(folder, **options) -> TorchEngine:
    options = {"threads": 1, "max_rows": 4, **options}
    return open_torch_engine(folder / "model.torch-fp32.safetensors", ModelShape(4, 1024), EngineOptions(**options))


def tokenizer_of(folder):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(folder / "tokenizer.json"))


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def family(request, tmp_path_factory):
    """A tiny model of each family the engine covers, with its torch-fp32 weights beside it."""
    import transformers as tf

    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "mistral":
        make_tiny_mistral(folder)
    else:
        make_tiny_causal_lm(folder, request.param)
    model = tf.AutoModelForCausalLM.from_pretrained(folder).eval()
    if request.param == "qwen2":  # its q/k/v biases start at zero: give them values, so that they count
        torch.manual_seed(1)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith("bias"):
                    parameter.normal_(0, 0.5)
    save_weights(model, folder / "model.torch-fp32.safetensors", "fp32")
    return request.param, folder, model


def test_greedy_tokens_equal_transformers(family):
    """Chunked prefill (chunks of 8) and decode through the engine core give transformers' tokens;
    Mistral's window (12 positions) is crossed by every prompt and answer here."""
    name, folder, model = family
    core = EngineCore(open_engine(folder), tokenizer_of(folder), prefill_chunk=8)
    for i, prompt in enumerate(PROMPTS[:5]):
        prompt = prompt + [7] * 14 if name == "mistral" else prompt  # every prompt past the window
        got = complete(core, [Request(i, prompt, greedy(16))])[0].token_ids
        assert got == hf_greedy(model, prompt, 16), f"{name} prompt {i}"


def test_prompt_logits_close_to_transformers(family):
    name, folder, model = family
    core = EngineCore(open_engine(folder), tokenizer_of(folder), prefill_chunk=16)
    prompt = PROMPTS[5]
    with torch.inference_mode():
        expected = model(torch.tensor([prompt])).logits[0].numpy()
    np.testing.assert_allclose(prompt_logits(core, prompt), expected, atol=2e-4)


def test_the_core_takes_the_engines_prompt_chunk_unless_one_is_given(tiny_torch_artifact):
    """An engine built for bigger prompt steps (the torch engine on CUDA: GPU_PREFILL_CHUNK) says so
    in its capabilities; the core plans chunks of that size unless the server was told a size."""
    import dataclasses

    from modelkiln.generation.core import DEFAULT_PREFILL_CHUNK

    model = TextGenerationModel(tiny_torch_artifact)
    engine = model.core(None, CoreOptions(threads=1)).engine
    assert engine.capabilities.prefill_chunk is None  # on the CPU: the core's default
    assert EngineCore(engine, model.tokenizer).prefill_chunk == DEFAULT_PREFILL_CHUNK
    engine.capabilities = dataclasses.replace(engine.capabilities, prefill_chunk=2048)
    assert EngineCore(engine, model.tokenizer).prefill_chunk == 2048
    assert EngineCore(engine, model.tokenizer, prefill_chunk=64).prefill_chunk == 64
    prompt = list(range(5, 300))  # past the default chunk: one 2048-token budget takes it in one step
    core = EngineCore(engine, model.tokenizer)
    core.add_request(Request(0, prompt, greedy(2)))
    core.step()
    assert core.decoding == 1


@pytest.mark.parametrize("threads", [1, 2])
def test_answers_are_bit_identical_alone_and_among_others(tiny_torch_artifact, threads):
    """Every prompt alone, then all at once through 4 rows: prompts wait, join while others decode,
    are prefilled in chunks of 16 inside mixed steps, and leave; each answer's logits keep their bits."""
    model = TextGenerationModel(tiny_torch_artifact)
    core = model.core(None, CoreOptions(threads=threads, max_running=4, prefill_chunk=16, keep_logits=True))
    alone = [complete(core, [Request(i, p, greedy(12))])[0] for i, p in enumerate(PROMPTS)]
    together = complete(core, [Request(i, p, greedy(12 + i)) for i, p in enumerate(PROMPTS)])
    for i, (a, b) in enumerate(zip(alone, together)):
        assert b.token_ids[:12] == a.token_ids, f"prompt {i}"
        assert all(np.array_equal(x, y) for x, y in zip(a.logits, b.logits)), f"prompt {i}: other bits among others"
    assert core.engine.cache_tokens == 0 and sorted(core.engine._free) == list(range(4))


def test_the_gates_batch_check_passes(tiny_torch_artifact):
    model = TextGenerationModel(tiny_torch_artifact)
    core = model.core(None, CoreOptions(threads=1, max_running=4, prefill_chunk=16, keep_logits=True))
    gate = GatePrompts(PROMPTS, ["text"] * len(PROMPTS), [])
    alone = candidate_run(core, gate, 10, int(model.settings["vocab_size"]))
    try:
        invariance = check_batch_invariance(core, gate, alone, 10)
    finally:
        alone.logits.close()
    assert invariance.differing == [] and invariance.max_abs_diff == 0.0


def test_replays_in_padded_buckets_change_no_bit(tiny_torch_artifact):
    """The CUDA graphs' buckets, exercised eagerly on the CPU: a decode step of n rows runs at the
    next batch bucket (padding rows in the spare slot), and a step with prompt chunks at the next token
    bucket (padding tokens without a slot, padding selections), whatever its rows' lengths; answers
    keep their bits, greedy and sampled (a decode step graph chooses its rows' tokens itself). Prompts
    arrive while others decode, so steps mix chunks and decode rows."""
    model = TextGenerationModel(tiny_torch_artifact)
    plain = model.core(None, CoreOptions(threads=1, max_running=8, prefill_chunk=32, keep_logits=True))
    bucketed = model.core(None, CoreOptions(threads=1, max_running=8, prefill_chunk=32, keep_logits=True))
    graphs = bucketed.engine.graphs = StepGraphs(bucketed.engine, 32)
    graphs.capture()
    assert graphs.batches == [1, 2, 4, 8] and sorted(graphs.replays) == graphs.batches
    assert graphs.token_buckets == [32, 40] and sorted(graphs.step_replays) == graphs.token_buckets
    replayed, stepped = [], []
    run, run_step = graphs.run, graphs.run_step
    graphs.run = lambda ids, *rest: (replayed.append(len(ids)), run(ids, *rest))[1]
    graphs.run_step = lambda ids, *rest: (stepped.append(len(ids)), run_step(ids, *rest))[1]
    sampled = [SamplingParams(max_new_tokens=9, seed=50 + i, **SETTINGS[i]) for i in range(len(SETTINGS))]
    requests = [Request(i, p, greedy(9) if i % 2 == 0 else sampled[i]) for i, p in enumerate(PROMPTS[:6])]
    expected = [complete(plain, [r])[0] for r in requests]
    answers: dict = {r.request_id: ([], []) for r in requests}
    arrivals = {0: requests[:3], 6: requests[3:]}  # step: requests
    step = 0
    while step <= max(arrivals) or bucketed.has_work():
        for request in arrivals.get(step, []):
            bucketed.add_request(Request(request.request_id, request.prompt_ids, request.params))
        for output in bucketed.step():
            assert output.error is None
            answers[output.request_id][0].append(output.delta.token_id)
            answers[output.request_id][1].append(output.logits)
        step += 1
    assert {3, 5, 6} & set(replayed)  # decode steps whose row count is not a bucket ran padded
    assert stepped and set(stepped) - {32, 40}  # steps with prompt chunks ran, padded to a token bucket
    for a, request in zip(expected, requests):
        tokens, logits = answers[request.request_id]
        assert a.token_ids == tokens
        assert all(np.array_equal(x, y) for x, y in zip(a.logits, logits))


def test_chunking_changes_no_greedy_token(tiny_torch_artifact):
    model = TextGenerationModel(tiny_torch_artifact)
    by_chunk = {}
    for chunk in (4, 16, 128):
        core = model.core(None, CoreOptions(threads=1, prefill_chunk=chunk))
        by_chunk[chunk] = [complete(core, [Request(i, p, greedy(8))])[0].token_ids for i, p in enumerate(PROMPTS)]
        by_chunk[f"logits{chunk}"] = prompt_logits(core, PROMPTS[5])
    assert by_chunk[4] == by_chunk[16] == by_chunk[128]
    np.testing.assert_array_equal(by_chunk["logits4"], by_chunk["logits128"])  # a token's bits: not its chunk's


# --- sampling on the device --------------------------------------------------------------------------------


SETTINGS = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=5),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=0.9, top_k=40, top_p=0.9, repetition_penalty=1.3),
    dict(temperature=1.0, frequency_penalty=1.5, presence_penalty=-0.5, logit_bias=((3, 5.0), (9, -100.0))),
    dict(temperature=0.0, repetition_penalty=0.8, logit_bias=((11, 2.0),)),
    dict(temperature=2.0, top_k=1),
    dict(temperature=0.8, min_p=0.1),
    dict(temperature=1.2, top_k=50, top_p=0.95, min_p=0.05, presence_penalty=0.4),
]


def test_the_device_sampler_chooses_what_token_chooser_chooses():
    """The same logits, settings, seed and history give the same token on the device as on the host,
    row by row, with every setting at once in one call (and a grammar mask on some rows)."""
    vocab, rng = 300, np.random.default_rng(3)
    sampler = DeviceSampler(len(SETTINGS), vocab, torch.device("cpu"))
    choosers, histories = [], []
    for slot, settings in enumerate(SETTINGS):
        params = SamplingParams(max_new_tokens=50, seed=100 + slot, **settings)
        prompt, generated = rng.integers(0, vocab, 12).tolist(), rng.integers(0, vocab, 3).tolist()
        sampler.start(slot, params, 100 + slot, prompt + generated, generated)
        choosers.append(TokenChooser(params, 100 + slot, prompt + generated, generated))
        histories.append(generated)
    for step in range(40):
        logits = (rng.standard_normal((len(SETTINGS), vocab)) * 3).astype(np.float32)
        masks = [None] * len(SETTINGS)
        if step % 3 == 0:
            words = np.zeros(-(-vocab // 32), dtype=np.int32)
            words[:4] = -1  # tokens 0..127 allowed
            masks[1] = masks[4] = words
        choice = sampler.choose(list(range(len(SETTINGS))), torch.from_numpy(logits), masks)
        assert not choice.errors
        expected = [c.choose(logits[r], masks[r]) for r, c in enumerate(choosers)]
        assert choice.tokens == expected, f"step {step}"


def test_the_step_graphs_choice_is_the_samplers_row_by_row():
    """``graph_choice`` (what a decode step graph runs after its forward pass: every setting applied
    to every row, no branch on the rows' settings) gives each row the token ``choose`` gives it, step
    after step (penalties' state, positions), whatever else shares the step: greedy rows, rows of other
    settings, and the graph's padding rows in the spare slot."""
    vocab, rng = 300, np.random.default_rng(5)
    rows = len(SETTINGS)
    spare = rows
    samplers = [DeviceSampler(rows + 1, vocab, torch.device("cpu")) for _ in range(2)]
    for slot, settings in enumerate(SETTINGS):
        params = SamplingParams(max_new_tokens=50, seed=200 + slot, **settings)
        prompt, generated = rng.integers(0, vocab, 12).tolist(), rng.integers(0, vocab, 3).tolist()
        for sampler in samplers:
            sampler.start(slot, params, 200 + slot, prompt + generated, generated)
    by_choose, by_graph = samplers
    for step in range(40):
        logits = torch.from_numpy((rng.standard_normal((rows, vocab)) * 3).astype(np.float32))
        if step % 4 == 0:  # ties at the top
            logits[:, 7] = logits[:, 9] = logits.max() + 1
        slots = list(range(rows))
        expected = by_choose.choose(slots, logits, [None] * rows)
        padded = slots + [spare] * 3
        index = torch.tensor(padded)
        chosen = by_graph.graph_choice(index, torch.cat([logits, logits[:3]]),
                                       torch.from_numpy(by_graph.draws(padded)))[:, :rows]
        by_graph.commit(slots, index[:rows], chosen)
        got = by_graph.settle(slots, logits, chosen.numpy())
        assert not expected.errors and not got.errors
        assert got.tokens == expected.tokens, f"step {step}"


def test_sampling_errors_are_the_rows_own():
    sampler = DeviceSampler(2, 64, torch.device("cpu"))
    sampler.start(0, SamplingParams(temperature=1.0, seed=1), 1, [], [])
    sampler.start(1, SamplingParams(seed=2), 2, [], [])
    nothing = np.zeros(2, dtype=np.int32)  # a grammar that allows no token
    choice = sampler.choose([0, 1], torch.zeros(2, 64), [None, nothing])
    assert list(choice.errors) == [1] and isinstance(choice.errors[1], InvalidInputError)
    assert 0 <= choice.tokens[0] < 64


@pytest.fixture(scope="module")
def torch_core(tiny_torch_artifact):
    model = TextGenerationModel(tiny_torch_artifact)
    return model.core(None, CoreOptions(threads=1, max_running=4, prefill_chunk=8, keep_logits=True))


def ids_of(core, text):
    return core.tokenizer.encode(text).ids


def test_seeded_sampling_is_reproducible_alone_or_in_a_batch_and_resumes_exactly(torch_core):
    ids = ids_of(torch_core, "The quick brown fox")
    params = SamplingParams(max_new_tokens=16, temperature=0.9, top_p=0.95, frequency_penalty=0.5, seed=11,
                            ignore_eos=True)
    whole = list(run_to_completion(torch_core, [Request("w", ids, params)]))
    tokens = [o.delta.token_id for o in whole]
    crowd = complete(torch_core, [Request("x", ids_of(torch_core, "Hello"), SamplingParams(max_new_tokens=20, temperature=1.0, seed=3, ignore_eos=True)),
                                  Request("w", ids, params)])[1]
    assert crowd.token_ids == tokens
    logits = [o.logits for o in whole]
    assert logits[0] is not None
    for cut in (1, 7, 15):  # the tokens sent go through decode steps, as the first run computed them
        rest = complete(torch_core, [Request("r", ids, params, resume_ids=tokens[:cut], seed=11)])[0]
        assert rest.token_ids == tokens[cut:]
        assert all(np.array_equal(a, b) for a, b in zip(rest.logits, logits[cut:])), cut


def test_logprobs_are_the_models_own(torch_core):
    params = SamplingParams(max_new_tokens=6, temperature=0.8, seed=3, logprobs=3, ignore_eos=True)
    outputs = list(run_to_completion(torch_core, [Request("r", ids_of(torch_core, "The quick brown fox"), params)]))
    assert len(outputs) == 6
    for output in outputs:
        expected = log_softmax(output.logits)
        assert output.delta.logprob == pytest.approx(expected[output.delta.token_id], abs=1e-9)
        assert [t for t, _ in output.delta.top_logprobs] == np.argsort(-expected, kind="stable")[:3].tolist()


def test_a_constrained_answer_is_closed_on_the_device_too(torch_core, tiny_torch_artifact):
    """The closing path's single-token masks go through the device sampler as any mask: an answer
    biased to write "a" forever is closed near max_tokens, parses and ends with "stop", alone or
    among other rows."""
    import json

    from modelkiln.generation.structured_output.grammars import Grammars, compile_constraint
    from modelkiln.generation.structured_output.vocabulary import Vocabulary

    model = TextGenerationModel(tiny_torch_artifact)
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {
        "type": "string"}, "minItems": 1}}, "required": ["name", "tags"]}
    grammar = compile_constraint("json_schema", {"schema": schema, "strict": True},
                                 Grammars(Vocabulary(model.tokenizer, model.eos_ids)))
    ids = ids_of(torch_core, "The quick brown fox")
    rambling = ((model.tokenizer.token_to_id("a"), 100.0),)  # a string that never ends by itself
    for extra in ({}, dict(temperature=1.0, seed=3)):
        params = SamplingParams(max_new_tokens=grammar.shortest_answer + 20, constraint=grammar, logit_bias=rambling,
                                **extra)
        alone = complete(torch_core, [Request("g", ids, params)])[0]
        crowd = complete(torch_core, [Request("x", ids, SamplingParams(max_new_tokens=30, ignore_eos=True)),
                                      Request("g", ids, params)])[1]
        assert alone.finish_reason == "stop" and set(json.loads(alone.text)) == {"name", "tags"}
        assert crowd.token_ids == alone.token_ids


def test_a_prompt_too_long_for_the_rows_fails_alone(tiny_torch_artifact):
    model = TextGenerationModel(tiny_torch_artifact)
    core = model.core(None, CoreOptions(threads=1, max_running=4))
    engine = core.engine
    too_long = Request("long", [5] * (engine.max_length + 10), greedy(2), reserve=1)
    fine = Request("ok", PROMPTS[0], greedy(3))
    outputs = list(run_to_completion(core, [too_long, fine]))
    errors = [o for o in outputs if o.error is not None]
    assert [o.request_id for o in errors] == ["long"] and isinstance(errors[0].error, InvalidInputError)
    assert len([o for o in outputs if o.request_id == "ok"]) == 3
    assert engine.cache_tokens == 0 and len(engine._free) == 4


def test_prompts_seen_before_come_from_the_prefix_cache_and_change_no_bit(tiny_torch_artifact):
    """A prompt that starts with a cached one is prefilled after the cached blocks; one seen whole
    computes nothing for its first token (its last logits were kept); every answer and every
    token's logits are the bits a cold engine gives, greedy and sampled."""
    model = TextGenerationModel(tiny_torch_artifact)

    def open_core(prefix_tokens: int) -> EngineCore:
        return model.core(None, CoreOptions(threads=1, max_running=4, prefill_chunk=8, keep_logits=True,
                                            prefix_cache_tokens=prefix_tokens))

    cold, warm = open_core(0), open_core(4096)
    assert warm.engine.capabilities.prefix_cache and not cold.engine.capabilities.prefix_cache
    computed: list[int] = []  # the tokens each forward pass of the warm engine computes
    forward = warm.engine.decoder.forward
    warm.engine.decoder.forward = lambda step, cache: computed.append(step.ids.shape[0]) or forward(step, cache)
    prompt = PROMPTS[2][:20]
    longer = prompt + PROMPTS[0][:5]
    sampled = SamplingParams(max_new_tokens=6, temperature=0.9, top_p=0.95, seed=5, ignore_eos=True)
    for ids, params, cached, prompt_computed in [(prompt, greedy(6), 0, 20), (prompt, greedy(6), 20, 0),
                                                 (prompt, sampled, 20, 0), (longer, sampled, 16, 9)]:
        assert warm.engine.cached_prefix(ids) == cached
        computed.clear()
        expected = complete(cold, [Request("r", ids, params)])[0]
        answer = complete(warm, [Request("r", ids, params)])[0]
        assert answer.token_ids == expected.token_ids
        assert all(np.array_equal(a, b) for a, b in zip(answer.logits, expected.logits))
        assert sum(computed) == prompt_computed + len(answer.token_ids) - 1  # then one token a decode step
    assert warm.engine.prefix_tokens > 0 and warm.engine.evict_prefixes(10**6) > 0 and warm.engine.prefix_tokens == 0


def test_capabilities_and_kv_accounting(tiny_torch_artifact):
    model = TextGenerationModel(tiny_torch_artifact)
    engine = model.engine(None, EngineOptions(threads=1, max_rows=3))
    assert engine.capabilities.mixed_steps and not engine.capabilities.prefix_cache
    assert engine.capabilities.device == "cpu" and engine.capabilities.max_rows == 3
    assert engine.kv_tokens_needed([10, 20]) == 30  # the CPU commits what a sequence writes
    assert engine.cached_prefix([1, 2, 3]) == 0 and engine.max_length % 128 == 0
    assert 0 < engine.kv_capacity() <= 3 * engine.max_length


def test_invariant_products_give_every_row_the_bits_it_has_alone():
    """The matrix products themselves (the other kernels: tests/generation/engines/torch/test_kernels.py):
    a row's bits do not change with its neighbours or the row count, with and without a bias, in
    one call padded to the floor this machine's library showed (or tiles where none)."""
    rng = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 64, generator=rng), torch.randn(96, generator=rng)
    x = torch.randn(40, 64, generator=rng)
    for calibrated in (False, True):
        kernels = Kernels(torch.device("cpu"), invariant=True)
        if calibrated:
            kernels.calibrate([(weight, None), (weight, bias)])
            assert "one call" in kernels.describe() or "tiles" in kernels.describe()
        for b in (None, bias):
            alone = kernels.linear(x[:1], weight, b)
            for rows in (2, 3, 5, 16, 17, 40):
                assert torch.equal(kernels.linear(x[:rows], weight, b)[0], alone[0])
                assert kernels.rows(rows) >= rows
