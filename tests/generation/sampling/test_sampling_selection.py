"""The sampler's fast path against its definition: the same token as the whole-vocabulary rule for
every row, setting and uniform; numpy's own sums, cumulative sums and Philox draws, bit for bit."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from modelkiln.generation.sampling import SamplingParams, TokenChooser, uniforms
from modelkiln.generation.sampling import draws, selection
from modelkiln.generation.sampling.draws import numpy_uniform
from modelkiln.generation.sampling.selection import cumulative_pick, draw, reference_draw, sparse_sum
from modelkiln.native import sampling_library


@pytest.fixture(params=["bounded", "native", "numpy"])
def arithmetic(request, monkeypatch):
    """Every check runs on the native library (with its bounded draw first, and on its exact path
    alone, which takes the rows the bounded draw declines) and on the numpy fallback (a machine
    without gcc)."""
    if request.param in ("bounded", "native"):
        if sampling_library() is None:
            pytest.skip("the native sampling library was not built here")
        if request.param == "native":
            monkeypatch.setattr(selection, "bounded_draw", lambda *args: -1)
    else:
        monkeypatch.setattr(selection, "sampling_library", lambda: None)
        monkeypatch.setattr(draws, "sampling_library", lambda: None)
    return request.param


def random_case(rng: np.random.Generator, vocab: int) -> tuple[np.ndarray, SamplingParams]:
    scale = rng.choice([0.5, 3.0, 10.0, 30.0])
    logits = (rng.standard_normal(vocab) * scale).astype(np.float32)
    if rng.random() < 0.2:  # ties at the top, where the orders of a sort matter
        logits[rng.integers(0, vocab, max(1, vocab // 10))] = logits.max()
    if rng.random() < 0.1:  # a peaked row: one token takes nearly all the mass
        logits[rng.integers(vocab)] += 40
    params = SamplingParams(
        temperature=float(rng.choice([0.05, 0.3, 0.7, 1.0, 1.5, 5.0])),
        top_k=int(rng.choice([0, 0, 1, 5, 40, vocab + 3])),
        top_p=float(rng.choice([1.0, 0.5, 0.9, 0.95, 0.999999, 1e-9])),
        min_p=float(rng.choice([0.0, 0.0, 0.05, 0.5, 1.0])))
    return logits, params


def test_the_fast_draw_is_the_whole_vocabulary_rule(arithmetic):
    """Thousands of random rows (flat, peaked, with ties; vocabularies from 1 to 49,152, across the
    8,192-item chunks numpy sums in), settings and uniforms: not one token differs."""
    rng = np.random.default_rng(7)
    compared = 0
    for vocab, rows in ((1, 40), (2, 40), (7, 60), (130, 120), (1000, 120), (8193, 40), (49_152, 40)):
        for _ in range(rows):
            logits, params = random_case(rng, vocab)
            for u in [*rng.random(4), 0.0, np.nextafter(1.0, 0.0)]:
                assert draw(logits, params, float(u)) == reference_draw(logits, params, float(u)), (vocab, params, u)
                compared += 1
    assert compared == 460 * 6


def test_uniforms_on_the_edges_of_the_cumulative_sums_choose_alike(arithmetic):
    """Uniforms placed where ``u * total`` meets a cumulative sum of the reference, and one ulp to
    either side: there a probability or a sum one rounding off would choose another token."""
    rng = np.random.default_rng(11)
    for vocab in (50, 1000, 9000):
        for _ in range(30):
            logits, params = random_case(rng, vocab)
            cumulative = np.cumsum(selection.reference_probabilities(logits, params))
            edges = np.flatnonzero(np.diff(cumulative, prepend=0.0) > 0)[:20]
            for j in edges:
                at = cumulative[j] / cumulative[-1]
                for u in (np.nextafter(at, 0.0), at, np.nextafter(at, 1.0)):
                    if 0.0 <= u < 1.0:
                        assert draw(logits, params, float(u)) == reference_draw(logits, params, float(u))


def test_rows_the_reference_rejects_or_reduces_are_handled_alike(arithmetic):
    """A row with +inf (a bias that overflowed) draws among the tokens at the top; a NaN row is an error."""
    logits = np.array([1.0, np.inf, 3.0, np.inf], dtype=np.float32)
    params = SamplingParams(temperature=0.7, top_p=0.9)
    assert [draw(logits, params, u) for u in (0.1, 0.9)] == [reference_draw(logits, params, u) for u in (0.1, 0.9)]
    with pytest.raises(Exception):
        draw(np.array([0.0, np.nan], dtype=np.float32), params, 0.5)


def test_sparse_sums_are_numpys_sums(arithmetic):
    rng = np.random.default_rng(3)
    for length in (1, 7, 8, 9, 127, 128, 129, 1000, 8192, 8193, 20_000, 151_936):
        for density in (1, 3, 0.01, 0.5):
            count = int(density) if density >= 1 else max(1, int(length * density))
            ids = np.sort(rng.choice(length, min(count, length), replace=False))
            values = np.exp(rng.standard_normal(ids.shape[0]) * 5)
            dense = np.zeros(length)
            dense[ids] = values
            assert sparse_sum(ids, values, length) == dense.sum(), (length, density)


def native_cumulative_pick(probs: np.ndarray, u: float) -> tuple[int, float]:
    """``kiln_cumulative_pick`` (which ``kiln_pick`` ends with), called alone."""
    total = ctypes.c_double()
    index = sampling_library().kiln_cumulative_pick(probs.ctypes.data_as(ctypes.POINTER(ctypes.c_double)),
                                                    probs.shape[0], u, ctypes.byref(total))
    return int(index), total.value


def native_nucleus(probs: np.ndarray, top_p: float) -> tuple[np.ndarray, int]:
    """``kiln_top_p`` (top-p's cut inside ``kiln_pick``), called alone."""
    marks, scratch = np.zeros(probs.shape[0], dtype=np.uint8), np.empty(2 * probs.shape[0], dtype=np.uint64)
    keep = sampling_library().kiln_top_p(probs.ctypes.data_as(ctypes.POINTER(ctypes.c_double)), probs.shape[0], top_p,
                                         marks.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)),
                                         scratch.ctypes.data_as(ctypes.POINTER(ctypes.c_uint64)))
    return marks.astype(bool), int(keep)


