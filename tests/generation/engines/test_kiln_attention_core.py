"""The engine core over a KilnAttention serving graph (the tiny Llama's, fp32), where a position's
logits are the same bits in a decode step and in a prompt chunk: a resumed request prefills the
tokens it had sent in chunks and still gives the uninterrupted answer, bit for bit, in fewer
engine steps."""

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


def kiln_core(tiny, graph, prefix_cache_tokens: int = 0, **core) -> EngineCore:
    engine = tiny.engine_for_file(graph, EngineOptions(threads=2, max_rows=8, keep_logits=True))
    engine.use_prefix_cache(prefix_cache_tokens)
    assert engine.capabilities.prefill_is_decode
    return EngineCore(engine, tiny.tokenizer, **core)


def count_steps(engine) -> list[int]:
    """Counts the engine's decode steps (a list of one number, so the caller sees it grow)."""
    steps = [0]
    step = engine.step
    engine.step = lambda *a, **k: (steps.__setitem__(0, steps[0] + 1), step(*a, **k))[1]
    return steps


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("prefill_chunk", [4, 128])
def test_a_resumed_request_prefills_what_it_sent_and_continues_bit_for_bit(tiny, tiny_kiln_attention_graph,
                                                                         sampled, prefill_chunk):
    """Every cut: the rest of the answer, its text and every logit equal the uninterrupted run's;
    the sent tokens cost no decode step (only the last one is fed, as the next step's input),
    where replaying them one by one (the capability off) took one step each."""
    core = kiln_core(tiny, tiny_kiln_attention_graph, prefill_chunk=prefill_chunk)
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


def test_a_resumed_request_after_a_cached_prompt(tiny, tiny_kiln_attention_graph):
    """The prompt restored whole from the prefix cache, the sent tokens prefilled after it (or, for
    one sent token, nothing prefilled at all): still the uninterrupted answer."""
    core = kiln_core(tiny, tiny_kiln_attention_graph, prefix_cache_tokens=1024)
    params = SamplingParams(max_new_tokens=10, ignore_eos=True, **SAMPLED)
    whole = complete(core, [Request("w", PROMPT, params)])[0]
    for cut in (1, 5):
        rest = complete(core, [Request(("r", cut), PROMPT, params, resume_ids=whole.token_ids[:cut])])[0]
        assert rest.token_ids == whole.token_ids[cut:], cut
        assert all(np.array_equal(a, b) for a, b in zip(rest.logits, whole.logits[cut:])), cut
    assert core.engine.prefixes.hit_tokens >= 2 * len(PROMPT)
