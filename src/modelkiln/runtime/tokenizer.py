"""Text → model input tensors with the fast `tokenizers` library only (no transformers).

Tokenizing and padding are separate steps on purpose: the server tokenizes each request as it
arrives (to know its token count for the batch budget) and pads only when a batch is formed."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tokenizers import Encoding, Tokenizer

from ..errors import ArtifactError
from ..manifest import TokenizerSpec

TextInput = str | tuple[str, str]

# Tensor name → the Encoding attribute that holds it.
_ENCODING_FIELDS = {
    "input_ids": "ids",
    "attention_mask": "attention_mask",
    "token_type_ids": "type_ids",
}


class TextEncoder:
    """Tokenizes texts (or text pairs) and pads them into the model's int64 input tensors."""

    def __init__(self, tokenizer: Tokenizer, spec: TokenizerSpec, input_names: Sequence[str], max_length: int):
        unknown = [n for n in input_names if n not in _ENCODING_FIELDS]
        if unknown:
            raise ArtifactError(f"model inputs {unknown} cannot be produced by a tokenizer")
        self.input_names = list(input_names)
        self.max_length = max_length
        self.spec = spec
        self._tokenizer = tokenizer
        # Padding is ours (see collate); truncation is the tokenizer's, configured once and never
        # changed afterwards, so the object can be shared by threads.
        tokenizer.no_padding()
        tokenizer.enable_truncation(max_length, strategy=spec.truncation)

    @classmethod
    def from_folder(cls, folder: Path | str, spec: TokenizerSpec, input_names: Sequence[str], max_length: int) -> TextEncoder:
        path = Path(folder) / spec.file
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception for missing/corrupt files
            raise ArtifactError(f"cannot load tokenizer {path}: {exc}") from exc
        return cls(tokenizer, spec, input_names, max_length)

    # -- tokenizing ------------------------------------------------------------------------
    def tokenize(self, texts: Sequence[TextInput]) -> list[Encoding]:
        """Tokenize a batch (Rust, parallel, releases the GIL); truncated to ``max_length``.
        One text is encoded directly: a batch call wakes the tokenizer's thread pool for nothing."""
        if len(texts) == 1:
            text = texts[0]
            return [self._tokenizer.encode(*text) if isinstance(text, tuple) else self._tokenizer.encode(text)]
        return self._tokenizer.encode_batch(list(texts))

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def max_type_id(self) -> int:
        """The largest token type id this tokenizer produces (1 for BERT's pairs, 0 for RoBERTa)."""
        try:
            return max(self._tokenizer.encode("a", "b").type_ids)
        except Exception:  # a tokenizer without a pair template: single texts only, type 0
            return max(self._tokenizer.encode("a").type_ids, default=0)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids))

    # -- padding ---------------------------------------------------------------------------
    def collate(self, encodings: Sequence[Encoding], pad_to: int | None = None) -> dict[str, np.ndarray]:
        """Pad encodings to the longest one (or ``pad_to``) and stack them into int64 arrays."""
        width = max(len(e.ids) for e in encodings)
        if pad_to is not None:
            width = max(width, pad_to)
        feeds: dict[str, np.ndarray] = {}
        for name in self.input_names:
            fill = self.spec.pad_token_id if name == "input_ids" else 0
            array = np.full((len(encodings), width), fill, dtype=np.int64)
            attr = _ENCODING_FIELDS[name]
            for row, enc in enumerate(encodings):
                values = getattr(enc, attr)
                array[row, : len(values)] = values
            feeds[name] = array
        return feeds

    def encode(self, texts: Sequence[TextInput]) -> tuple[dict[str, np.ndarray], list[Encoding]]:
        encodings = self.tokenize(texts)
        return self.collate(encodings), encodings
