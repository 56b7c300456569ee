"""What every generation engine must do alike, written once and run on each: the serving graph's
(ONNX Runtime) and the torch engine, each through the engine core on the same tiny Llama."""

from __future__ import annotations

import numpy as np
import pytest

from modelkiln.generation.core import EngineCore, Request, complete, greedy, prompt_logits, run_to_completion
from modelkiln.generation.engines.registry import EngineOptions
from modelkiln.generation.model import CoreOptions, TextGenerationModel
from modelkiln.generation.sampling import SamplingParams, log_softmax


@pytest.fixture(scope="module", params=["serving-graph", "torch"])
def engine_core(request, tiny_generation_artifact, tiny_torch_artifact):
    """A core on each engine, prompts prefilled in small chunks (4 and 8 tokens)."""
    if request.param == "torch":
        model = TextGenerationModel(tiny_torch_artifact)
        return model.core(None, CoreOptions(threads=1, max_running=4, prefill_chunk=8, keep_logits=True))
    model = TextGenerationModel(tiny_generation_artifact)
    return EngineCore(model.engine("fp32", EngineOptions(threads=1, prefix_cache_tokens=4096)), model.tokenizer,
                      prefill_chunk=4)


def ids_of(core, text):
    return core.tokenizer.encode(text).ids


def test_prompt_logprobs_score_every_prompt_token_across_chunks(engine_core):
    """prompt_logprobs (completions' echo): each prompt token after the first gets its log-probability
    given the tokens before it, equal to the full-prompt logits'; a prompt already in the prefix cache
    is still computed when it is scored."""
    ids = ids_of(engine_core, "Once upon a time there was a little fox")
    assert len(ids) > 8
    complete(engine_core, [Request("warm", ids, greedy(2))])
    first = next(o for o in run_to_completion(engine_core, [Request("r", ids, greedy(1, prompt_logprobs=2))]))
    scored = first.delta.prompt_logprobs
    assert scored[0] is None and len(scored) == len(ids)
    expected = log_softmax(prompt_logits(engine_core, ids))
    for position, (logprob, top) in enumerate(scored[1:]):
        assert logprob == pytest.approx(expected[position, ids[position + 1]], abs=1e-6)
        assert len(top) == 2 and top[0][1] >= top[1][1]


def test_penalties_and_logit_bias_steer_the_choice(engine_core):
    """OpenAI's semantics, applied in the engine: a +100 bias forces a token; presence and frequency
    penalties make repeats rarer than without them (greedy)."""
    ids = ids_of(engine_core, "The quick brown fox")
    forced = complete(engine_core, [Request("a", ids, SamplingParams(max_new_tokens=5, ignore_eos=True,
                                                                       logit_bias=((42, 100.0),)))])[0]
    assert forced.token_ids == [42] * 5
    plain = complete(engine_core, [Request("b", ids, SamplingParams(max_new_tokens=40, ignore_eos=True))])[0].token_ids
    spread = complete(engine_core, [Request("c", ids, SamplingParams(max_new_tokens=40, ignore_eos=True,
                                                                       presence_penalty=2.0,
                                                                       frequency_penalty=2.0))])[0].token_ids
    assert len(set(spread)) > len(set(plain))


class _OnlyTokens:
    """A stand-in grammar: every token must be one of ``allowed``, and the answer ends after ``length``."""

    shortest_answer = 0

    def __init__(self, allowed, length):
        self.allowed, self.length = allowed, length

    def matcher(self):
        grammar = self

        class Matcher:
            taken = 0

            def closing_path(self, limit):
                return None  # never closed early: it ends after ``length`` tokens anyway

            def fill_bitmask(self, words):
                for token in grammar.allowed:
                    words[token >> 5] |= np.int32(1 << (token & 31)) if (token & 31) < 31 else np.int32(-(1 << 31))

            def accept(self, token):
                self.taken += 1
                return token in grammar.allowed

            def is_terminated(self):
                return self.taken >= grammar.length

        return Matcher()


def test_a_grammars_mask_is_applied_where_the_token_is_chosen(engine_core):
    """Every token comes from the grammar's bitmask (computed while the model runs; on the torch engine
    applied on the device), sampled or not, alone or among unconstrained streams; the answer ends when
    the grammar says so."""
    grammar = _OnlyTokens({3, 63, 64, 200}, length=7)
    ids = ids_of(engine_core, "The quick brown fox")
    for extra in ({}, dict(temperature=1.0, seed=5)):
        params = SamplingParams(max_new_tokens=30, ignore_eos=True, constraint=grammar, **extra)
        alone = complete(engine_core, [Request("g", ids, params)])[0]
        crowd = complete(engine_core, [Request("x", ids, SamplingParams(max_new_tokens=20, ignore_eos=True)),
                                       Request("g", ids, params)])[1]
        assert set(alone.token_ids) <= grammar.allowed and len(alone.token_ids) == 7
        assert alone.finish_reason == "stop" and crowd.token_ids == alone.token_ids
