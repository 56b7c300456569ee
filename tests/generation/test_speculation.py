"""Speculative decoding (generation/speculation/): the n-gram drafter's proposals, the policy's
choice of how many tokens to draft and its acceptance accounting, and, on the tiny Llama's
KilnAttention serving graph, answers with speculation equal to plain decoding's token for token
and logit for logit: greedy and seeded sampled, with penalties, logit bias, stop strings and
end-of-sequence, one stream and several, with the n-gram drafter and with a drafter that knows the
answer but makes mistakes on purpose (so every acceptance length is verified)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from modelkiln.generation.core import CoreHooks, EngineCore, Request, complete
from modelkiln.generation.engines.registry import EngineOptions
from modelkiln.generation.model import TextGenerationModel
from modelkiln.generation.sampling import SamplingParams
from modelkiln.generation.speculation import CallCosts, NgramDrafter, SpeculationOptions, Speculator
from modelkiln.generation.speculation.drafters import MAX_NGRAM, MIN_NGRAM
from modelkiln.generation.speculation.policy import COST_WEIGHT, PRIOR, VERIFY_TOKEN_COST, best_length, expected_tokens
from modelkiln.native import library_path

PROMPTS = ["The quick brown fox jumps over the lazy dog. The quick brown fox",
           "one two three four one two three four one two",
           "Hello there, how are you today?",
           "a b c d e f g a b c d e f g a b",
           "Repeat after me: the cat sat on the mat. Repeat after me:",
           "x"]
PARAMS = {"greedy": SamplingParams(max_new_tokens=24, ignore_eos=True),
          "sampled, penalties": SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.95, seed=17,
                                               repetition_penalty=1.1, frequency_penalty=0.3, presence_penalty=0.2,
                                               logit_bias=((5, 2.0),), ignore_eos=True),
          "greedy, end of sequence": SamplingParams(max_new_tokens=24, logit_bias=((2, 2.0),))}


# -- the drafter and the policy --------------------------------------------------------------------


def test_the_ngram_drafter_proposes_what_followed_the_longest_latest_match():
    assert (MIN_NGRAM, MAX_NGRAM) == (1, 3)
    drafter = NgramDrafter([1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 7])  # n-grams of 3 down to 1 token
    drafter.extend([2, 3, 4])  # the suffix (2, 3, 4) occurred twice: the latest one was followed by 6, 7
    assert drafter.propose(3) == [6, 7, 2]
    assert drafter.propose(1) == [6]
    drafter.extend([5])  # (3, 4, 5) occurred once, at the start; the longest match wins over (4, 5)
    assert drafter.propose(4) == [9, 2, 3, 4]
    drafter.extend([8])  # (5, 8) never occurred, and one token alone is not a match
    assert drafter.propose(4) == []
    assert NgramDrafter([]).propose(3) == [] and NgramDrafter([7]).propose(3) == []
    assert NgramDrafter([7, 7]).propose(3) == [7, 7, 7]  # a repeating stretch: its next period
    assert NgramDrafter([4, 5, 6, 4]).propose(2) == [5, 6]  # one token is a match (MIN_NGRAM 1)...
    assert NgramDrafter([4, 5, 6, 4], min_n=2).propose(2) == []  # ...unless told otherwise
    assert NgramDrafter([5, 1, 2, 3, 1, 2]).propose(5) == [3, 1, 2, 3, 1]  # the copy runs on into itself


def test_the_policy_drafts_more_where_more_is_accepted_and_less_among_more_rows():
    assert expected_tokens(0.5, 2) == 1.75 and expected_tokens(0.0, 5) == 1.0
    assert best_length(0.05, 8, rows=1) == 0
    assert 0 < best_length(0.5, 8, rows=1) < best_length(0.9, 8, rows=1) <= 8
    assert best_length(0.99, 16, rows=1) >= 12
    assert best_length(0.6, 8, rows=4) <= best_length(0.6, 8, rows=1)
    cheap_to_three = {0: 1.0, 1: 1.05, 2: 1.1}  # then each token as dear as a whole call
    assert best_length(0.6, 8, rows=1, cost=lambda k: cheap_to_three.get(k, float(k))) == 2


def test_call_costs_are_measured_per_size_and_estimated_between():
    costs = CallCosts()
    assert costs.estimate(1) == 1.0 and costs.estimate(3) == pytest.approx(1 + 2 * VERIFY_TOKEN_COST)
    costs.record(1, 0.010)
    costs.record(4, 0.016)
    assert costs.estimate(1) == 0.010 and costs.estimate(4) == 0.016
    assert costs.estimate(2) == pytest.approx(0.010 * (1 + VERIFY_TOKEN_COST))  # from the nearest size below
    assert costs.relative(1)(3) == pytest.approx(1.6)
    costs.record(4, 1.0)  # another process had the cores: counts as twice the estimate at most
    assert costs.estimate(4) == pytest.approx(0.016 + COST_WEIGHT * 0.016)


def test_acceptance_counts_the_refused_token_and_unverified_guesses():
    fresh = Speculator(NgramDrafter([]), max_draft=4)
    assert fresh.acceptance == PRIOR[0] / PRIOR[1]
    fresh.verified(4, 4)
    fresh.verified(4, 1)  # 1 accepted, the 2nd refused: 2 tried
    assert fresh.acceptance == pytest.approx((PRIOR[0] * 0.81 + 4 * 0.9 + 1) / (PRIOR[1] * 0.81 + 4 * 0.9 + 2))

    speculator = Speculator(NgramDrafter([1, 2, 3, 1, 2]), max_draft=4)
    assert speculator.draft([], limit=4, rows=1) == [3, 1]  # acceptance 1/2: two tokens pay best
    assert speculator.draft([], limit=1, rows=1) == [3]
    for _ in range(20):
        speculator.verified(4, 0)  # every first drafted token refused
    assert speculator.acceptance < 0.05 and speculator.draft([], limit=4, rows=1) == []  # not worth verifying
    answer: list[int] = []
    for steps, token in enumerate([3, 1, 2] * 10):  # the guesses not verified come true: drafting resumes
        answer.append(token)
        if speculator.draft(answer, limit=4, rows=1):
            break
    assert 0 < steps < 20


# -- answers on the KilnAttention graph ----------------------------------------------------------------

needs_native = pytest.mark.skipif(library_path() is None, reason="the native library is not built on this machine")


@pytest.fixture(scope="module")
def tiny(tiny_generation_artifact):
    return TextGenerationModel(tiny_generation_artifact)


class Counted(CoreHooks):
    def __init__(self):
        self.drafts = self.drafted = self.accepted = 0

    def speculated(self, request, drafted, accepted):
        self.drafts, self.drafted, self.accepted = self.drafts + 1, self.drafted + drafted, self.accepted + accepted


class Oracle(Speculator):
    """Drafts the plain answer's next tokens, with every third drafted token wrong: acceptance of
    every length, and refusals, all verified."""

    def __init__(self, answer: list[int], max_draft: int):
        super().__init__(NgramDrafter([]), max_draft)
        self.answer = answer

    def draft(self, answer, limit, rows, cost=None):
        at = len(answer)
        proposal = self.answer[at:at + min(limit, self.max_draft)]
        return [t + 1 if (at + i) % 3 == 2 else t for i, t in enumerate(proposal)]


def with_oracle(core: EngineCore, answers: list[list[int]]) -> None:
    """Each request (named (name, prompt index)) drafted for by an ``Oracle`` of that prompt's plain answer."""
    admit = core._admit

    def admitting(outputs):
        admitted = admit(outputs)
        for request in admitted:
            request.speculator = Oracle(answers[request.request_id[1]], 5)
        return admitted

    core._admit = admitting  # type: ignore[method-assign]


