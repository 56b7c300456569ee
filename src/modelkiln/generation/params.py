"""Request fields → ``SamplingParams``, checked once for every protocol (OpenAI bodies, Triton's
generate parameters, OIP request parameters), so that each bad value gets the same clear 400.

Names are OpenAI's (``max_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``), plus vLLM's
extensions ``top_k``, ``repetition_penalty`` (> 1 discourages tokens already in the prompt or the
answer, Hugging Face's rule), ``ignore_eos`` and ``stop_token_ids``; ``max_new_tokens`` (Hugging
Face's name) and ``max_completion_tokens`` (OpenAI's newer one) are accepted for ``max_tokens``.
OpenAI's ``frequency_penalty`` / ``presence_penalty`` are not implemented: a non-zero value is
refused rather than ignored.

Nothing the client asks for is cut silently: ``max_tokens`` larger than what the context leaves
after the prompt is a 400 with the numbers (OpenAI's and vLLM's answer). Only the artifact's
default, which the client did not ask for, is cut to the room left; the answer then ends with
``finish_reason: "length"`` and its ``usage`` says how many tokens it got."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ..errors import InvalidInputError
from .sampling import SamplingParams

MAX_STOP_STRINGS = 16
MAX_TOKENS_NAMES = ("max_tokens", "max_new_tokens", "max_completion_tokens")  # OpenAI's, Hugging Face's, OpenAI's newer


def _number(fields: Mapping[str, Any], name: str, kind: type = float) -> Any:
    """The field as ``kind`` (an integral float such as 5.0 or 1e12 passes as an int), or None;
    anything else (a string, a bool, NaN, infinity, 1.5 for an int) is a 400."""
    value = fields.get(name)
    if value is None:
        return None
    ok = isinstance(value, int) and not isinstance(value, bool)
    if isinstance(value, float) and math.isfinite(value):  # NaN and infinity come as OIP strings ("nan")
        ok = kind is float or value.is_integer()
    if not ok:
        raise InvalidInputError(f"'{name}' must be {'an integer' if kind is int else 'a finite number'}, got {value!r}")
    return kind(value)


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise InvalidInputError("'stop' must be a non-empty string or a list of them")
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidInputError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
    return tuple(stops)


def _max_tokens(fields: Mapping[str, Any], prompt_tokens: int, max_context: int) -> int | None:
    """The answer length the request asks for (under any of its names), or None."""
    asked = {name: _number(fields, name, int) for name in MAX_TOKENS_NAMES}
    asked = {name: value for name, value in asked.items() if value is not None}
    if len(set(asked.values())) > 1:
        raise InvalidInputError(f"{' and '.join(map(repr, asked))} disagree ({', '.join(map(str, asked.values()))}): "
                                "give one of them")
    if not asked:
        return None
    name, value = next(iter(asked.items()))
    if value < 1:
        raise InvalidInputError(f"'{name}' must be at least 1, got {value}")
    room = max_context - prompt_tokens
    if value > room:
        raise InvalidInputError(f"'{name}' is {value}, but this model's context is {max_context} tokens and the "
                                f"prompt takes {prompt_tokens} of them: at most {room} tokens can be generated")
    return value


def sampling_params(fields: Mapping[str, Any], defaults: SamplingParams, prompt_tokens: int,
                    max_context: int) -> SamplingParams:
    """The request's settings over the artifact's ``defaults``. ``max_tokens`` is cut to what the
    context leaves after the prompt (the answer then ends with finish_reason ``length``)."""
    for name in ("frequency_penalty", "presence_penalty"):
        if _number(fields, name):
            raise InvalidInputError(f"'{name}' is not supported; use 'repetition_penalty' (> 1 discourages repeats)")
    room = max_context - prompt_tokens
    if room < 1:
        raise InvalidInputError(f"the prompt has {prompt_tokens} tokens; this model's context is {max_context} "
                                "tokens, which leaves no room for an answer")
    max_tokens = _max_tokens(fields, prompt_tokens, max_context)
    top_k = _number(fields, "top_k", int)
    if top_k == -1:  # vLLM's "off"
        top_k = 0
    ignore_eos = fields.get("ignore_eos")
    if ignore_eos is not None and not isinstance(ignore_eos, bool):
        raise InvalidInputError(f"'ignore_eos' must be true or false, got {ignore_eos!r}")
    stop_token_ids = fields.get("stop_token_ids")
    if stop_token_ids is not None and (not isinstance(stop_token_ids, list) or
                                       not all(isinstance(i, int) and not isinstance(i, bool) for i in stop_token_ids)):
        raise InvalidInputError("'stop_token_ids' must be a list of integers")
    asked = {
        "max_new_tokens": max_tokens if max_tokens is not None else min(defaults.max_new_tokens, room),
        "temperature": _number(fields, "temperature"),
        "top_p": _number(fields, "top_p"),
        "top_k": top_k,
        "repetition_penalty": _number(fields, "repetition_penalty"),
        "seed": _number(fields, "seed", int),
        "stop": _stop(fields.get("stop")) or None,
        "stop_token_ids": tuple(stop_token_ids) if stop_token_ids else None,
        "ignore_eos": ignore_eos,
    }
    values = {name: getattr(defaults, name) for name in SamplingParams.__dataclass_fields__ if name != "extra"}
    values.update({k: v for k, v in asked.items() if v is not None})
    return SamplingParams(**values)  # range checks (temperature >= 0, 0 < top_p <= 1, ...) raise InvalidInputError
