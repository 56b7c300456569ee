"""What one request asks of the sampler: ``SamplingParams``, checked once where it is made."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ...errors import InvalidInputError

MAX_LOGPROBS = 20  # most alternatives per token (OpenAI's top_logprobs limit)


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks for. ``temperature == 0`` means greedy (and ignores top-k/top-p/min-p/seed)."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    # 0.0: off; keeps the tokens at least min_p times as likely as the most likely one (after top-k and
    # top-p, Hugging Face's order), as llama.cpp's and vLLM's min_p
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # 1.0: off; > 1 discourages tokens already in prompt or answer
    seed: int | None = None  # None: a fresh random seed (not reproducible)
    stop: tuple[str, ...] = ()  # stop strings, matched in the text (across token boundaries)
    stop_token_ids: tuple[int, ...] = ()  # in addition to the model's end-of-sequence ids
    ignore_eos: bool = False  # keep going after an end-of-sequence token (load tests)
    # OpenAI's penalties: each subtracts from a token's logit, by how often (frequency) or whether
    # (presence) it appears in the answer so far (not the prompt), both in [-2, 2]
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]) added to the logits
    logprobs: int | None = None  # None: none; k >= 0: the chosen token's log-probability and the k most likely
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (completions' echo)
    # a compiled grammar (generation/structured_output/grammars.py) every token must keep the answer inside
    constraint: Any = field(default=None, compare=False)
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        # Every check is written so that NaN fails it (NaN compares false with anything).
        if not self.max_new_tokens >= 1:
            raise InvalidInputError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if not 0 <= self.temperature < math.inf:
            raise InvalidInputError(f"'temperature' must be >= 0 and finite, got {self.temperature}")
        if not self.top_k >= 0:
            raise InvalidInputError(f"'top_k' must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidInputError(f"'top_p' must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidInputError(f"'min_p' must be in [0, 1], got {self.min_p}")
        if not 0 < self.repetition_penalty < math.inf:
            raise InvalidInputError(f"'repetition_penalty' must be > 0 and finite, got {self.repetition_penalty}")
        if self.seed is not None and not 0 <= self.seed < 2**64:  # numpy refuses negative seeds; 64-bit as OpenAI's
            raise InvalidInputError(f"'seed' must be in [0, 2**64), got {self.seed}")
        if any(not s for s in self.stop):
            raise InvalidInputError("stop strings must not be empty")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidInputError(f"'{name}' must be in [-2, 2], got {getattr(self, name)}")
        for token, bias in self.logit_bias:
            if not -100.0 <= bias <= 100.0:
                raise InvalidInputError(f"logit_bias for token {token} must be in [-100, 100], got {bias}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise InvalidInputError(f"'{name}' must be in [0, {MAX_LOGPROBS}], got {value}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