def core_for(tiny, graph, speculation: str = "ngram", draft_tokens: int = 4) -> tuple[EngineCore, Counted]:
    engine = tiny.engine_for_file(graph, EngineOptions(threads=2, max_rows=8, keep_logits=True))
    assert engine.capabilities.verifies_drafts
    hooks = Counted()
    return EngineCore(engine, tiny.tokenizer, tiny.eos_ids, hooks=hooks,
                      speculation=SpeculationOptions(speculation, draft_tokens)), hooks


def requests(core: EngineCore, name: str, params: SamplingParams, stops: dict | None = None) -> list[Request]:
    out = []
    for i, text in enumerate(PROMPTS):
        p = params if stops is None else dataclasses.replace(params, stop=stops[i])
        out.append(Request((name, i), core.tokenizer.encode(text).ids, p))
    return out


def in_pairs(core: EngineCore, batch: list[Request]) -> list:
    return [answer for i in range(0, len(batch), 2) for answer in complete(core, batch[i:i + 2])]


def same(a, b) -> bool:
    return (a.token_ids == b.token_ids and a.text == b.text and a.finish_reason == b.finish_reason
            and all(np.array_equal(x, y) for x, y in zip(a.logits, b.logits)))


@needs_native
@pytest.mark.parametrize("kind", list(PARAMS))
def test_answers_with_speculation_are_plain_decodings(tiny, tiny_kiln_attention_graph, kind):
    """For each prompt: plain, then with ngram one stream at a time, three at a time, all six at
    once (no drafts while more than 2 decode), and with the oracle drafter (two at a time); and all again with a
    stop string taken from the middle of the plain answer: 6 prompts x 4 x 2 answers compared,
    tokens, text, finish reason and every logit."""
    params = PARAMS[kind]
    plain_core, _ = core_for(tiny, tiny_kiln_attention_graph, "off")
    plain = complete(plain_core, requests(plain_core, "plain", params))
    stops = {i: (a.text[len(a.text) // 2:][:3],) if len(a.text) > 6 else () for i, a in enumerate(plain)}
    plain_stopped = complete(plain_core, requests(plain_core, "plain-stop", params, stops))
    assert any(a.finish_reason == "stop" and len(a.token_ids) < 24 for a in plain_stopped)
    ngram, counted = core_for(tiny, tiny_kiln_attention_graph)
    for reference, stop in ((plain, None), (plain_stopped, stops)):
        batch = requests(ngram, "each", params, stop)
        alone = [complete(ngram, [r])[0] for r in batch]
        together = in_pairs(ngram, requests(ngram, "pairs", params, stop))  # 2 rows: each may draft
        crowd = complete(ngram, requests(ngram, "crowd", params, stop))  # 6 rows: drafting once 2 are left
        assert all(same(a, b) for a, b in zip(alone, reference)), kind
        assert all(same(a, b) for a, b in zip(together, reference)), kind
        assert all(same(a, b) for a, b in zip(crowd, reference)), kind
        oracle_core, oracled = core_for(tiny, tiny_kiln_attention_graph, draft_tokens=5)
        with_oracle(oracle_core, [a.token_ids for a in plain])
        oracled_answers = in_pairs(oracle_core, requests(oracle_core, "oracle", params, stop))
        assert all(same(a, b) for a, b in zip(oracled_answers, reference)), kind
        assert oracled.drafts > 0 and 0 < oracled.accepted < oracled.drafted
    if params.greedy:  # the random model's greedy answers repeat themselves: drafted from, and accepted
        assert counted.drafts > 0 and counted.accepted > 0


@needs_native
def test_no_speculation_where_the_engine_cannot_verify(tiny):
    """A GroupQueryAttention graph: the option is ignored, the answer is plain decoding's."""
    engine = tiny.engine("fp32", EngineOptions(threads=1))
    assert not engine.capabilities.verifies_drafts
    core = EngineCore(engine, tiny.tokenizer, speculation=SpeculationOptions("ngram", 4))
    assert not core.speculation.on


@needs_native
@pytest.mark.parametrize("kind", ["greedy", "sampled, penalties"])
def test_a_resumed_request_speculates_and_still_continues_exactly(tiny, tiny_kiln_attention_graph, kind):
    """Resumed (its sent tokens prefilled in chunks) with speculation on: the drafter starts from
    prompt + sent tokens, and the rest is the uninterrupted plain answer."""
    params = PARAMS[kind]
    plain_core, _ = core_for(tiny, tiny_kiln_attention_graph, "off")
    ids = plain_core.tokenizer.encode(PROMPTS[1]).ids
    whole = complete(plain_core, [Request("whole", ids, params)])[0]
    core, counted = core_for(tiny, tiny_kiln_attention_graph)
    for cut in (1, 6, 20):
        rest = complete(core, [Request(("rest", cut), ids, params, resume_ids=whole.token_ids[:cut])])[0]
        assert rest.token_ids == whole.token_ids[cut:] and rest.finish_reason == whole.finish_reason, cut
        assert all(np.array_equal(a, b) for a, b in zip(rest.logits, whole.logits[cut:])), cut
