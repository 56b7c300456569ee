"""The sampling settings a request may carry, declared once.

Every surface takes its list from ``SETTINGS``: the request parser (``generation/request/params.py``, for
OpenAI bodies, OIP parameters and Triton's), OIP's string parameters (``serve/generation/oip.py``),
``kiln generate``'s options, the inputs of the Triton model ``kiln triton`` writes, and the docs.
Adding a setting is one line here, one field of ``SamplingParams`` and its use in the samplers; a
test checks that each setting reaches every surface (``tests/generation/request/test_sampling_settings.py``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ...errors import InvalidInputError

# How a setting's value is written: a number, a flag, or a list (repeatable on the command line).
FLOAT, INT, BOOL, STRINGS, INTS, BIAS = "float", "int", "bool", "strings", "ints", "bias"


@dataclass(frozen=True)
class Setting:
    name: str  # the request field: OpenAI's name, else vLLM's
    kind: str  # FLOAT, INT, BOOL, STRINGS, INTS or BIAS (OpenAI's {"token id": bias})
    help: str  # one line, for `kiln generate --help` and the docs
    wide: bool = False  # an integer past int32 (a seed): a 64-bit Triton input

    @property
    def triton_type(self) -> str:
        """The Triton input's data type (a list is a tensor of any length; a bias is JSON text)."""
        integer = "TYPE_INT64" if self.wide else "TYPE_INT32"
        return {FLOAT: "TYPE_FP32", INT: integer, BOOL: "TYPE_BOOL", STRINGS: "TYPE_STRING",
                INTS: "TYPE_INT64", BIAS: "TYPE_STRING"}[self.kind]

    @property
    def listed(self) -> bool:
        return self.kind in (STRINGS, INTS)


SETTINGS = (
    Setting("max_tokens", INT, "Stop after this many tokens (default: the artifact's)."),
    Setting("temperature", FLOAT, "0 is greedy (default: the artifact's setting)."),
    Setting("top_k", INT, "Sample among the k most likely tokens (0: off)."),
    Setting("top_p", FLOAT, "Sample among the most likely tokens that hold this much of the probability (1: off)."),
    Setting("min_p", FLOAT, "Sample among the tokens at least this share as likely as the most likely one (0: off)."),
    Setting("repetition_penalty", FLOAT, "> 1 makes tokens already in the prompt or answer less likely (1: off)."),
    Setting("frequency_penalty", FLOAT, "Lowers a token's logit by this times its count in the answer, in [-2, 2]."),
    Setting("presence_penalty", FLOAT, "Lowers the logit of a token already in the answer by this, in [-2, 2]."),
    Setting("logit_bias", BIAS, "Adds a bias in [-100, 100] to a token's logit: TOKEN_ID:BIAS (repeatable)."),
    Setting("seed", INT, "Random seed: the same seed gives the same answer.", wide=True),
    Setting("stop", STRINGS, "Stop string (repeatable); not included in the answer."),
    Setting("stop_token_ids", INTS, "A token id that ends the answer, besides the model's own (repeatable)."),
    Setting("ignore_eos", BOOL, "Keep generating after an end-of-sequence token."),
)
FLOAT_NAMES = tuple(s.name for s in SETTINGS if s.kind == FLOAT)


def from_tensor(setting: Setting, values: list[Any]) -> Any:
    """A Triton input's values (flattened, strings decoded) as the request field."""
    if setting.listed:
        return [v.decode("utf-8") if isinstance(v, bytes) else v for v in values]
    value = values[0]
    if setting.kind == BIAS:
        return json.loads(value.decode("utf-8") if isinstance(value, bytes) else value)
    return value


def from_command_line(setting: Setting, value: Any) -> Any:
    """A ``kiln generate`` option's value as the request field (None: not given)."""
    if value is None or value == [] or value is False:
        return None
    if setting.kind == BIAS:
        bias = {}
        for item in value:
            token, sep, amount = item.partition(":")
            try:
                if not sep:
                    raise ValueError(item)
                bias[token.strip()] = float(amount)
            except ValueError:
                raise InvalidInputError(f"--logit-bias takes TOKEN_ID:BIAS, got {item!r}") from None
        return bias
    return list(value) if setting.listed else value
