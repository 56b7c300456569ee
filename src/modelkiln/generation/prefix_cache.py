"""A prefix cache: the KV of prompt prefixes already computed, reused by later prompts that start
with the same tokens (vLLM's automatic prefix caching, llama-server's ``cache_prompt``).

Prompts are cut into blocks of ``BLOCK_TOKENS``; block i is keyed by a hash of every token up to its
end (a chain: the key of block i covers blocks 0..i), so a key names one exact prefix. A block holds
that prefix's last ``BLOCK_TOKENS`` positions of every layer's key and value. A new prompt takes the
longest chain of cached blocks it starts with (leaving at least its last token to compute: its
logits give the first answer token) and is prefilled from there.

A prompt seen whole before computes nothing: with its blocks, the cache keeps a ``Whole`` entry
holding the positions after its last full block and the logits of its last position, from which
the engine chooses the first token (a repeated prompt's time to first token is a copy). There are
at most ``MAX_WHOLE`` of them (a row of logits is the vocabulary's size), least recently used
first out.

Reuse changes no answer: the serving graph computes a position's key and value the same, bit for
bit, whether the prompt before it was prefilled in one call, in chunks, or restored from here
(every op works row by row, and GroupQueryAttention over each row's own length).

Blocks are evicted least recently used first, with their descendants (a chain without its start is
unreachable), whenever the cache would hold more than ``max_tokens`` or the engine core needs the
memory for running sequences: what the cache takes is bounded, so a server's memory stays flat."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import KilnError

# Small blocks reuse more of a prompt (only whole blocks are reused): a chat template's system prompt is
# often 20-30 tokens. A block costs one dictionary entry and one copy in and out.
BLOCK_TOKENS = 8
MAX_WHOLE = 32  # whole prompts kept with their last logits (151,936 floats each for Qwen2.5's vocabulary)
# A block's KV and a prompt's last logits are the engine's arrays: numpy on the host engines, torch
# tensors on the torch engine's device (kept there: a restore is a copy on the device).
Array = Any
ReadKv = Callable[[int, int], Array]  # (start, stop) -> a copy of those positions' KV


@dataclass
class _Block:
    key: int
    parent: int | None
    tokens: tuple[int, ...]
    kv: Array  # [layer key/value, kv_heads, BLOCK_TOKENS, head_dim]
    children: set[int] = field(default_factory=set)


@dataclass
class Whole:
    """A whole prompt: the KV of its positions after the last full block, its last position's logits."""

    tokens: tuple[int, ...]
    tail_kv: Array  # [layer key/value, kv_heads, len(tokens) % block, head_dim]
    logits: Array


class PrefixCache:
    def __init__(self, max_tokens: int, block_tokens: int = BLOCK_TOKENS):
        self.max_tokens = max_tokens
        self.block_tokens = block_tokens
        self._blocks: OrderedDict[int, _Block] = OrderedDict()  # least recently used first
        self._wholes: OrderedDict[tuple[int, ...], Whole] = OrderedDict()
        self.queried_tokens = 0  # prompt tokens looked up
        self.hit_tokens = 0  # of which restored from the cache

    @property
    def tokens(self) -> int:
        """Tokens of KV the cache holds (what it costs in the KV budget)."""
        return len(self._blocks) * self.block_tokens + sum(w.tail_kv.shape[2] for w in self._wholes.values())

    def _keys(self, token_ids: Sequence[int], blocks: int) -> list[tuple[int, tuple[int, ...]]]:
        keys, parent = [], None
        for b in range(blocks):
            tokens = tuple(token_ids[b * self.block_tokens:(b + 1) * self.block_tokens])
            parent = hash((parent, tokens))
            keys.append((parent, tokens))
        return keys

    def lookup(self, token_ids: Sequence[int], count: bool = True) -> tuple[list[_Block], Whole | None]:
        """The cached blocks the prompt starts with, marked used, and its ``Whole`` entry when the
        prompt was seen whole (then every block is there and nothing needs computing); without
        one, at most all but its last token. ``count``: record the query in the hit statistics."""
        whole = self._wholes.get(tuple(token_ids))
        blocks = len(token_ids) // self.block_tokens if whole is not None else (len(token_ids) - 1) // self.block_tokens
        found: list[_Block] = []
        for key, tokens in self._keys(token_ids, blocks):
            block = self._blocks.get(key)
            if block is None or block.tokens != tokens:
                break
            found.append(block)
        if whole is not None and len(found) < blocks:  # some of its blocks were evicted: blocks only
            whole, found = None, found[:(len(token_ids) - 1) // self.block_tokens]
        for block in found:
            self._blocks.move_to_end(block.key)
        if whole is not None:
            self._wholes.move_to_end(tuple(token_ids))
        if count:
            self.queried_tokens += len(token_ids)
            self.hit_tokens += len(token_ids) if whole is not None else len(found) * self.block_tokens
        return found, whole

    def restore(self, token_ids: Sequence[int], tokens: int) -> tuple[list[_Block], Whole | None]:
        """What a new sequence whose prompt is ``token_ids`` restores: the blocks in order, and its
        ``Whole`` entry when the whole prompt was seen (then ``tokens`` is the prompt's length).
        ``tokens`` is what ``cached_tokens`` said when the step was planned; anything else is the
        engine's error, not the request's."""
        blocks, whole = self.lookup(token_ids, count=False)
        restored = len(token_ids) if whole is not None else len(blocks) * self.block_tokens
        if restored != tokens:
            raise KilnError(f"the prefix cache holds {restored} tokens of this prompt, not the {tokens} planned")
        return blocks, whole

    def cached_tokens(self, token_ids: Sequence[int]) -> int:
        """How many of the prompt's tokens ``lookup`` restores (all of them for a ``Whole`` hit)."""
        blocks, whole = self.lookup(token_ids)
        return len(token_ids) if whole is not None else len(blocks) * self.block_tokens

    def insert(self, token_ids: Sequence[int], read_kv: ReadKv, last_logits: Array | None = None) -> int:
        """Cache every full block of ``token_ids`` not cached yet; ``read_kv(start, stop)`` returns
        a copy of those positions' KV. With ``last_logits`` (and room), the whole prompt too.
        Returns the tokens added."""
        added = self._insert_blocks(token_ids, read_kv)
        fits = len(token_ids) <= self.max_tokens
        if last_logits is not None and fits and tuple(token_ids) not in self._wholes:
            tail = len(token_ids) // self.block_tokens * self.block_tokens
            self._wholes[tuple(token_ids)] = Whole(tuple(token_ids), read_kv(tail, len(token_ids)), _copy(last_logits))
            added += len(token_ids) - tail
            while len(self._wholes) > MAX_WHOLE:
                self._wholes.popitem(last=False)
        if self.tokens > self.max_tokens:  # the oldest make room (never this prompt's: just used)
            self.evict(self.tokens - self.max_tokens)
        return added

    def _insert_blocks(self, token_ids: Sequence[int], read_kv: ReadKv) -> int:
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
        return added

    def evict(self, tokens: int) -> int:
        """Free at least ``tokens`` tokens (or everything), least recently used first: whole-prompt
        entries, then block chains. Returns the tokens freed."""
        freed = 0
        while self._wholes and freed < tokens:
            freed += self._wholes.popitem(last=False)[1].tail_kv.shape[2]
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
        self._wholes.clear()


def _copy(array: Array) -> Array:
    """A copy the cache owns (the engine reuses its buffers): numpy's ``copy`` or torch's ``clone``."""
    return array.clone() if hasattr(array, "clone") else array.copy()
