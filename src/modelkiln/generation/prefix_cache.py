"""A prefix cache: the KV of prompt prefixes already computed, reused by later prompts that start
with the same tokens (vLLM's automatic prefix caching, llama-server's ``cache_prompt``).

Prompts are cut into blocks of ``BLOCK_TOKENS``; block i is keyed by a hash of every token up to its
end (a chain: the key of block i covers blocks 0..i), so a key names one exact prefix. A block holds
that prefix's last ``BLOCK_TOKENS`` positions of every layer's key and value. A new prompt takes the
longest chain of cached blocks it starts with (leaving at least its last token to compute: its
logits give the first answer token) and is prefilled from there.

Reuse changes no answer: the serving graph computes a position's key and value the same, bit for
bit, whether the prompt before it was prefilled in one call, in chunks, or restored from here
(every op works row by row, and GroupQueryAttention over each row's own length).

Blocks are evicted least recently used first, with their descendants (a chain without its start is
unreachable), whenever the cache would hold more than ``max_tokens`` or the engine core needs the
memory for running sequences: what the cache takes is bounded, so a server's memory stays flat."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

# Small blocks reuse more of a prompt (only whole blocks are reused): a chat template's system prompt is
# often 20-30 tokens. A block costs one dictionary entry and one copy in and out.
BLOCK_TOKENS = 8
DEFAULT_MAX_TOKENS = 4096  # outside kiln serve, which sizes it from its KV budget


@dataclass
class _Block:
    key: int
    parent: int | None
    tokens: tuple[int, ...]
    kv: np.ndarray  # [layer key/value, kv_heads, BLOCK_TOKENS, head_dim]
    children: set[int] = field(default_factory=set)


class PrefixCache:
    def __init__(self, max_tokens: int, block_tokens: int = BLOCK_TOKENS):
        self.max_tokens = max_tokens
        self.block_tokens = block_tokens
        self._blocks: OrderedDict[int, _Block] = OrderedDict()  # least recently used first
        self.queried_tokens = 0  # prompt tokens looked up
        self.hit_tokens = 0  # of which restored from the cache

    @property
    def tokens(self) -> int:
        """Tokens of KV the cache holds (what it costs in the KV budget)."""
        return len(self._blocks) * self.block_tokens

    def _keys(self, token_ids: Sequence[int], blocks: int) -> list[tuple[int, tuple[int, ...]]]:
        keys, parent = [], None
        for b in range(blocks):
            tokens = tuple(token_ids[b * self.block_tokens:(b + 1) * self.block_tokens])
            parent = hash((parent, tokens))
            keys.append((parent, tokens))
        return keys

    def lookup(self, token_ids: Sequence[int]) -> list[_Block]:
        """The cached blocks the prompt starts with (at most all but its last token), marked used."""
        found: list[_Block] = []
        for key, tokens in self._keys(token_ids, (len(token_ids) - 1) // self.block_tokens):
            block = self._blocks.get(key)
            if block is None or block.tokens != tokens:
                break
            found.append(block)
        for block in found:
            self._blocks.move_to_end(block.key)
        self.queried_tokens += len(token_ids)
        self.hit_tokens += len(found) * self.block_tokens
        return found

    def insert(self, token_ids: Sequence[int], read_kv) -> int:  # type: ignore[no-untyped-def]
        """Cache every full block of ``token_ids`` not cached yet; ``read_kv(start, stop)`` returns
        a copy of those positions' KV. Returns the tokens added."""
        added, parent = 0, None
        blocks = min(len(token_ids), self.max_tokens) // self.block_tokens
        for b, (key, tokens) in enumerate(self._keys(token_ids, blocks)):
            block = self._blocks.get(key)
            if block is None or block.tokens != tokens:
                start = b * self.block_tokens
                block = _Block(key, parent, tokens, read_kv(start, start + self.block_tokens))
                self._blocks[key] = block
                if parent is not None and parent in self._blocks:
                    self._blocks[parent].children.add(key)
                added += self.block_tokens
            self._blocks.move_to_end(key)
            parent = key
        if self.tokens > self.max_tokens:  # the oldest chains make room (never this prompt's: just used)
            self.evict(self.tokens - self.max_tokens)
        return added

    def evict(self, tokens: int) -> int:
        """Free at least ``tokens`` tokens (or everything), least recently used first. Returns the
        tokens freed."""
        freed = 0
        while self._blocks and freed < tokens:
            freed += self._drop(next(iter(self._blocks)))
        return freed

    def _drop(self, key: int) -> int:
        block = self._blocks.pop(key, None)
        if block is None:
            return 0
        if block.parent is not None and block.parent in self._blocks:
            self._blocks[block.parent].children.discard(key)
        return self.block_tokens + sum(self._drop(child) for child in list(block.children))

    def clear(self) -> None:
        self._blocks.clear()
