"""The engine core over a KilnAttention serving graph (the tiny Llama's, fp32; its KV cache of floats
and of halves), where a position's logits are the same bits in a decode step and in a prompt chunk:
a resumed request prefills the tokens it had sent in chunks and still gives the uninterrupted
answer, bit for bit, in fewer engine steps."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from modelkiln.generation.core import EngineCore, Request, complete
from modelkiln.generation.engines.registry import EngineOptions
from modelkiln.generation.model import TextGenerationModel
from modelkiln.generation.sampling import SamplingParams
from modelkiln.native import library_path

pytestmark = pytest.mark.skipif(library_path() is None, reason="the native library is not built on this machine")

PROMPT = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 3, 9]
SAMPLED = dict(temperature=0.9, top_p=0.95, repetition_penalty=1.2, frequency_penalty=0.5, seed=5)


@pytest.fixture(scope="module")
def tiny(tiny_generation_artifact):
    return TextGenerationModel(tiny_generation_artifact)


@pytest.fixture(scope="module", params=["f32", "f16"])
def graph(request, tiny_kiln_attention_graph, tiny_kiln_attention_graph_f16):
    return tiny_kiln_attention_graph_f16 if request.param == "f16" else tiny_kiln_attention_graph


def kiln_core(tiny, graph, prefix_cache_tokens: int = 0, **core) -> EngineCore:
    engine = tiny.engine_for_file(graph, EngineOptions(threads=2, max_rows=8, keep_logits=True))
    engine.use_prefix_cache(prefix_cache_tokens)
    assert engine.capabilities.prefill_is_decode
    return EngineCore(engine, tiny.tokenizer, **core)


def count_steps(engine) -> list[int]:
    """Counts the engine's calls that decode running rows (a list of one number, so the caller sees it grow)."""
    steps = [0]
    decode_tokens = engine._decode_tokens

    def counted(call, fed):
        steps[0] += bool(fed)
        return decode_tokens(call, fed)
    engine._decode_tokens = counted
    return steps


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("prefill_chunk", [4, 128])
def test_a_resumed_request_prefills_what_it_sent_and_continues_bit_for_bit(tiny, graph,
                                                                         sampled, prefill_chunk):
    """Every cut: the rest of the answer, its text and every logit equal the uninterrupted run's;
    the sent tokens cost no decode step (only the last one is fed, as the next step's input),
    where replaying them one by one (the capability off) took one step each."""
    core = kiln_core(tiny, graph, prefill_chunk=prefill_chunk)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True, **(SAMPLED if sampled else {}))
    whole = complete(core, [Request("w", PROMPT, params)])[0]
    steps = count_steps(core.engine)
    for cut in (1, 2, 7, 15):
        steps[0] = 0
        rest = complete(core, [Request(("r", cut), PROMPT, params, resume_ids=whole.token_ids[:cut])])[0]
        assert rest.token_ids == whole.token_ids[cut:] and rest.finish_reason == whole.finish_reason
        assert all(np.array_equal(a, b) for a, b in zip(rest.logits, whole.logits[cut:])), cut
        assert steps[0] == 16 - cut  # one a token still to choose
    core.engine.capabilities = dataclasses.replace(core.engine.capabilities, prefill_is_decode=False)
    steps[0] = 0
    replayed = complete(core, [Request("old", PROMPT, params, resume_ids=whole.token_ids[:7])])[0]
    assert replayed.token_ids == whole.token_ids[7:] and steps[0] == 15  # one a token, sent or not


def test_a_resumed_request_after_a_cached_prompt(tiny, graph):
    """The prompt restored whole from the prefix cache, the sent tokens prefilled after it (or, for
    one sent token, nothing prefilled at all): still the uninterrupted answer."""
    core = kiln_core(tiny, graph, prefix_cache_tokens=1024)
    params = SamplingParams(max_new_tokens=10, ignore_eos=True, **SAMPLED)
    whole = complete(core, [Request("w", PROMPT, params)])[0]
    for cut in (1, 5):
        rest = complete(core, [Request(("r", cut), PROMPT, params, resume_ids=whole.token_ids[:cut])])[0]
        assert rest.token_ids == whole.token_ids[cut:], cut
        assert all(np.array_equal(a, b) for a, b in zip(rest.logits, whole.logits[cut:])), cut
    assert core.engine.prefixes.hit_tokens >= 2 * len(PROMPT)


def test_a_step_is_one_call_and_arrivals_change_no_answer(tiny, graph):
    """Prompt chunks (4 tokens a step), decode rows and prompts arriving while others decode run as
    one call a step; every answer's tokens and logits are those it gets alone."""
    prompts = [PROMPT, PROMPT[5:] + [7, 8, 9], list(range(60, 75))]
    params = [SamplingParams(max_new_tokens=8, ignore_eos=True, **SAMPLED), SamplingParams(max_new_tokens=8, ignore_eos=True)]
    requests = [lambda i=i: Request(i, prompts[i], params[i % 2]) for i in range(len(prompts))]
    alone = [complete(kiln_core(tiny, graph, prefill_chunk=4), [make()])[0] for make in requests]
    core = kiln_core(tiny, graph, prefill_chunk=4)
    assert core.engine.capabilities.mixed_steps
    session, calls = core.engine.session, []
    run = session.run_with_iobinding
    session.run_with_iobinding = lambda binding: (calls.append(1), run(binding))[1]
    tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    logits: dict[int, list[np.ndarray]] = {i: [] for i in range(len(prompts))}
    arrivals = {0: 0, 3: 1, 6: 2}  # step: request
    step, mixed = 0, 0
    while step in arrivals or step < max(arrivals) or core.has_work():
        if step in arrivals:
            core.add_request(requests[arrivals[step]]())
        prefilling, decoding = bool(core._prefilling), core.decoding > 0
        before = len(calls)
        for output in core.step():
            assert output.error is None
            tokens[output.request_id].append(output.delta.token_id)
            logits[output.request_id].append(output.logits)
        assert len(calls) - before <= 1, step
        mixed += prefilling and decoding
        step += 1
    assert mixed >= 4  # steps that held prompt chunks and decode rows together
    for i, answer in enumerate(alone):
        assert tokens[i] == answer.token_ids, i
        assert all(np.array_equal(a, b) for a, b in zip(logits[i], answer.logits)), i