@pytest.fixture(params=["native", "numpy"])
def forms(request):
    """The native functions ``kiln_pick`` is made of, and their numpy forms (the path without the library)."""
    if request.param == "numpy":
        return cumulative_pick, selection._nucleus
    if sampling_library() is None:
        pytest.skip("the native sampling library was not built here")
    return native_cumulative_pick, native_nucleus


def test_the_cumulative_pick_is_numpys_searchsorted(forms):
    pick, _ = forms
    rng = np.random.default_rng(4)
    for length in (1, 2, 255, 256, 257, 5000, 49_152):
        probs = np.exp(rng.standard_normal(length) * 3)
        probs[rng.random(length) < 0.3] = 0.0
        probs[0] = probs[0] or 1e-3
        cumulative = np.cumsum(probs)
        for u in (*rng.random(5), 0.0, np.nextafter(1.0, 0.0)):
            index, total = pick(probs, float(u))
            assert total == cumulative[-1]
            assert index == np.searchsorted(cumulative, u * cumulative[-1], side="right")


def test_the_draws_are_numpys_philox(arithmetic):
    rng = np.random.default_rng(5)
    seeds = [0, 1, 2**63, 2**64 - 1, *map(int, rng.integers(0, 2**63, 200))]
    positions = [0, 1, 2**64 - 2, 2**64 - 1, 2**32, *map(int, rng.integers(0, 2**40, 200))]
    assert uniforms(seeds, positions).tolist() == [numpy_uniform(s, p) for s, p in zip(seeds, positions)]
    with pytest.raises(ValueError):  # numpy's refusal, not a seed wrapped into range
        uniforms([3, -1], [0, 0])


def test_min_p_keeps_the_tokens_at_least_that_share_of_the_best():
    logits = np.log(np.array([0.5, 0.3, 0.1, 0.06, 0.04])).astype(np.float32)
    chooser = TokenChooser(SamplingParams(temperature=1.0, min_p=0.19, seed=0), seed=0)
    assert {chooser.choose(logits) for _ in range(300)} == {0, 1, 2}  # 0.1 >= 0.19 * 0.5 > 0.06
    only_best = TokenChooser(SamplingParams(temperature=1.0, min_p=1.0), seed=0)
    assert {only_best.choose(logits) for _ in range(50)} == {0}


def test_min_p_is_checked():
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(Exception, match="min_p"):
            SamplingParams(min_p=bad)


