"""Drafters: cheap guesses at the tokens that follow a sequence, which the engine verifies in one
call (``plan.StepPlan.drafts``). A wrong guess costs time, never a different answer.

``NgramDrafter`` is prompt lookup (vLLM's ``ngram`` method): find the sequence's last n tokens
earlier in its prompt + answer and propose the tokens that followed them there. Answers that quote
their input (extraction, rewriting, editing code) repeat long runs of it. The other drafter, a
smaller model's greedy tokens, is ``draft_model.py``'s."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

# n-gram lengths tried, longest first (vLLM's prompt_lookup_max and _min). A single token matches
# almost anywhere, and its proposals are accepted less often, but the policy drafts only as many
# tokens as the request's acceptance pays for: on SmolLM2-135M's answers to the benchmark's prompts
# (benchmarks/generation/speculation.py), replayed with the measured call costs, 3..1 gave 1.53x
# (greedy, answers quoting their prompt) and 1.24x (open chat) the plain rate, 4..2 1.49x and 1.23x.
MAX_NGRAM = 3
MIN_NGRAM = 1


class Drafter(Protocol):
    # True where a proposal costs time per token (a model's call each): the speculator asks for as
    # many as it would verify, and now and then one to go on measuring the acceptance
    costly: bool

    @property
    def token_seconds(self) -> float: ...  # what a proposed token costs, measured (0: nothing to speak of)

    def extend(self, tokens: Iterable[int]) -> None: ...  # tokens appended to the sequence
    def propose(self, k: int) -> list[int]: ...  # at most k tokens to follow the sequence (maybe none)
    def close(self) -> None: ...  # the request ended: give back what it holds


class NgramDrafter:
    """Prompt lookup over one sequence's tokens. An index from each n-gram to where its latest
    occurrence ended (the n-grams that already have a token after them) makes a proposal cost
    ``MAX_NGRAM - MIN_NGRAM + 1`` dictionary lookups, and a token as many insertions."""

    costly = False
    token_seconds = 0.0

    def __init__(self, tokens: Iterable[int] = (), min_n: int = MIN_NGRAM, max_n: int = MAX_NGRAM):
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], int] = {}  # n-gram -> the end of its latest occurrence before the last token
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            # the n-grams ending at the last token get their continuation now: index them
            end = len(self.tokens)
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._ends[tuple(self.tokens[end - n:end])] = end
            self.tokens.append(token)

    def propose(self, k: int) -> list[int]:
        """The tokens that followed the latest earlier occurrence of the longest suffix found (at
        most ``k``; none when no suffix of ``MIN_NGRAM`` or more tokens occurred before)."""
        length = len(self.tokens)
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            end = self._ends.get(tuple(self.tokens[length - n:]))
            if end is not None:
                return self._copy(end, k)
        return []

    def _copy(self, start: int, k: int) -> list[int]:
        """k tokens from ``start`` on; where they run past the sequence's end, the copy goes on from
        its own beginning (LZ77's overlapping copy): a repeating stretch proposes its next period."""
        proposal: list[int] = []
        length = len(self.tokens)
        for i in range(start, start + k):
            proposal.append(self.tokens[i] if i < length else proposal[i - length])
        return proposal

    def close(self) -> None:
        """Nothing held but its own lists."""
