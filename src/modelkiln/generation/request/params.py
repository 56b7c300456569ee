"""Request fields → ``SamplingParams``, checked once for every protocol (OpenAI bodies, Triton's
generate parameters, OIP request parameters), so that each bad value gets the same clear 400.

The settings are declared in ``request/settings.py``. Names are OpenAI's (``max_tokens``,
``temperature``, ``top_p``, ``seed``, ``stop``,
``frequency_penalty``, ``presence_penalty``, ``logit_bias``, ``logprobs``, ``top_logprobs``,
``echo``, ``response_format``), plus vLLM's extensions ``top_k``, ``min_p``, ``repetition_penalty`` (> 1
discourages tokens already in the prompt or the answer, Hugging Face's rule), ``ignore_eos``,
``stop_token_ids``, ``prompt_logprobs`` and ``structured_outputs`` (with its older ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar``), and llama-server's ``grammar`` (GBNF)
and ``json_schema``; ``max_new_tokens`` (Hugging Face's name), ``max_completion_tokens``
(OpenAI's newer one) and ``max_output_tokens`` (OpenAI's Responses API) are accepted for
``max_tokens``. A request asks for one constraint at most.

Nothing the client asks for is cut silently: ``max_tokens`` larger than what the context leaves
after the prompt is a 400 with the numbers (OpenAI's and vLLM's answer). Only the artifact's
default, which the client did not ask for, is cut to the room left; the answer then ends with
``finish_reason: "length"`` and its ``usage`` says how many tokens it got."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from ...errors import InvalidInputError
from ..structured_output.grammars import Grammars, compile_constraint
from ..sampling import MAX_LOGPROBS, SamplingParams

MAX_STOP_STRINGS = 16
MAX_CHOICES = 16  # OpenAI's n; the server also refuses more than its running rows
MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries
# OpenAI's, Hugging Face's, OpenAI's newer, OpenAI Responses'
MAX_TOKENS_NAMES = ("max_tokens", "max_new_tokens", "max_completion_tokens", "max_output_tokens")


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


def _logit_bias(value: Any, vocab_size: int | None) -> tuple[tuple[int, float], ...] | None:
    """OpenAI's ``{"token id": bias}`` as sorted (id, bias) pairs; a key that is no token id is a 400."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidInputError("'logit_bias' must be an object of token ids (as strings) to numbers in [-100, 100]")
    if len(value) > MAX_LOGIT_BIAS:
        raise InvalidInputError(f"'logit_bias' has {len(value)} entries; at most {MAX_LOGIT_BIAS} are accepted")
    pairs = {}
    for key, bias in value.items():
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else None
        if token is None or (vocab_size is not None and token >= vocab_size):
            where = f" [0, {vocab_size})" if vocab_size is not None else ""
            raise InvalidInputError(f"'logit_bias' key {key!r} is not a token id of this model's vocabulary{where}")
        pairs[token] = _number({"logit_bias": bias}, "logit_bias")
    return tuple(sorted(pairs.items()))


def _logprobs(fields: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """(logprobs, prompt_logprobs): alternatives per answer token and per prompt token, or None.
    Chat's ``logprobs`` is true/false with ``top_logprobs`` 0-20; completions' is the number itself;
    completions' ``echo`` with logprobs reports the prompt's too (vLLM's ``prompt_logprobs`` alone)."""
    logprobs, top = fields.get("logprobs"), _number(fields, "top_logprobs", int)
    if logprobs is None or isinstance(logprobs, bool):
        if top is not None and not logprobs:
            raise InvalidInputError("'top_logprobs' needs 'logprobs': true")
        if top is not None and not 0 <= top <= MAX_LOGPROBS:  # named here: SamplingParams knows only 'logprobs'
            raise InvalidInputError(f"'top_logprobs' must be in [0, {MAX_LOGPROBS}], got {top}")
        answer = (top or 0) if logprobs else None
    else:
        answer = _number(fields, "logprobs", int)
        if top is not None:
            raise InvalidInputError("give 'logprobs' as true with 'top_logprobs', or as a number alone, not both")
    echo = fields.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise InvalidInputError(f"'echo' must be true or false, got {echo!r}")
    prompt = _number(fields, "prompt_logprobs", int)
    if prompt is None and echo and answer is not None:
        prompt = answer
    return answer, prompt


# The names a request may ask for a constraint by: (field, kind of structured_output/grammars.py); a field holding
# an object (OpenAI's response_format, vLLM's structured_outputs) is read in _constraint.
_CONSTRAINT_FIELDS = (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "lark"), ("grammar", "gbnf"), ("json_schema", "json_schema"))
_STRUCTURED_OUTPUTS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "lark"}
# every request field that asks for a constraint (requested_constraint reads them)
CONSTRAINT_FIELDS = ("response_format", "structured_outputs", *(name for name, _ in _CONSTRAINT_FIELDS))


