"""A sampled token from a row of scores, at the cost of the tokens that can be chosen.

The rule (``reference_draw``, written as whole-vocabulary numpy) is Hugging Face ``generate``'s:
the scores over the temperature, top-k, a softmax in float64, top-p (the smallest set of most likely
tokens whose mass reaches top_p, ties by token id), then min-p (the tokens at least min_p times as
likely as the most likely one), each cut renormalised, then the inverse transform of one uniform in
vocabulary order. ``draw`` gives the same token for every row, setting and uniform, bit for bit,
without sorting the vocabulary (a ~4 ms sort at 49k tokens, 13 ms at 152k):

- the softmax's exponentials and their sum are numpy's own vector passes over the row (a few
  microseconds each);
- top-k's threshold is one native pass with a heap of k (numpy's fallback: a partial selection
  among the tokens within a few nats of the best);
- top-p sorts only the tokens above a probability threshold that holds the nucleus, widening it in
  the rare row where it does not;
- the sums numpy takes over the whole vocabulary with zeros for the cut tokens, and the cumulative
  sum of the inverse transform, are taken over the kept tokens alone in numpy's exact order of
  additions (``native/sampling.c``; a numpy fallback where it was not built).

Before all that, ``kiln_bounded_draw`` (``native/sampling_bounded.c``) tries the row with its own
exponentials (one vectorised pass instead of numpy's scaling, exp and sum): it takes each of the
rule's decisions only where no rounding of either computation can turn it, and otherwise declines
to the exact path below (under 1% of real rows; every flat row with a top-p cut).

``tests/generation/sampling/test_sampling_selection.py`` checks ``draw`` against ``reference_draw`` over thousands of
random rows, settings and uniforms."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np

from ...errors import InvalidInputError
from ...native import sampling_library
from .params import SamplingParams

# The tokens top-k's and top-p's searches look at first: those within this many nats (after the
# temperature) of the best; a row whose cut reaches further widens the search, then takes every token.
_FIRST_REACH = (12.0, 40.0)
_FIRST_SHARE = float(np.exp(-_FIRST_REACH[0]))  # the same for top-p, as a share of the best's probability
# the shares top-p's floor takes in turn (then 0: every token)
_SHARES = np.array([_FIRST_SHARE, *(float(np.exp(-reach)) for reach in _FIRST_REACH[1:])])
_SHARES_POINTER = _SHARES.ctypes.data_as(ctypes.POINTER(ctypes.c_double))
_I64 = ctypes.POINTER(ctypes.c_int64)
_F64 = ctypes.POINTER(ctypes.c_double)
_F32 = ctypes.POINTER(ctypes.c_float)
_U64 = ctypes.POINTER(ctypes.c_uint64)
_U8 = ctypes.POINTER(ctypes.c_uint8)
_BLOCK = 64  # sampling_bounded.c: a block sum per BLOCK tokens


def draw(scores: np.ndarray, params: SamplingParams, u: float) -> int:
    """The token ``reference_draw(scores, params, u)`` gives; ``scores`` [vocab] are the processed
    logits (bias and penalties applied), ``u`` the token's uniform."""
    library = sampling_library()
    if library is not None:
        token = bounded_draw(library, scores, params, u)
        if token >= 0:
            return token
    return exact_draw(scores, params, u)


def exact_draw(scores: np.ndarray, params: SamplingParams, u: float) -> int:
    """``draw`` on numpy's own exponentials and sums, where every value is the reference's."""
    vocab = scores.shape[-1]
    library = sampling_library()
    best = float(scores.max())  # a float32 row's max converts exactly: the float64 row's max
    if not np.isfinite(best):  # NaN, or a bias that overflowed: the reference's own rule
        return reference_draw(scores, params, u)
    s, e = _scaled(scores, best, params.temperature)  # the best token scores 0
    if library is not None:
        return _native_draw(library, s, e, params, u)
    # numpy's form of kiln_pick (where the native library was not built): the same operations in the same order
    ids: np.ndarray | None  # the tokens still in (sorted), or None: all of them
    wider = None  # where the tokens in are not all that have a probability: a look at more of the row
    if params.top_k and params.top_k < vocab:
        ids = _top_k(s, params.top_k)
        kept = np.exp(s[ids])
        probs = kept / sparse_sum(ids, kept, vocab)
    else:
        np.exp(s, out=e)
        total = e.sum()
        if params.top_p < 1.0 or params.min_p > 0.0:  # the cuts need the probabilities of a few tokens
            share = min(_FIRST_SHARE if params.top_p < 1.0 else 1.0, params.min_p or 1.0)
            ids, probs = _likely(e, total, share)
            wider = partial(_likely, e, total)
        else:
            ids, probs = None, np.divide(e, total, out=e)
    if params.top_p < 1.0:
        assert ids is not None
        ids, probs = _top_p(ids, probs, params.top_p, wider)
        probs = probs / sparse_sum(ids, probs, vocab)
    if params.min_p > 0.0:
        assert ids is not None
        ids, probs = _min_p(ids, probs, params.min_p)
        probs = probs / sparse_sum(ids, probs, vocab)
    index, total = cumulative_pick(probs, u)
    if not total > 0:  # NaN too: settings the checks let through cannot give probabilities
        raise InvalidInputError(f"the sampling settings give no probabilities (temperature {params.temperature})")
    if index >= probs.shape[-1]:  # the target at the very top: the reference's clamp to the last token
        return vocab - 1
    return int(index if ids is None else ids[index])