def test_the_nucleus_is_the_stable_argsorts_first_tokens(forms):
    """Top-p's cut: the tokens numpy's stable argsort puts first (largest first, ties in token order),
    up to where their cumulative sum reaches top_p, and how many."""
    _, nucleus = forms
    rng = np.random.default_rng(6)
    for n in (1, 2, 31, 33, 1000, 70_000):
        probs = np.exp(rng.standard_normal(n) * rng.choice([0.1, 3.0]))
        probs[rng.random(n) < 0.2] = probs[0]  # ties
        probs[rng.random(n) < 0.05] = 0.0
        probs /= probs.sum()
        for top_p in (1e-9, 0.5, 0.95, 1.0, 2.0):
            kept, keep = nucleus(probs, top_p)
            expected = np.argsort(-probs, kind="stable")
            assert keep == int(np.searchsorted(np.cumsum(probs[expected]), top_p)) + 1, (n, top_p)
            if keep <= n:
                assert np.array_equal(np.flatnonzero(kept), np.sort(expected[:keep])), (n, top_p)


def test_the_nucleus_of_nearly_equal_probabilities(forms):
    """Rows whose probabilities differ in their last bits only (the sort's worst case: every key in
    one run of its leading bits), and rows of three values (long ties)."""
    _, nucleus = forms
    rng = np.random.default_rng(7)
    n = 50_000
    base = np.full(n, 1.0 / n)
    rows = [base * (1 + rng.integers(-50, 50, n) * np.finfo(np.float64).eps),
            base * (1 + rng.standard_normal(n) * 1e-12),
            rng.choice([1e-5, 2e-5, 3e-5], n)]
    for probs in rows:
        for top_p in (0.3, 0.95):
            kept, keep = nucleus(probs, top_p)
            expected = np.argsort(-probs, kind="stable")
            assert keep == int(np.searchsorted(np.cumsum(probs[expected]), top_p)) + 1
            assert np.array_equal(np.flatnonzero(kept), np.sort(expected[:keep]))


def test_the_nucleus_of_long_rows_and_of_top_p_at_a_sum(forms):
    """Rows long enough for the cut by selection (flat ones: a nucleus of most of the row; peaked ones;
    rows with zeros and ties), and top_p equal to one of the sorted cumulative sums or a float beside
    it, where the rule's sums and any other order of adding may fall on either side."""
    _, nucleus = forms
    rng = np.random.default_rng(8)
    for n in (2048, 5000, 128_256):
        for spread in (0.05, 1.0, 4.0):
            probs = np.exp(rng.standard_normal(n) * spread)
            probs[rng.random(n) < 0.1] = probs[1]  # ties
            probs[rng.random(n) < 0.02] = 0.0
            probs /= probs.sum()
            order = np.argsort(-probs, kind="stable")
            cumulative = np.cumsum(probs[order])
            at_sums = [cumulative[k] for k in (0, n // 3, int(np.searchsorted(cumulative, 0.95)), n - 2)]
            at_sums += [np.nextafter(v, d) for v in at_sums for d in (0.0, 2.0)]
            for top_p in (0.5, 0.9, 0.95, 0.999, *at_sums):
                kept, keep = nucleus(probs, float(top_p))
                assert keep == int(np.searchsorted(cumulative, top_p)) + 1, (n, spread, top_p)
                if keep <= n:
                    assert np.array_equal(np.flatnonzero(kept), np.sort(order[:keep])), (n, spread, top_p)


def test_flat_rows_of_large_vocabularies_draw_as_the_rule(arithmetic):
    """Rows where every token is likely enough to be a candidate (a random-weight model's: the fast
    path that renormalises and draws over the row as it is, the cut's others as zeros), with top_p
    alone, uniforms at random and on the edges of the reference's cumulative sums."""
    rng = np.random.default_rng(12)
    for vocab in (49_152, 128_256):
        for row in range(6):
            logits = (rng.standard_normal(vocab) * 0.5).astype(np.float32)
            if row % 3 == 2:
                logits[rng.integers(0, vocab, 50)] = logits[7]  # ties, maybe at the cut's value
            params = SamplingParams(temperature=float(rng.choice([0.7, 1.0, 1.5])),
                                    top_p=float(rng.choice([0.5, 0.9, 0.95, 0.999999])))
            cumulative = np.cumsum(selection.reference_probabilities(logits, params))
            edges = rng.choice(np.flatnonzero(np.diff(cumulative, prepend=0.0) > 0), 5)
            uniforms = [*rng.random(5)] + [v for j in edges for v in
                                           (np.nextafter(cumulative[j] / cumulative[-1], 0.0), cumulative[j] / cumulative[-1])]
            for u in uniforms:
                assert draw(logits, params, float(u)) == reference_draw(logits, params, float(u)), (vocab, params, u)