def _json_text(name: str, spec: Any) -> Any:
    """A schema may come as JSON text (vLLM's guided_json takes either)."""
    if not isinstance(spec, str):
        return spec
    try:
        return json.loads(spec)
    except ValueError:
        raise InvalidInputError(f"'{name}' is a string that is not JSON") from None


_RESPONSE_FORMAT_KEYS = {"text": ("type",), "json_object": ("type", "schema"), "json_schema": ("type", "json_schema")}


def _known_keys(name: str, value: Mapping[str, Any], known: tuple[str, ...]) -> None:
    unknown = sorted(k for k, v in value.items() if k not in known and v is not None)
    if unknown:
        raise InvalidInputError(f"{name} has {', '.join(map(repr, unknown))}, which this server does not read "
                                f"(it reads {', '.join(map(repr, known))})")


def requested_constraint(fields: Mapping[str, Any]) -> tuple[str, Any] | None:
    """The constraint a request asks for, as (kind, spec) for ``compile_constraint``, or None."""
    asked: list[tuple[str, str, Any]] = []
    response_format = fields.get("response_format")
    if response_format is not None:
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if kind not in _RESPONSE_FORMAT_KEYS:
            raise InvalidInputError("'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                                    "{\"type\": \"json_schema\", \"json_schema\": {...}}")
        # a key this server does not read would change the answer where another server honours it: a 400
        _known_keys("'response_format'", response_format, _RESPONSE_FORMAT_KEYS[kind])
        if kind == "json_object" and response_format.get("schema") is not None:
            # llama-cpp-python's, Together's and Fireworks' form of a schema: the same grammar as json_schema
            schema = response_format["schema"]
            if not isinstance(schema, (dict, bool)):
                raise InvalidInputError("'response_format' json_object's 'schema' must be a JSON schema object")
            asked.append(("response_format", "json_schema", {"schema": schema, "strict": False}))
        elif kind == "json_object":
            asked.append(("response_format", "json_object", None))
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
                raise InvalidInputError("'response_format' json_schema needs 'json_schema': {\"name\": ..., "
                                        "\"schema\": {...}, \"strict\": true|false}")
            _known_keys("'response_format.json_schema'", spec, ("name", "description", "schema", "strict"))
            asked.append(("response_format", "json_schema", {"schema": spec.get("schema", {}),
                                                             "strict": spec.get("strict")}))
    structured = fields.get("structured_outputs")
    if structured is not None:
        if not isinstance(structured, dict):
            raise InvalidInputError(f"'structured_outputs' must be an object with one of {', '.join(_STRUCTURED_OUTPUTS)}")
        for key, value in structured.items():
            if key not in _STRUCTURED_OUTPUTS and value not in (None, False):
                raise InvalidInputError(f"'structured_outputs' has no {key!r} (this server takes "
                                        f"{', '.join(_STRUCTURED_OUTPUTS)})")
            if key in _STRUCTURED_OUTPUTS and value is not None:
                asked.append((f"structured_outputs.{key}", _STRUCTURED_OUTPUTS[key], value))
    asked += [(name, kind, fields[name]) for name, kind in _CONSTRAINT_FIELDS if fields.get(name) is not None]
    asked = [(name, kind, _json_text(name, spec) if kind == "json_schema" else spec) for name, kind, spec in asked]
    if len(asked) > 1:
        raise InvalidInputError(f"ask for one constraint at most, got {', '.join(repr(a[0]) for a in asked)}")
    return (asked[0][1], asked[0][2]) if asked else None


def choices(fields: Mapping[str, Any], max_rows: int | None = None) -> int:
    """OpenAI's ``n``: how many answers to one prompt (``best_of``, when given, must equal it)."""
    n = _number(fields, "n", int)
    n = 1 if n is None else n
    limit = min(MAX_CHOICES, max_rows) if max_rows else MAX_CHOICES
    if not 1 <= n <= limit:
        why = " (this server runs at most that many answers at once)" if max_rows and max_rows < MAX_CHOICES else ""
        raise InvalidInputError(f"'n' must be in [1, {limit}]{why}, got {n}")
    best_of = _number(fields, "best_of", int)
    if best_of is not None and best_of != n:
        raise InvalidInputError(f"'best_of' is not supported (other than equal to 'n'), got {best_of}")
    return n


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of the ``index``-th answer to a request with ``seed`` (vLLM's rule: seed + index), so
    that n answers are reproducible and the first equals the answer to the same request with n = 1."""
    return None if seed is None else (seed + index) % 2**64


def sampling_params(fields: Mapping[str, Any], defaults: SamplingParams, prompt_tokens: int,
                    max_context: int, grammars: Grammars | None = None,
                    constraint: tuple[str, Any] | None = None) -> SamplingParams:
    """The request's settings over the artifact's ``defaults``. ``max_tokens`` is cut to what the
    context leaves after the prompt (the answer then ends with finish_reason ``length``).
    ``grammars``: the model's grammar compiler (constraints and logit_bias's vocabulary; None:
    constraints are refused). ``constraint``: one the caller derived (a tool call's syntax), besides
    the request's own."""
    asked_constraint = requested_constraint(fields)
    if asked_constraint is not None and constraint is not None:
        raise InvalidInputError("a structured output cannot be asked for together with 'tool_choice' "
                                "\"required\" or a named function (the answer is the tool call)")
    constraint = constraint or asked_constraint
    if constraint is not None and grammars is None:
        raise InvalidInputError("structured outputs are not available here")
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
    if constraint is not None and ignore_eos:
        raise InvalidInputError("'ignore_eos' cannot be used with a structured output (the answer ends with the grammar)")
    logprobs, prompt_logprobs = _logprobs(fields)
    asked = {
        "max_new_tokens": max_tokens if max_tokens is not None else min(defaults.max_new_tokens, room),
        "temperature": _number(fields, "temperature"),
        "top_p": _number(fields, "top_p"),
        "min_p": _number(fields, "min_p"),
        "top_k": top_k,
        "repetition_penalty": _number(fields, "repetition_penalty"),
        "seed": _number(fields, "seed", int),
        "stop": _stop(fields.get("stop")) or None,
        "stop_token_ids": tuple(stop_token_ids) if stop_token_ids else None,
        "ignore_eos": ignore_eos,
        "frequency_penalty": _number(fields, "frequency_penalty"),
        "presence_penalty": _number(fields, "presence_penalty"),
        "logit_bias": _logit_bias(fields.get("logit_bias"), grammars.vocab_size if grammars else None),
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        "constraint": compile_constraint(*constraint, grammars) if constraint and grammars else None,
    }
    values = {name: getattr(defaults, name) for name in SamplingParams.__dataclass_fields__ if name != "extra"}
    values.update({k: v for k, v in asked.items() if v is not None})
    return SamplingParams(**values)  # range checks (temperature >= 0, 0 < top_p <= 1, ...) raise InvalidInputError
