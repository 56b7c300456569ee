"""Speculative decoding whose answers are plain decoding's, bit for bit: a drafter guesses the
tokens that follow a decoding sequence, the engine runs them in one call with the sequence's next
token and chooses the token at each position exactly as its decode steps would, keeping the
guesses while they equal its choices (``plan.StepPlan.drafts``). Only on engines whose positions
are the same bits in a chunk as in a decode step (``EngineCapabilities.verifies_drafts``: the
serving graph with KilnAttention). ``drafters.py``: what is guessed (prompt lookup);
``draft_model.py``: a smaller model's guesses; ``policy.py``: when, and how many. The command-line
options of ``kiln serve`` and ``kiln generate`` are declared here."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .draft_model import DraftEngine, DraftModel, DraftModelDrafter
from .drafters import Drafter, NgramDrafter
from .policy import MAX_ROWS, CallCosts, Speculator

DRAFT_MODEL = "draft-model"
METHODS = ("off", "ngram", DRAFT_MODEL)
DEFAULT_DRAFT_TOKENS = 8
METHOD_HELP = ("Speculative decoding (answers unchanged): ngram drafts the tokens that followed the answer's last "
               "few tokens earlier in prompt + answer (fast on answers that quote their input); draft-model: a "
               "smaller model with the same tokenizer drafts greedily (--draft-model); off: none. Only on GGUF "
               "variants with kiln's attention operator, while at most 2 streams decode.")
DRAFT_TOKENS_HELP = "Speculative decoding: the most tokens drafted a step (fewer where few are accepted)."
DRAFT_MODEL_HELP = ("Speculative decoding with --speculate draft-model: a smaller text-generation artifact (folder) with "
                    "the same tokenizer, whose default variant drafts greedily (a GGUF variant with kiln's attention "
                    "operator, or another serving graph).")


@dataclass(frozen=True)
class SpeculationOptions:
    """``draft_model``: the draft model's artifact folder (method ``draft-model``; opened by
    ``TextGenerationModel.core``, which hands the core its engine)."""

    method: str = "off"
    draft_tokens: int = DEFAULT_DRAFT_TOKENS
    draft_model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculation method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.draft_tokens < 1:
            raise ValueError(f"draft tokens must be at least 1, got {self.draft_tokens}")
        if self.method == DRAFT_MODEL and not self.draft_model:
            raise ValueError("--speculate draft-model needs --draft-model ARTIFACT (a smaller text-generation "
                             "artifact with the same tokenizer)")

    @property
    def on(self) -> bool:
        return self.method != "off"

    def speculator(self, prompt_ids: Sequence[int], draft_model: DraftModel | None = None) -> Speculator:
        """One request's speculator; ``draft_model``: the draft model's engine (method ``draft-model``)."""
        if self.method == DRAFT_MODEL:
            if draft_model is None:
                raise ValueError("--speculate draft-model: the draft model's engine was not opened")
            return Speculator(draft_model.drafter(prompt_ids), self.draft_tokens)
        return Speculator(NgramDrafter(prompt_ids), self.draft_tokens)


__all__ = ["CallCosts", "DEFAULT_DRAFT_TOKENS", "DRAFT_MODEL", "DRAFT_MODEL_HELP", "DraftEngine", "DraftModel", "DraftModelDrafter", "Drafter",
           "MAX_ROWS", "METHODS", "NgramDrafter", "SpeculationOptions", "Speculator"]
