"""The bounded draw (``native/sampling_bounded.c``): its own exponentials, and for every row, setting
and uniform either the whole-vocabulary rule's token or a refusal, never another token."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from modelkiln.generation.sampling import SamplingParams
from modelkiln.generation.sampling.selection import (bounded_draw, bounded_draws, reference_draw,
                                                     reference_probabilities)
from modelkiln.native import sampling_library

DECLINED = -1


@pytest.fixture(scope="module")
def library() -> ctypes.CDLL:
    library = sampling_library()
    if library is None:
        pytest.skip("the native sampling library was not built here")
    return library


def test_its_exponentials_are_within_the_budget_the_margins_assume(library):
    """The file's error budget gives its exp 5e-13 of relative error (the rest of 1e-12 goes to the
    scaling); exp(0) is exactly 1 (the best token's, which min-p compares against); below -708, 0."""
    rng = np.random.default_rng(3)
    s = -np.concatenate([rng.uniform(0, 708, 100_000), rng.uniform(0, 1, 100_000), [0.0, 1e-300, 708.0]])
    out = np.empty_like(s)
    f64 = ctypes.POINTER(ctypes.c_double)
    library.kiln_bounded_exp(s.ctypes.data_as(f64), s.shape[0], out.ctypes.data_as(f64))
    exact = np.exp(s)
    assert np.max(np.abs(out - exact) / exact) < 5e-13
    assert out[-3] == 1.0
    below = np.array([-708.5, -745.0, -np.inf])
    library.kiln_bounded_exp(below.ctypes.data_as(f64), 3, out.ctypes.data_as(f64))
    assert list(out[:3]) == [0.0, 0.0, 0.0]


def test_its_float32_exponentials_are_within_their_budget(library):
    """The float32 pass's exp, for float32 inputs, against numpy's float64 exp: under 4e-7 relative
    (EXP32_ERROR is 1e-6); exp(0) is 1; below -87, 0."""
    rng = np.random.default_rng(4)
    s = -np.concatenate([rng.uniform(0, 87, 100_000), rng.uniform(0, 1, 100_000), [0.0, 1e-30, 87.0, 86.9]])
    s = np.concatenate([s, np.zeros(-s.shape[0] % 16)]).astype(np.float32)
    out = np.empty_like(s)
    f32 = ctypes.POINTER(ctypes.c_float)
    library.kiln_bounded_exp32(s.ctypes.data_as(f32), s.shape[0], out.ctypes.data_as(f32))
    exact = np.exp(s.astype(np.float64))
    assert np.max(np.abs(out - exact) / exact) < 4e-7
    assert out[200_000] == 1.0
    below = np.array([-87.5, -100.0, -np.inf] + [0.0] * 13, dtype=np.float32)
    library.kiln_bounded_exp32(below.ctypes.data_as(f32), 16, out.ctypes.data_as(f32))
    assert list(out[:3]) == [0.0, 0.0, 0.0]


def rows(rng: np.random.Generator, vocab: int):
    """Flat rows (a random-weight model's), real-looking ones (a few tokens far above a spread), and
    rows with ties at the top (and so at top-k's k-th value)."""
    flat = rng.standard_normal(vocab) * 0.5
    peaked = rng.standard_normal(vocab) * 3.0
    peaked[rng.integers(0, vocab, 5)] += rng.uniform(20, 40, 5)
    tied = rng.standard_normal(vocab) * 2.0
    tied[rng.integers(0, vocab, 30)] = tied.max() + 15
    return [row.astype(np.float32) for row in (flat, peaked, tied)]


SETTINGS = [SamplingParams(temperature=0.7, top_p=0.95), SamplingParams(temperature=1.0),
            SamplingParams(temperature=0.7, min_p=0.05), SamplingParams(temperature=0.8, top_p=0.9, min_p=0.02),
            SamplingParams(temperature=1.5, top_p=0.5), SamplingParams(temperature=0.05, top_p=0.999999),
            SamplingParams(temperature=0.7, top_k=40), SamplingParams(temperature=1.0, top_k=1),
            SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05)]


