"""Request fields → SamplingParams (generation/request/params.py): OpenAI's penalties, logit_bias,
logprobs, echo, n and response_format, and the constraint fields of vLLM and llama-server, each
bad value a clear InvalidInputError before any compute."""

from __future__ import annotations

import pytest

from generation_helpers import tiny_tokenizer
from modelkiln.errors import InvalidInputError
from modelkiln.generation.structured_output.grammars import Grammars
from modelkiln.generation.request.params import choice_seed, choices, requested_constraint, sampling_params
from modelkiln.generation.sampling import SamplingParams
from modelkiln.generation.structured_output.vocabulary import Vocabulary

DEFAULTS = SamplingParams(max_new_tokens=16)
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def grammars(tmp_path_factory):
    tokenizer = tiny_tokenizer(tmp_path_factory.mktemp("tok"))
    return Grammars(Vocabulary(tokenizer, [tokenizer.token_to_id("<|im_end|>")]))


def parse(fields, grammars=None, **kw) -> SamplingParams:
    return sampling_params(fields, DEFAULTS, 10, 1024, grammars, **kw)


def test_penalties_and_logit_bias(grammars):
    p = parse({"frequency_penalty": 0.5, "presence_penalty": -1, "logit_bias": {"7": 5, "3": -100}}, grammars)
    assert (p.frequency_penalty, p.presence_penalty, p.logit_bias) == (0.5, -1.0, ((3, -100.0), (7, 5.0)))
    for fields, message in [({"presence_penalty": 2.5}, r"'presence_penalty' must be in \[-2, 2\]"),
                            ({"logit_bias": {"400": 1}}, r"'400' is not a token id .* \[0, 400\)"),
                            ({"logit_bias": {"x": 1}}, "'x' is not a token id"),
                            ({"logit_bias": {"-1": 1}}, "'-1' is not a token id"),
                            ({"logit_bias": {"5": 101}}, r"logit_bias for token 5 must be in \[-100, 100\]"),
                            ({"logit_bias": [1]}, "must be an object")]:
        with pytest.raises(InvalidInputError, match=message):
            parse(fields, grammars)


def test_logprobs_in_both_shapes():
    assert parse({"logprobs": True, "top_logprobs": 3}).logprobs == 3  # chat
    assert parse({"logprobs": True}).logprobs == 0
    assert parse({"logprobs": False}).logprobs is None
    assert parse({"logprobs": 2}).logprobs == 2  # completions
    echo = parse({"logprobs": 2, "echo": True})
    assert (echo.logprobs, echo.prompt_logprobs) == (2, 2)
    assert parse({"echo": True}).prompt_logprobs is None
    assert parse({"prompt_logprobs": 1}).prompt_logprobs == 1  # vLLM's
    for fields, message in [({"top_logprobs": 2}, "needs 'logprobs': true"),
                            ({"logprobs": 2, "top_logprobs": 2}, "not both"),
                            ({"logprobs": True, "top_logprobs": 21}, r"'top_logprobs' must be in \[0, 20\], got 21"),
                            ({"logprobs": 21}, r"'logprobs' must be in \[0, 20\], got 21"),
                            ({"echo": "yes"}, "'echo' must be true or false")]:
        with pytest.raises(InvalidInputError, match=message):
            parse(fields)


def test_n_and_seeds():
    assert choices({}) == 1 and choices({"n": 4}) == 4 and choices({"n": 3, "best_of": 3}) == 3
    with pytest.raises(InvalidInputError, match=r"'n' must be in \[1, 8\] \(this server runs at most"):
        choices({"n": 9}, max_rows=8)
    with pytest.raises(InvalidInputError, match="'best_of' is not supported"):
        choices({"n": 1, "best_of": 2})
    assert [choice_seed(7, i) for i in range(3)] == [7, 8, 9] and choice_seed(None, 2) is None
    assert choice_seed(2**64 - 1, 1) == 0


@pytest.mark.parametrize(("fields", "kind"), [
    ({"response_format": {"type": "json_object"}}, "json_object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     "json_schema"),
    ({"structured_outputs": {"regex": "[ab]+"}}, "regex"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, "choice"),
    ({"guided_json": SCHEMA}, "json_schema"),
    ({"guided_json": '{"type": "object"}'}, "json_schema"),
    ({"guided_regex": "[ab]+"}, "regex"),
    ({"guided_grammar": 'start: "a"'}, "lark"),
    ({"grammar": 'root ::= "a"'}, "gbnf"),
    ({"json_schema": SCHEMA}, "json_schema"),
    ({"response_format": {"type": "json_object", "schema": SCHEMA}}, "json_schema"),  # llama-cpp-python's form
])
def test_every_name_for_a_constraint(fields, kind, grammars):
    assert requested_constraint(fields)[0] == kind
    assert parse(fields, grammars).constraint.kind == kind


def test_json_object_with_a_schema_is_that_schema_not_strict(grammars):
    """llama-cpp-python's, Together's and Fireworks' ``{"type": "json_object", "schema": ...}``: the
    schema's grammar (was: any object, the schema silently ignored)."""
    kind, spec = requested_constraint({"response_format": {"type": "json_object", "schema": SCHEMA}})
    assert (kind, spec) == ("json_schema", {"schema": SCHEMA, "strict": False})
    assert requested_constraint({"response_format": {"type": "json_object", "schema": None}})[0] == "json_object"


def test_text_format_is_no_constraint_and_bad_formats_are_refused(grammars):
    assert parse({"response_format": {"type": "text"}}, grammars).constraint is None
    for fields, message in [
        ({"response_format": {"type": "xml"}}, "'response_format' must be"),
        ({"response_format": {"type": "json_schema"}}, "needs 'json_schema'"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "one constraint at most"),
        ({"structured_outputs": {"yaml": "a"}}, "has no 'yaml'"),
        ({"guided_json": "{not json"}, "not JSON"),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "'ignore_eos' cannot be used"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "bogus"}}}},
         "the JSON schema cannot be used"),
        # a key kiln does not read would change the answer where another server honours it
        ({"response_format": {"type": "json_object", "schema": [1]}}, "'schema' must be a JSON schema object"),
        ({"response_format": {"type": "json_object", "grammar": "root ::= x"}}, "has 'grammar', which this server"),
        ({"response_format": {"type": "text", "schema": SCHEMA}}, "has 'schema', which this server does not"),
        ({"response_format": {"type": "json_schema", "schema": SCHEMA, "json_schema": {"schema": SCHEMA}}},
         "'response_format' has 'schema'"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA, "mode": "x"}}},
         "'response_format.json_schema' has 'mode'"),
    ]:
        with pytest.raises(InvalidInputError, match=message):
            parse(fields, grammars)
    with pytest.raises(InvalidInputError, match="not available here"):
        parse({"response_format": {"type": "json_object"}})
    with pytest.raises(InvalidInputError, match="together with 'tool_choice'"):
        parse({"response_format": {"type": "json_object"}}, grammars, constraint=("regex", "a"))