def bounded_draw(library: ctypes.CDLL, scores: np.ndarray, params: SamplingParams, u: float) -> int:
    """``kiln_bounded_draw``'s token, or -1 where it declines: a decision too near to take on its own
    exponentials, a logit that is not finite, or a row that is not float32 in one piece."""
    if scores.dtype != np.float32 or not scores.flags.c_contiguous:
        return -1
    n = scores.shape[-1]
    return int(library.kiln_bounded_draw(scores.ctypes.data_as(_F32), n, params.temperature, params.top_k,
                                         params.top_p, params.min_p, u, *_bounded_buffers(n)))


def bounded_draws(rows: Sequence[np.ndarray], params: Sequence[SamplingParams], us: Sequence[float]) -> np.ndarray | None:
    """Each row's token as ``draw`` gives it (at temperature 0 its argmax), or -1 where the bounded draw
    declines, in one native call for a step's rows (float32, each in one piece, all of one length);
    None where the native library was not built."""
    library = sampling_library()
    if library is None or not rows:
        return None
    count, n = len(rows), rows[0].shape[-1]
    if any(row.dtype != np.float32 or not row.flags.c_contiguous or row.shape != (n,) for row in rows):
        raise ValueError("bounded_draws takes float32 rows in one piece, all of one length")
    tokens = np.empty(count, dtype=np.int64)
    library.kiln_bounded_draws(
        np.fromiter((row.ctypes.data for row in rows), dtype=np.uint64, count=count).ctypes.data_as(_U64), count, n,
        np.fromiter((p.temperature for p in params), dtype=np.float64, count=count).ctypes.data_as(_F64),
        np.fromiter((p.top_k for p in params), dtype=np.int64, count=count).ctypes.data_as(_I64),
        np.fromiter((p.top_p for p in params), dtype=np.float64, count=count).ctypes.data_as(_F64),
        np.fromiter((p.min_p for p in params), dtype=np.float64, count=count).ctypes.data_as(_F64),
        np.asarray(us, dtype=np.float64).ctypes.data_as(_F64), tokens.ctypes.data_as(_I64), *_bounded_buffers(n))
    return tokens


