"""Speculative decoding whose answers are plain decoding's, bit for bit: a drafter guesses the
tokens that follow a decoding sequence, the engine runs them in one call with the sequence's next
token and chooses the token at each position exactly as its decode steps would, keeping the
guesses while they equal its choices (``plan.StepPlan.drafts``). Only on engines whose positions
are the same bits in a chunk as in a decode step (``EngineCapabilities.verifies_drafts``: the
serving graph with KilnAttention). ``drafters.py``: what is guessed; ``policy.py``: when, and how
many. The command-line options of ``kiln serve`` and ``kiln generate`` are declared here."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .drafters import Drafter, NgramDrafter
from .policy import MAX_ROWS, CallCosts, Speculator

METHODS = ("off", "ngram")
DEFAULT_DRAFT_TOKENS = 8
METHOD_HELP = ("Speculative decoding (answers unchanged): ngram drafts the tokens that followed the answer's last "
               "few tokens earlier in prompt + answer (fast on answers that quote their input); off: none. Only "
               "on GGUF variants with kiln's attention operator, while at most 2 streams decode.")
DRAFT_TOKENS_HELP = "Speculative decoding: the most tokens drafted a step (fewer where few are accepted)."


@dataclass(frozen=True)
class SpeculationOptions:
    method: str = "off"
    draft_tokens: int = DEFAULT_DRAFT_TOKENS

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculation method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.draft_tokens < 1:
            raise ValueError(f"draft tokens must be at least 1, got {self.draft_tokens}")

    @property
    def on(self) -> bool:
        return self.method != "off"

    def speculator(self, prompt_ids: Sequence[int]) -> Speculator:
        return Speculator(NgramDrafter(prompt_ids), self.draft_tokens)


__all__ = ["CallCosts", "DEFAULT_DRAFT_TOKENS", "Drafter", "MAX_ROWS", "METHODS", "NgramDrafter", "SpeculationOptions", "Speculator"]
