"""When to speculate, and how many tokens: one ``Speculator`` per request, and the measured cost
of a decode call by the tokens it feeds (``CallCosts``), both kept by the core.

A drafted token costs a verify call time whether it is accepted or not, so the core drafts only
where it expects to gain: while the decode batch is small (``MAX_ROWS``: with many rows a step
already shares the weights' reads among them), and k tokens where the request's own acceptance
makes them pay for what k more tokens cost the call (``best_length``). Acceptance is measured per
request, recent drafts counting most; a proposal not worth verifying is still checked against the
token that came, so a request whose text starts to repeat its input is drafted for again. The cost
is measured, per number of tokens fed: on SmolLM2-135M (GGUF, KilnAttention, 2 threads, AMD EPYC
Zen 5) a call of 1 token took 6.2 ms, 2: 6.6, 3: 7.7, 4: 9.6, 5: 10.9, 9: ~14, 17: ~21 (kiln's
GgufMatMul multiplies a weight tile with up to 4 tokens at once); a larger model's extra tokens
cost less of a call."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .drafters import Drafter

# Speculate only while at most this many sequences decode together. Measured on SmolLM2-135M (2 threads,
# AMD EPYC Zen 5, 16 prompts quoting their input, n at a time, 96 tokens each, speculation allowed at
# any batch size), speculative / plain tokens/s: 1 stream 1.07-1.11, 2: 1.03-1.05, 4: 0.96-0.97,
# 8: 0.93-0.94. Each row's k is chosen for the call's measured cost, but every row's drafts delay
# all the others, and with more rows a step shares its weight reads among them already.
MAX_ROWS = 2
# A token's cost in a call, as a share of a one-token call, where no call of that size was measured
# yet: more than measured from 2 to 4 tokens, so that the first drafts are short, then measured.
VERIFY_TOKEN_COST = 0.15
COST_WEIGHT = 0.25  # what a new measurement of a call's seconds weighs against the earlier ones
# A costly drafter (a draft model) whose tokens do not pay is asked for one token every this many
# steps, to notice when its acceptance rises (each probe costs draft-model calls: the tokens since
# the last one, then the drafted one); never where even every draft accepted would not pay.
PROBE_EVERY = 32
DECAY = 0.9  # what earlier observations of a request's acceptance weigh at each new one
PRIOR = (1.0, 2.0)  # (accepted, tried) before any observation: one in two


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a verify call of k drafted tokens emits, each accepted with ``acceptance`` once those
    before it were: 1 + a + a^2 + ... + a^k."""
    return sum(acceptance ** i for i in range(k + 1))


def best_length(acceptance: float, most: int, rows: int, cost: Callable[[int], float] | None = None) -> int:
    """The number of drafted tokens (0..most) that gives the decode batch of ``rows`` the most tokens
    per unit of time; ``cost(k)``: the call's time with k more tokens (default: a row's step 1, each
    further token ``VERIFY_TOKEN_COST``)."""
    def linear(k: int) -> float:
        return 1 + VERIFY_TOKEN_COST * (rows - 1 + k)

    price = cost or linear
    return max(range(most + 1), key=lambda k: (rows - 1 + expected_tokens(acceptance, k)) / price(k))


class CallCosts:
    """Seconds of a decode call by the number of tokens it feeds (rows + drafted tokens), measured
    (a decayed mean; a sample more than twice the estimate counts as twice it: another process
    took the cores). A size not measured yet is estimated from the nearest measured one."""

    def __init__(self) -> None:
        self._seconds: dict[int, float] = {}

    def record(self, tokens: int, seconds: float) -> None:
        old = self._seconds.get(tokens)
        if old is None:
            self._seconds[tokens] = min(seconds, 2 * self.estimate(tokens)) if self._seconds else seconds
        else:
            self._seconds[tokens] = old + COST_WEIGHT * (min(seconds, 2 * old) - old)

    def estimate(self, tokens: int) -> float:
        """Seconds of a call of ``tokens`` (in units of a one-token call before anything was measured)."""
        if tokens in self._seconds:
            return self._seconds[tokens]
        below = [n for n in self._seconds if n < tokens]
        near = max(below) if below else min(self._seconds, default=None)
        if near is None:
            return _linear(tokens)
        return self._seconds[near] * _linear(tokens) / _linear(near)

    def relative(self, base: int, draft_seconds: float = 0.0) -> Callable[[int], float]:
        """The cost of a call of ``base + k`` tokens against one of ``base``, as a function of k;
        ``draft_seconds``: what drafting each of the k tokens costs besides (a draft model's call),
        counted once a call's seconds are known."""
        unit = self.estimate(base)
        extra = draft_seconds if self._seconds else 0.0
        return lambda k: (self.estimate(base + k) + k * extra) / unit


def _linear(tokens: int) -> float:
    return 1 + VERIFY_TOKEN_COST * (tokens - 1)


class Speculator:
    """One request's drafter and the measure of its acceptance."""

    def __init__(self, drafter: Drafter, max_draft: int):
        self.drafter = drafter
        self.max_draft = max_draft
        self._accepted, self._tried = PRIOR
        self._given = 0  # answer tokens handed to the drafter
        self._unverified: int | None = None  # the first token of the last proposal not verified
        self._steps_since_probe = 0  # a costly drafter's steps without a proposal

    @property
    def acceptance(self) -> float:
        return self._accepted / self._tried

    def draft(self, answer: Sequence[int], limit: int, rows: int, cost: Callable[[int], float] | None = None) -> list[int]:
        """Tokens to verify after ``answer``'s last one (maybe none): at most ``limit``; ``cost(k)``:
        the decode call's time with k more tokens, relative (``best_length``)."""
        self._follow(answer)
        most = min(self.max_draft, limit)
        if self.drafter.costly:  # each proposed token costs time: as many as would be verified
            paying = best_length(self.acceptance, most, rows, cost)
            self._steps_since_probe = 0 if paying else self._steps_since_probe + 1
            if not paying:  # one now and then, to see whether the acceptance rose: where that could pay
                if self._steps_since_probe < PROBE_EVERY or best_length(1.0, most, rows, cost) == 0:
                    return []
                paying, self._steps_since_probe = 1, 0
            most = paying
        proposal = self.drafter.propose(most)
        if not proposal:
            return []
        k = best_length(self.acceptance, len(proposal), rows, cost)
        if k == 0:
            self._unverified = proposal[0]
        return proposal[:k]

    def close(self) -> None:
        """The request ended: its drafter gives back what it holds (a draft model's cache slot)."""
        self.drafter.close()

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