def _bounded_buffers(n: int) -> tuple[Any, ...]:
    """kiln_bounded_draw's work buffers for rows of n, this thread's (shared with the exact path's)."""
    return (_pointer("exponentials", n, np.float64), _pointer("blocks", n // _BLOCK + 1, np.float64),
            _pointer("pick ids", n, np.int64), _pointer("pick probs", n, np.float64), _pointer("marks", n, np.uint8),
            _pointer("radix", 2 * n, np.uint64))


def _native_draw(library: ctypes.CDLL, s: np.ndarray, e: np.ndarray, params: SamplingParams, u: float) -> int:
    """``draw``'s steps after the scaling, the numpy passes (the exponentials, their sum) here and the
    rest in one native call (``kiln_pick``: the same operations in the same order as the numpy path)."""
    vocab = s.shape[0]
    support = None
    if params.top_k and params.top_k < vocab:
        support = _top_k(s, params.top_k)
        values = np.exp(s[support])
        total = sparse_sum(support, values, vocab)
    else:
        values = np.exp(s, out=e)
        total = values.sum()
    n = values.shape[0]
    token = library.kiln_pick(
        support.ctypes.data_as(_I64) if support is not None else None,
        values.ctypes.data_as(_F64) if support is not None else _pointer("exponentials", vocab, np.float64), n, vocab,
        total, params.top_p, params.min_p, _SHARES_POINTER, u,
        _pointer("pick ids", n, np.int64), _pointer("pick probs", n, np.float64),
        _pointer("radix", 2 * n, np.uint64), _pointer("marks", n, np.uint8))
    if token < 0:
        raise InvalidInputError(f"the sampling settings give no probabilities (temperature {params.temperature})")
    return int(token)


def _scaled(scores: np.ndarray, best: float, temperature: float) -> tuple[np.ndarray, np.ndarray]:
    """``(float64(scores) - best) / temperature`` in a kept buffer, and a second kept buffer: a fresh
    0.4-1.2 MB array a pass costs more in page faults than its arithmetic (measured: 0.5 ms a row at
    49k tokens against 0.12)."""
    s, e = _scratch(scores.shape[-1])
    library = sampling_library()
    if library is not None and scores.dtype == np.float32 and scores.flags.c_contiguous:
        library.kiln_scale(scores.ctypes.data_as(_F32), scores.shape[-1], best, temperature,
                           _pointer("scaled", scores.shape[-1], np.float64))
    else:
        np.copyto(s, scores)
        np.subtract(s, best, out=s)
        np.divide(s, temperature, out=s)
    return s, e


def _likely(e: np.ndarray, total: float, share: float) -> tuple[np.ndarray, np.ndarray]:
    """The tokens whose probability (``e / total`` as numpy's division of the whole row rounds it)
    is at least about ``share`` of the best's, with those probabilities: exactly the tokens above a
    floor a little under that share (a margin far above a rounding), so the set never splits tokens
    of equal probability and holds every token a cut at ``share`` of the best keeps."""
    floor = share / total * (1 - 1e-9)  # the best token's exponential is exp(0) = 1
    near = np.flatnonzero(e >= floor * total * (1 - 1e-9))
    probs = e[near] / total
    keep = probs >= floor
    return near[keep], probs[keep]


_local = threading.local()


def _scratch(vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """Two float64 rows of ``vocab`` for this thread, kept from call to call."""
    return _buffers("scaled", vocab, np.float64), _buffers("exponentials", vocab, np.float64)


def _buffers(name: str, size: int, dtype: type) -> np.ndarray:
    """This thread's buffer ``name``, of at least ``size`` items, kept from call to call (a view of ``size``)."""
    return _kept(name, size, dtype)[0][:size]


def _pointer(name: str, size: int, dtype: type) -> Any:
    """The ctypes pointer to ``_buffers(name, size, dtype)``, made once with its buffer (one made
    per call costs a microsecond, a few times a row)."""
    return _kept(name, size, dtype)[1]


_CTYPES: dict[type, type[ctypes._SimpleCData[Any]]] = {np.int64: ctypes.c_int64, np.float64: ctypes.c_double,
                                                       np.uint64: ctypes.c_uint64, np.uint8: ctypes.c_uint8}


def _kept(name: str, size: int, dtype: type) -> tuple[np.ndarray, Any]:
    kept = getattr(_local, "kept", None)
    if kept is None:
        kept = _local.kept = {}
    entry = kept.get(name)
    if entry is None or entry[0].shape[0] < size:
        buffer: np.ndarray = np.empty(max(size, 1), dtype=dtype)
        entry = kept[name] = (buffer, buffer.ctypes.data_as(ctypes.POINTER(_CTYPES[dtype])))
    return entry


def _top_k(s: np.ndarray, k: int) -> np.ndarray:
    """The tokens whose score is not below the k-th best (ties kept, as ``scores < kth`` drops)."""
    library = sampling_library()
    if library is not None:
        ids, heap = _buffers("top k", s.shape[0], np.int64), _buffers("heap", k, np.float64)
        count = library.kiln_top_k(s.ctypes.data_as(_F64), s.shape[0], k, heap.ctypes.data_as(_F64),
                                   ids.ctypes.data_as(_I64))
        return ids[:count].copy()
    for reach in (*_FIRST_REACH, np.inf):
        near = np.flatnonzero(s >= -reach)
        if near.size >= k:
            kth = np.partition(s[near], -k)[-k]
            return near[s[near] >= kth]
    raise AssertionError("unreachable: every token is within an infinite reach")


def _top_p(ids: np.ndarray, probs: np.ndarray, top_p: float,
           wider: Callable[[float], tuple[np.ndarray, np.ndarray]] | None) -> tuple[np.ndarray, np.ndarray]:
    """The nucleus as (tokens in vocabulary order, their probabilities, not renormalised). The
    reference sorts every probability (descending, ties by token id) and keeps up to the first
    cumulative sum that reaches top_p. The tokens in (``ids``, ``probs``) are all those above a
    probability floor, so they come first in that order and their cumulative sums are the
    reference's first ones; where the nucleus reaches past them, ``wider(share)`` takes in the
    tokens down to a lower share of the best (None: the tokens in are all that have a probability)."""
    shares = [*_SHARES[1:].tolist(), 0.0]
    while True:
        kept, keep = _nucleus(probs, top_p)
        if keep <= probs.shape[0] or wider is None or not shares:
            chosen = np.flatnonzero(kept) if keep <= probs.shape[0] else np.arange(probs.shape[0])
            return ids[chosen], probs[chosen]
        ids, probs = wider(shares.pop(0))


def _nucleus(probs: np.ndarray, top_p: float) -> tuple[np.ndarray, int]:
    """(which tokens top-p keeps, how many): the reference sorts them (``argsort(-probs,
    kind="stable")``) and keeps up to the first cumulative sum not below top_p; ``len + 1`` tokens
    where none reaches it (the mask then keeps none). ``kiln_top_p``'s numpy form."""
    order = np.argsort(-probs, kind="stable")
    keep = int(np.searchsorted(np.cumsum(probs[order]), top_p)) + 1
    kept = np.zeros(probs.shape[0], dtype=bool)
    if keep <= probs.shape[0]:
        kept[order[:keep]] = True
    return kept, keep


def _min_p(ids: np.ndarray, probs: np.ndarray, min_p: float) -> tuple[np.ndarray, np.ndarray]:
    """The tokens in at least min_p times as likely as the best (which is always in)."""
    kept = np.flatnonzero(probs >= min_p * probs.max())
    return ids[kept], probs[kept]


def sparse_sum(ids: np.ndarray | None, values: np.ndarray, length: int) -> float:
    """numpy's ``a.sum()`` of the float64 vector of ``length`` that holds ``values`` at the sorted
    positions ``ids`` and zeros elsewhere (``values.sum()`` itself where ``ids`` is None)."""
    if ids is None:
        return values.sum()
    library = sampling_library()
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    values = np.ascontiguousarray(values, dtype=np.float64)
    if library is not None:
        return library.kiln_sparse_sum(ids.ctypes.data_as(_I64), values.ctypes.data_as(_F64), ids.shape[0], length)
    dense = np.zeros(length, dtype=np.float64)
    dense[ids] = values
    return dense.sum()


def cumulative_pick(probs: np.ndarray, u: float) -> tuple[int, float]:
    """(``searchsorted(cumsum(probs), u * total, side="right")``, total), total being the cumulative
    sum's last value: ``kiln_cumulative_pick``'s numpy form."""
    cumulative = np.cumsum(probs)
    total = float(cumulative[-1])
    return int(np.searchsorted(cumulative, u * total, side="right")), total


def reference_draw(scores: np.ndarray, params: SamplingParams, u: float) -> int:
    """The rule, over the whole vocabulary: what ``draw`` computes faster."""
    scores = scores.astype(np.float64)
    best = np.max(scores)
    if not np.isfinite(best):  # a huge bias or penalty overflowed: the tokens at the top remain
        top = np.flatnonzero(scores == best)
        if top.size == 0:  # NaN: no token is at the top
            raise InvalidInputError(f"the sampling settings give no probabilities (temperature {params.temperature})")
        return int(top[min(int(u * len(top)), len(top) - 1)])
    probs = reference_probabilities(scores, params)
    cumulative = np.cumsum(probs)  # inverse transform in vocabulary order: one uniform per token
    if not cumulative[-1] > 0:  # NaN too: settings the checks let through cannot give probabilities
        raise InvalidInputError(f"the sampling settings give no probabilities (temperature {params.temperature})")
    return min(int(np.searchsorted(cumulative, u * cumulative[-1], side="right")), probs.shape[-1] - 1)


def reference_probabilities(scores: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Every token's probability under the settings (float64 [vocab]), for a row whose best score is finite."""
    p = params
    scores = scores.astype(np.float64)
    scores = (scores - np.max(scores)) / p.temperature  # the best token scores 0: a tiny temperature cannot make inf - inf
    if p.top_k and p.top_k < scores.shape[-1]:
        kth = np.partition(scores, -p.top_k)[-p.top_k]
        scores = np.where(scores < kth, -np.inf, scores)
    probs = _softmax(scores)
    if p.top_p < 1.0:
        probs = _reference_top_p(probs, p.top_p)
    if p.min_p > 0.0:
        probs = np.where(probs >= p.min_p * probs.max(), probs, 0.0)
        probs = probs / probs.sum()
    return probs


def _softmax(scores: np.ndarray) -> np.ndarray:
    e = np.exp(scores - np.max(scores))
    return e / e.sum()


def _reference_top_p(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p`` (at least one)."""
    order = np.argsort(-probs, kind="stable")
    cumulative = np.cumsum(probs[order])
    keep = int(np.searchsorted(cumulative, top_p) + 1)
    kept = np.zeros_like(probs)
    kept[order[:keep]] = probs[order[:keep]]
    return kept / kept.sum()
