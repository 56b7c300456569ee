"""The shortest way to finish a constrained answer: the tokens that complete a grammar from where
a sequence stands, so that an answer about to run out of tokens ends valid (sequence.py decides when
to follow them; docs/structured-outputs.md says what a client sees).

The path is chosen greedily, one token at a time, on a copy of the sequence's matcher:

1. the grammar is complete (stopped): the path ends there; it may end (accepting): end-of-sequence;
2. the grammar forces text (a key of a schema, the rest of an enum value): its tokens;
3. the first "closing" token (``CLOSING_TEXTS``: quotes and brackets that end what is open, then a
   separator, then small complete values) the grammar allows that brings the end nearer: after
   it the answer may end, or the grammar allows no more tokens than before and not the same ones.
   That look ahead is what tells a quote that closes a string (after it only a few tokens may
   follow) from one that opens a string (after it almost any token may), and a bracket that
   closes an array from the same character as text inside a string (the same tokens may follow);
4. else the allowed token that spells the most bytes (fewest tokens through a pattern or a number's
   bounds), not blank unless only blanks are allowed (a grammar that ignores whitespace allows
   blanks everywhere, and they never bring its end nearer), and not one after which the grammar
   allows the very same tokens (that token would be taken for ever: zeros after "-0." in a number
   that must not be zero) while another one changes them.

It is not the shortest path in general (that is a search over the vocabulary at every step), but it
is for the JSON that structured outputs write, and it uses nothing specific to JSON: any grammar
llguidance compiles gets a path, or None when none is found within the tokens asked for.

The path depends only on the matcher's state: the same state gives the same path, whatever else
runs and whether the tokens before it were chosen here or replayed (a resumed request)."""

from __future__ import annotations

from typing import Any

import numpy as np

from . import bitmask

# Tried in this order, each by its exact text in the vocabulary (absent ones are skipped), the
# first one that brings the end nearer (``_next_token``) taken. Closers first, those that close the
# most first, a string's before a container's (inside a string a bracket is text); then a
# separator, where no closer may come yet (keys still required, an array short of items; after a
# number it ends the number, where a digit would only lengthen it: "-0.1" in a number that may not
# be 0 takes ',' rather than '0'); then the shortest complete values, also as they follow ': '
# (JSON_OPTIONS' separator), where a value must begin.
CLOSING_TEXTS = (
    '"}]}', '"]}', '"}}', '"}]', '"]', '"}', '"', '}]}', '}]', ']}', '}}', ']]', '}', ']', ')', ',',
    '""', '[]', '{}', '0', 'null', 'false', 'true', ' ""', ' []', ' {}', ' 0', ' null', ' false', ' true',
)

# Allowed tokens tried, longest first, when the longest one would leave the grammar's choices as
# they are (each try: a copy of the matcher, a token and a mask, some 20 µs).
FALLBACK_TRIES = 32

class ClosingTokens:
    """What the closing path needs to know about one vocabulary, computed once per model (about
    10 ms for 49,152 tokens): the closing tokens in order of preference, each token's length in
    bytes, and which tokens are blank."""

    def __init__(self, vocabulary: Any):
        spelled = [vocabulary.llg.decode_bytes([i]) for i in range(vocabulary.size)]
        first: dict[bytes, int] = {}
        for token, text in enumerate(spelled):
            first.setdefault(text, token)
        self.preferred = [first[t.encode()] for t in CLOSING_TEXTS if t.encode() in first]
        padded = bitmask.words(vocabulary.size) * bitmask.BITS  # as wide as a mask's bits
        self.lengths = np.zeros(padded, dtype=np.int32)
        self.lengths[:len(spelled)] = [len(b) for b in spelled]
        self.blank = np.zeros(padded, dtype=bool)
        self.blank[:len(spelled)] = [bool(b) and not b.strip() for b in spelled]
        self.eos = vocabulary.eos_ids[0] if vocabulary.eos_ids else None


def closing_path(matcher: Any, tokens: ClosingTokens, limit: int) -> list[int] | None:
    """The tokens that finish ``matcher``'s grammar, at most ``limit`` of them (the last one is
    end-of-sequence where the grammar may end but need not); None when it takes more. ``matcher``
    is a ``constraints.Matcher`` the path consumes: pass a copy."""
    path: list[int] = []
    while True:
        if matcher.error:
            return None
        if matcher.is_terminated():
            return path
        if matcher.is_accepting() and tokens.eos is not None:
            path.append(tokens.eos)
            return path if len(path) <= limit else None
        if len(path) >= limit:
            return None
        # One forced token at a time (the tokens of the rest of a forced text may differ from the
        # rest of its tokens): each step depends on the state alone.
        forced = matcher.forced_tokens()
        token = forced[0] if forced else _next_token(matcher, tokens)
        if token is None or not matcher.accept(token):
            return None
        path.append(token)


def _next_token(matcher: Any, tokens: ClosingTokens) -> int | None:
    now = matcher.mask()
    allowed = bitmask.to_bool(now, now.shape[0] * bitmask.BITS)
    if not allowed.any():
        return None
    choices = popcount(now)
    for token in (t for t in tokens.preferred if allowed[t]):
        after = _after(matcher, token)
        # It brings the end nearer when the answer may end after it, or it leaves no more choices
        # than there were, and other ones: a quote that opens a string leaves almost any token; a
        # bracket written inside a string leaves the very same choices.
        if after is None or (popcount(after) <= choices and not np.array_equal(after, now)):
            return token
    lengths = np.where(allowed & ~tokens.blank, tokens.lengths, 0)
    if not lengths.any():  # only blanks (or empty tokens) are allowed
        lengths = np.where(allowed, tokens.lengths, 0)
    if not lengths.any():
        return int(np.flatnonzero(allowed)[0])
    def moves(token: int) -> bool:  # the answer may end after it, or other tokens are allowed than now
        after = _after(matcher, token)
        return after is None or not np.array_equal(after, now)

    longest = int(np.argmax(lengths))
    if moves(longest):
        return longest
    # The longest token leaves the very same choices, and so would be taken again and again (zeros
    # after "-0." in a number that must not be zero): the longest one after which they differ.
    candidates = np.flatnonzero(lengths)
    for token in candidates[np.argsort(-lengths[candidates], kind="stable")][1:FALLBACK_TRIES]:
        if moves(int(token)):
            return int(token)
    return longest


def _after(matcher: Any, token: int) -> np.ndarray | None:
    """The grammar's mask after ``token`` (on a copy of the matcher); None when the answer may end there."""
    ahead = matcher.copy()
    ahead.accept(token)
    return None if ahead.is_terminated() or ahead.is_accepting() else ahead.mask()


def popcount(words: np.ndarray) -> int:
    """How many tokens an int32 bitmask allows."""
    return bitmask.count(words)