def test_uniforms_near_the_rules_cumulative_sums_get_its_token_or_a_refusal(library):
    """Uniforms at the rule's cumulative sums and from one ulp to 1e-9 of them to either side: where
    the two computations' sums can fall on different sides, the draw must decline; further out, it
    must give the rule's token. The nearest ones are declined (the margin is there)."""
    rng = np.random.default_rng(21)
    declined = 0
    for vocab in (100, 4889, 5000, 49_152):  # 4889: the float32 pass ends on a whole vector and 9 tokens
        for logits in rows(rng, vocab):
            for params in SETTINGS:
                cumulative = np.cumsum(reference_probabilities(logits, params))
                edges = np.flatnonzero(np.diff(cumulative, prepend=0.0) > 0)
                for j in rng.choice(edges, min(4, edges.size), replace=False):
                    at = cumulative[j] / cumulative[-1]
                    near = [np.nextafter(at, 0.0), at, np.nextafter(at, 1.0)]
                    for scale in (1e-9, 1e-10, 1e-11, 1e-12, 1e-13, 1e-14, 1e-15):
                        near += [at * (1 - scale), at * (1 + scale)]
                    for u in near:
                        if not 0.0 <= u < 1.0:
                            continue
                        token = bounded_draw(library, logits, params, float(u))
                        assert token in (DECLINED, reference_draw(logits, params, float(u))), (vocab, params, u)
                        declined += token == DECLINED
    assert declined > 0


def test_the_draw_declines_rarely_on_ordinary_rows(library):
    """At random uniforms the draw answers nearly every peaked row itself (else the exact path would do
    all the work and the fast one would be dead code), and each answer is the rule's. Not asked of it:
    a top_p within a float32 exponential's error of 1 (0.999999), flat rows with a cut (a test below)."""
    rng = np.random.default_rng(22)
    answered = total = 0
    usual = [params for params in SETTINGS if params.top_p < 0.99999]
    for vocab in (1000, 49_152, 151_936):
        for _ in range(3):
            flat, peaked, _ = rows(rng, vocab)
            for logits, params in [(peaked, params) for params in usual] + \
                    [(flat, params) for params in usual if params.top_p == 1.0 or 0 < params.top_k < 1000]:
                u = float(rng.random())
                token = bounded_draw(library, logits, params, u)
                total += 1
                if token != DECLINED:
                    answered += 1
                    assert token == reference_draw(logits, params, u), (vocab, params, u)
    assert answered >= 0.99 * total, (answered, total)


def test_top_p_at_and_beside_the_rules_sorted_sums_gets_its_token_or_a_refusal(library):
    """top_p equal to one of the rule's sorted cumulative sums, and from 1e-4 to 1e-9 of it to either
    side: where the float32 pass's sums and the rule's can fall on different sides, the draw must
    decline; further out, it must give the rule's token."""
    rng = np.random.default_rng(24)
    declined = 0
    for vocab in (200, 5000, 49_152):
        for logits in rows(rng, vocab):
            for temperature in (0.7, 1.0):
                base = SamplingParams(temperature=temperature)
                probs = reference_probabilities(logits, base)
                cumulative = np.cumsum(np.sort(probs)[::-1])
                for k in (0, 1, 2, 5, 20):
                    at = float(cumulative[k])
                    for scale in (0.0, 1e-9, 1e-8, 1e-7, 1e-6, 1e-5, 1e-4):
                        for top_p in {at * (1 - scale), at * (1 + scale)}:
                            if not 0.0 < top_p < 1.0:
                                continue
                            params = SamplingParams(temperature=temperature, top_p=top_p)
                            u = float(rng.random())
                            token = bounded_draw(library, logits, params, u)
                            assert token in (DECLINED, reference_draw(logits, params, u)), (vocab, params, u)
                            declined += token == DECLINED
    assert declined > 0


def test_flat_rows_with_a_top_p_cut_are_drawn_over_the_row_as_it_is(library):
    """A random-weight model's rows: the nucleus is most of a long vocabulary. The draw takes the cut
    over the whole row (no candidates to compact), and min-p's after it, and answers nearly every such
    row, each with the rule's token."""
    rng = np.random.default_rng(23)
    answered = total = 0
    for vocab in (5000, 49_152, 151_936):
        for spread in (0.5, 1.5):
            flat = (rng.standard_normal(vocab) * spread).astype(np.float32)
            for params in (SamplingParams(temperature=0.7, top_p=0.95), SamplingParams(temperature=1.0, top_p=0.5),
                           SamplingParams(temperature=1.3, top_p=0.99), SamplingParams(temperature=0.7, top_p=0.95,
                                                                                       min_p=0.05),
                           SamplingParams(temperature=1.0, top_p=0.9, min_p=0.5)):
                for u in rng.random(4).tolist() + [1e-9, 0.999999]:
                    token = bounded_draw(library, flat, params, u)
                    total += 1
                    if token != DECLINED:
                        answered += 1
                        assert token == reference_draw(flat, params, u), (vocab, spread, params, u)
    assert answered >= 0.95 * total, (answered, total)


