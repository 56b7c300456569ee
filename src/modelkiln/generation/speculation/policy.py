"""When to speculate, and how many tokens: one ``Speculator`` per request, kept by the core.

A drafted token costs a verify call part of a decode step whether it is accepted or not, so the
core drafts only where it expects to gain: while the decode batch is small (``MAX_ROWS``: with many
rows a step already shares the weights' reads among them), and k tokens where the request's own
acceptance makes them pay (``best_length``). Acceptance is measured per request, recent drafts
counting most; a proposal not worth verifying is still checked against the token that came, so a
request whose text starts to repeat its input is drafted for again."""

from __future__ import annotations

from collections.abc import Sequence

from .drafters import Drafter

MAX_ROWS = 4  # speculate only while at most this many sequences decode together
# A drafted token's cost in a verify call, in decode steps of one row: SmolLM2-135M (GGUF, KilnAttention),
# 2 threads, AMD EPYC Zen 5: one token 6.2 ms, 5 tokens 10.9, 9 tokens ~14.3, 17 tokens ~21.3. Larger
# models read more weights per step, so their extra tokens cost less of one: this errs on the safe side.
VERIFY_TOKEN_COST = 0.15
DECAY = 0.9  # what earlier observations of a request's acceptance weigh at each new one
PRIOR = (1.0, 2.0)  # (accepted, tried) before any observation: one in two


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a verify call of k drafted tokens emits, each accepted with ``acceptance`` once those
    before it were: 1 + a + a^2 + ... + a^k."""
    return sum(acceptance ** i for i in range(k + 1))


def best_length(acceptance: float, most: int, rows: int) -> int:
    """The number of drafted tokens (0..most) that gives the decode batch of ``rows`` the most tokens
    per unit of time, one row's step costing 1 and each further token in the call ``VERIFY_TOKEN_COST``."""
    base = 1 + VERIFY_TOKEN_COST * (rows - 1)

    def rate(k: int) -> float:
        return (rows - 1 + expected_tokens(acceptance, k)) / (base + VERIFY_TOKEN_COST * k)

    return max(range(most + 1), key=rate)


class Speculator:
    """One request's drafter and the measure of its acceptance."""

    def __init__(self, drafter: Drafter, max_draft: int):
        self.drafter = drafter
        self.max_draft = max_draft
        self._accepted, self._tried = PRIOR
        self._given = 0  # answer tokens handed to the drafter
        self._unverified: int | None = None  # the first token of the last proposal not verified

    @property
    def acceptance(self) -> float:
        return self._accepted / self._tried

    def draft(self, answer: Sequence[int], limit: int, rows: int) -> list[int]:
        """Tokens to verify after ``answer``'s last one (maybe none): at most ``limit``."""
        self._follow(answer)
        proposal = self.drafter.propose(min(self.max_draft, limit))
        if not proposal:
            return []
        k = best_length(self.acceptance, len(proposal), rows)
        if k == 0:
            self._unverified = proposal[0]
        return proposal[:k]

    def verified(self, drafted: int, accepted: int) -> None:
        """A verify call kept ``accepted`` of ``drafted`` tokens (the first refused one counts too)."""
        self._observe(accepted, accepted + (accepted < drafted))

    def _follow(self, answer: Sequence[int]) -> None:
        new = answer[self._given:]
        if new and self._unverified is not None:  # would the proposal not verified have been accepted?
            self._observe(int(new[0] == self._unverified), 1)
        self._unverified = None
        self.drafter.extend(new)
        self._given = len(answer)

    def _observe(self, accepted: int, tried: int) -> None:
        self._accepted = self._accepted * DECAY + accepted
        self._tried = self._tried * DECAY + tried
