"""A model's vocabulary as bytes: what each token id spells, exactly (half a UTF-8 character
included), for any tokenizer ``tokenizers`` loads (byte-level BPE, SentencePiece with byte
fallback...). The grammar engine reads the vocabulary through it (structured_output/grammars.py), and OpenAI's
log-probabilities report each token's text and bytes from it.

Built from ``tokenizer.json`` by llguidance (about 0.2 s for 49,152 tokens), once per model."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np

from . import bitmask
from tokenizers import Tokenizer


class Vocabulary:
    def __init__(self, tokenizer: Tokenizer, eos_ids: Sequence[int]):
        import llguidance

        self.size = tokenizer.get_vocab_size()  # with added tokens; a model's logits may be wider (padding)
        self.eos_ids = tuple(eos_ids)
        # llguidance's tokenizer: each token's bytes, and what its grammars are matched against
        self.llg: Any = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=self.size, eos_token=list(eos_ids) or None)
        self.token_bytes = lru_cache(maxsize=1 << 16)(self._token_bytes)
        self.usable_words = _usable_words(tokenizer, self.size)

    def _token_bytes(self, token_id: int) -> bytes:
        """The bytes ``token_id`` spells (a special token: its text); b'' outside the vocabulary."""
        if not 0 <= token_id < self.size:
            return b""
        return self.llg.decode_bytes([token_id])

    def token_text(self, token_id: int) -> str:
        """The token as text: bytes that are not whole UTF-8 characters become U+FFFD (OpenAI's
        ``token`` field; its ``bytes`` field has the exact bytes)."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")


def _usable_words(tokenizer: Tokenizer, size: int) -> np.ndarray | None:
    """The tokens a grammar may allow, as int32 words of bits, or None for all. Not allowed: the
    placeholders llama.cpp's convert_hf_to_gguf pads a vocabulary with up to the embedding's rows
    (token i spelled "[PAD<i>]", typed UNUSED in the GGUF; 102,784 of a Qwen2.5-shape file's
    151,936 with a smaller tokenizer). They spell ordinary text, so a JSON string could take them,
    and an untrained row's logit can win: a random-weight 0.5B wrote "[PAD147819]" 250 times."""
    placeholders = [i for text, i in tokenizer.get_vocab(with_added_tokens=True).items()
                    if text.startswith("[PAD") and text == f"[PAD{i}]"]
    if not placeholders:
        return None
    allowed = np.ones(bitmask.words(size) * bitmask.BITS, dtype=bool)  # the padding past the vocabulary too
    allowed[placeholders] = False
    return bitmask.from_bool(allowed)