def test_min_p_at_and_beside_a_flat_rows_probabilities_gets_its_token_or_a_refusal(library):
    """min_p equal to a flat row's token's probability over the best's (within top-p's nucleus), and
    from 1e-15 to 1e-8 of it to either side: where the two computations can put that token on either
    side of min-p's floor, the draw must decline; further out, it must give the rule's token."""
    rng = np.random.default_rng(26)
    declined = 0
    for vocab in (5000, 49_152):
        flat = (rng.standard_normal(vocab) * 0.5).astype(np.float32)
        probs = reference_probabilities(flat, SamplingParams(temperature=0.7, top_p=0.95))
        ratios = probs[probs > 0] / probs.max()
        for at in rng.choice(ratios[ratios > 0.1], 4, replace=False).tolist():
            for scale in (0.0, 1e-15, 1e-13, 1e-12, 1e-10, 1e-8):
                for min_p in {at * (1 - scale), at * (1 + scale)}:
                    params = SamplingParams(temperature=0.7, top_p=0.95, min_p=min_p)
                    for u in rng.random(3).tolist():
                        token = bounded_draw(library, flat, params, u)
                        assert token in (DECLINED, reference_draw(flat, params, u)), (vocab, min_p, u)
                        declined += token == DECLINED
    assert declined > 0


def test_rows_it_cannot_judge_are_declined(library):
    """A logit that is not finite, a row of another type or not in one piece, and a temperature
    whose inverse overflows go to the exact path, which has the rule's own answers for them."""
    params = SamplingParams(temperature=0.7, top_p=0.9)
    for bad in (np.nan, np.inf, -np.inf):
        logits = np.zeros(300, dtype=np.float32)
        logits[17] = bad
        assert bounded_draw(library, logits, params, 0.5) == DECLINED
    assert bounded_draw(library, np.zeros(300, dtype=np.float64), params, 0.5) == DECLINED
    assert bounded_draw(library, np.zeros(600, dtype=np.float32)[::2], params, 0.5) == DECLINED
    assert bounded_draw(library, np.zeros(300, dtype=np.float32), SamplingParams(temperature=1e-310), 0.5) == DECLINED
    tiny = SamplingParams(temperature=1e-40, top_p=0.9)  # 1 / T fits a double, not a float
    assert bounded_draw(library, np.zeros(300, dtype=np.float32), tiny, 0.5) == DECLINED


def test_a_steps_rows_drawn_together_are_each_rows_own_token(library):
    """The one call a step (``bounded_draws``): each row's token is the one it gets alone, greedy rows
    their first largest logit (numpy's argmax, ties included), a row with NaN declined, whatever rows
    stand beside it."""
    rng = np.random.default_rng(25)
    flat, peaked, tied = rows(rng, 5000)
    nan = peaked.copy()
    nan[9] = np.nan
    table = [(peaked, SETTINGS[0]), (tied, SamplingParams()), (flat, SETTINGS[1]), (nan, SETTINGS[0]),
             (peaked, SamplingParams()), (tied, SETTINGS[6])]
    us = [float(u) for u in rng.random(len(table))]
    tokens = bounded_draws([row for row, _ in table], [params for _, params in table], us)
    for (row, params), u, token in zip(table, us, tokens.tolist()):
        if params.greedy:
            assert token == int(np.argmax(row))
        elif np.isnan(row).any():
            assert token == DECLINED
        else:
            assert token == bounded_draw(library, row, params, u) == reference_draw(row, params, u)
    alone = bounded_draws([tied], [SETTINGS[6]], us[5:])
    assert alone.tolist() == tokens.tolist()[5:]
    with pytest.raises(ValueError):
        bounded_draws([peaked.astype(np.float64)], [SETTINGS[0]], [0.5])
