"""Incremental detokenization: token ids in, text out as soon as it is whole.

Decoding one token at a time is wrong twice over: a byte-level token can hold half of a UTF-8
character (the decoder then yields U+FFFD), and some decoders change a token's text by what
precedes it (SentencePiece's leading space). So, as text-generation-inference does, we decode a
window that starts at the previously emitted chunk, emit only what the newest tokens add, and
hold it back while it ends in a replacement character."""

from __future__ import annotations

from tokenizers import Tokenizer

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT = 5  # prompt tokens used as decoding context for the first generated token


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-_PROMPT_CONTEXT:]) if prompt_ids else []
        self._prefix = 0  # start of the decoding window
        self._read = len(self._ids)  # tokens before this index have been emitted

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes ('' while a character is incomplete)."""
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix:self._read])
        now = self._decode(self._ids[self._prefix:])
        if len(now) <= len(before) or now.endswith(_REPLACEMENT):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return now[len(before):]

    def flush(self) -> str:
        """What is still held when generation ends (an incomplete character comes out as U+FFFD)."""
        before = self._decode(self._ids[self._prefix:self._read])
        now = self._decode(self._ids[self._prefix:])
        self._prefix, self._read = self._read, len(self._ids)
        return now[len(before):]
