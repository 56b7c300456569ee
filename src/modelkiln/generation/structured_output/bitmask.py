"""A grammar's mask over the vocabulary, as llguidance writes it: int32 words, bit ``t % 32`` of word
``t // 32`` set when token ``t`` is allowed. Every reader and writer of a mask goes through here, so
the layout is written once."""

from __future__ import annotations

import numpy as np

BITS = 32  # tokens a word holds


def words(vocab: int) -> int:
    """How many words a mask of ``vocab`` tokens takes."""
    return -(-vocab // BITS)


def empty(vocab: int) -> np.ndarray:
    """A mask that allows no token."""
    return np.zeros(words(vocab), dtype=np.int32)


def allows(mask: np.ndarray, token: int) -> bool:
    """Whether ``mask`` allows ``token`` (a token past the mask's end is not allowed)."""
    return 0 <= token < mask.shape[-1] * BITS and bool((int(mask[token // BITS]) >> (token % BITS)) & 1)


def allow(mask: np.ndarray, token: int) -> None:
    """Sets ``token``'s bit."""
    mask.view(np.uint32)[token // BITS] |= np.uint32(1 << (token % BITS))


def from_bool(allowed: np.ndarray) -> np.ndarray:
    """bool [vocab] → a mask."""
    padded = np.zeros(words(allowed.shape[0]) * BITS, dtype=bool)
    padded[:allowed.shape[0]] = allowed
    return np.packbits(padded, bitorder="little").view(np.int32)


def to_bool(mask: np.ndarray, vocab: int) -> np.ndarray:
    """A mask → bool [vocab]; tokens past the mask are not allowed."""
    bits = np.unpackbits(np.ascontiguousarray(mask, dtype=np.int32).view(np.uint8), bitorder="little")
    allowed = np.zeros(vocab, dtype=bool)
    n = min(vocab, bits.shape[0])
    allowed[:n] = bits[:n].astype(bool)
    return allowed


_POPCOUNT = np.array([bin(i).count("1") for i in range(256)], dtype=np.int32)


def count(mask: np.ndarray) -> int:
    """How many tokens ``mask`` allows."""
    return int(_POPCOUNT[np.ascontiguousarray(mask, dtype=np.int32).view(np.uint8)].sum())
