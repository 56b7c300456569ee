"""Structured outputs' grammars (generation/structured_output/grammars.py) on a tiny byte-level BPE tokenizer:
matchers driven by random choices among the allowed tokens can only write what the constraint
allows, whatever they pick; bad specs are refused with a clear error before any compute."""

from __future__ import annotations

import enum
import json
import re
import threading
from typing import Literal

import numpy as np
import pydantic
import pytest

from generation_helpers import PADDED_WORDS, allowed, random_walk, tiny_tokenizer
from modelkiln.errors import InvalidInputError
from modelkiln.generation.structured_output.grammars import MAX_DEPTH, Grammars, compile_constraint
from modelkiln.generation.structured_output.vocabulary import Vocabulary



@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def eos(tokenizer):
    return tokenizer.token_to_id("<|im_end|>")


@pytest.fixture(scope="module")
def grammars(tokenizer, eos):
    return Grammars(Vocabulary(tokenizer, [eos]))


class Colour(str, enum.Enum):
    red = "red"
    green = "green"


class Point(pydantic.BaseModel):
    x: int = pydantic.Field(ge=-3, le=40)
    y: float = pydantic.Field(ge=0, le=1)


class Shape(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=6)
    colour: Colour
    kind: Literal["line", "polygon"]
    points: list[Point] = pydantic.Field(min_length=1, max_length=3)
    label: str | None = pydantic.Field(default=None, max_length=4)
    closed: bool = False


class Tree(pydantic.BaseModel):
    value: int = pydantic.Field(ge=0, le=9)
    children: list[Tree] = pydantic.Field(max_length=2)


@pytest.mark.parametrize("model", [Shape, Tree])
def test_every_walk_through_a_schema_is_valid_json_of_it(model, grammars, tokenizer, eos):
    """Nested objects, arrays with bounds, enums, literals, numeric bounds, optional fields and a
    recursive $ref (pydantic's own schemas): whatever tokens are picked, the text validates."""
    grammar = compile_constraint("json_schema", {"name": model.__name__, "schema": model.model_json_schema(),
                                                 "strict": True}, grammars)
    rng = np.random.default_rng(0)
    for _ in range(12):
        text = random_walk(grammar, tokenizer, eos, rng, max_steps=3000)
        model.model_validate_json(text)  # raises if the text breaks the schema
        assert ": " in text and "\n" not in text  # one space after ':' and ',' and no other whitespace


def test_json_object_is_any_object(grammars, tokenizer, eos):
    grammar = compile_constraint("json_object", None, grammars)
    rng = np.random.default_rng(1)
    for _ in range(8):
        assert isinstance(json.loads(random_walk(grammar, tokenizer, eos, rng, max_steps=3000)), dict)


def test_strict_forbids_keys_the_schema_does_not_list(grammars, tokenizer, eos):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    loose = compile_constraint("json_schema", {"schema": schema}, grammars).matcher()
    strict = compile_constraint("json_schema", {"schema": schema, "strict": True}, grammars).matcher()
    ids = tokenizer.encode('{"a": 1, "b": 2}').ids
    assert all(loose.accept(t) for t in ids)
    assert not all(strict.accept(t) for t in ids) and strict.error


def test_regex_choice_and_grammars(grammars, tokenizer, eos):
    rng = np.random.default_rng(2)
    regex = compile_constraint("regex", r"[0-9]{3}-[a-c]{2}", grammars)
    choice = compile_constraint("choice", ["yes", "no", "a.b (c)"], grammars)
    lark = compile_constraint("lark", 'start: "(" NUMBER ("," NUMBER)* ")"\nNUMBER: /[0-9]{1,2}/', grammars)
    gbnf = compile_constraint("gbnf", 'root ::= "up" | "down"', grammars)
    for _ in range(6):
        assert re.fullmatch(r"[0-9]{3}-[a-c]{2}", random_walk(regex, tokenizer, eos, rng))
        assert random_walk(choice, tokenizer, eos, rng) in ("yes", "no", "a.b (c)")
        assert re.fullmatch(r"\((\d{1,2})(,\d{1,2})*\)", random_walk(lark, tokenizer, eos, rng))
        assert random_walk(gbnf, tokenizer, eos, rng) in ("up", "down")


def test_a_token_outside_the_grammar_is_refused(grammars, tokenizer):
    matcher = compile_constraint("regex", "abc", grammars).matcher()
    assert not matcher.accept(tokenizer.encode("z").ids[0]) and matcher.error


@pytest.mark.parametrize(("kind", "spec", "message"), [
    ("json_schema", {"schema": {"type": "foo"}}, "the JSON schema cannot be used: .*foo"),
    ("json_schema", {"schema": {"$ref": "#/$defs/missing"}}, "missing"),
    ("json_schema", {"schema": [1, 2]}, "must be an object"),
    ("json_schema", {"schema": {}, "strict": "yes"}, "'strict' must be true or false"),
    ("json_schema", {"schema": {"type": "string", "pattern": "(unclosed"}}, "cannot be used"),
    ("regex", "(unclosed", "the regex cannot be used"),
    ("regex", "", "non-empty string"),
    ("choice", [], "non-empty list"),
    ("lark", "start: undefined_rule", "the Lark grammar cannot be used"),
    ("xml", "<a/>", "unknown constraint kind"),
])
def test_bad_specs_are_invalid_input(kind, spec, message, grammars):
    with pytest.raises(InvalidInputError, match=message):
        compile_constraint(kind, spec, grammars)


def test_depth_and_size_limits(grammars):
    deep: dict = {"type": "integer"}
    for _ in range(MAX_DEPTH):
        deep = {"type": "array", "items": deep}
    with pytest.raises(InvalidInputError, match="nested more than"):
        compile_constraint("json_schema", {"schema": deep}, grammars)
    huge = {"enum": ["x" * 1000] * 300}
    with pytest.raises(InvalidInputError, match="bytes; at most"):
        compile_constraint("json_schema", {"schema": huge}, grammars)


def test_cache_is_keyed_by_the_canonical_spec_and_bounded(tokenizer, eos):
    grammars = Grammars(Vocabulary(tokenizer, [eos]), max_entries=3)
    a = compile_constraint("json_schema", {"schema": {"type": "object", "properties": {"a": {"type": "integer"}}}},
                           grammars)
    same = compile_constraint("json_schema", {"schema": {"properties": {"a": {"type": "integer"}}, "type": "object"}},
                              grammars)
    assert same is a
    for pattern in ("a", "b", "c", "d"):
        compile_constraint("regex", pattern, grammars)
    assert grammars.cached == 3
    assert compile_constraint("regex", "d", grammars) is compile_constraint("regex", "d", grammars)


def test_compiling_from_threads_at_once(grammars, tokenizer, eos):
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            grammar = compile_constraint("regex", f"[a-z]{{{i % 3 + 1}}}", grammars)
            matcher, words = grammar.matcher(), np.zeros(PADDED_WORDS, dtype=np.int32)
            matcher.fill_bitmask(words)
            assert allowed(words).size
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_a_bitmask_smaller_than_the_vocabulary_is_refused(grammars):
    matcher = compile_constraint("regex", "a", grammars).matcher()
    with pytest.raises(ValueError, match="at least 13 words"):
        matcher.fill_bitmask(np.zeros(4, dtype=np.int32))


def test_vocabulary_spells_each_token_in_bytes(tokenizer, eos):
    vocabulary = Vocabulary(tokenizer, [eos])
    ids = tokenizer.encode("héllo wörld").ids
    assert b"".join(vocabulary.token_bytes(i) for i in ids) == "héllo wörld".encode()
    assert vocabulary.token_text(eos) == "<|im_end|>" and vocabulary.token_bytes(10_000) == b""


def test_gguf_vocabulary_placeholders_are_never_allowed(tmp_path, eos):
    """llama.cpp pads a GGUF's vocabulary with "[PAD<id>]" tokens up to the embedding's rows: they
    spell ordinary text, but a grammar must never allow them (an untrained row's logit can win)."""
    from tokenizers import Tokenizer

    tokenizer = tiny_tokenizer(tmp_path)
    first = tokenizer.get_vocab_size()
    data = json.loads(tokenizer.to_str())
    for i in range(first, first + 3):  # as convert_hf_to_gguf writes them: in the model's vocabulary
        data["model"]["vocab"][f"[PAD{i}]"] = i
    padded = Tokenizer.from_str(json.dumps(data))
    assert padded.token_to_id(f"[PAD{first}]") == first
    grammar = Grammars(Vocabulary(padded, [eos])).compile("regex", r"[A-Z\[\]a-z0-9]{1,20}")
    words = np.zeros(PADDED_WORDS, dtype=np.int32)
    grammar.matcher().fill_bitmask(words)
    ids = set(allowed(words).tolist())
    assert not ids & {first, first + 1, first + 2} and len(ids) > 50
    from modelkiln.generation.structured_output.grammars import Matcher

    unfiltered = np.zeros(PADDED_WORDS, dtype=np.int32)  # the grammar engine alone would allow them
    Matcher(grammar._prototype.deep_copy(), grammar._words).fill_bitmask(unfiltered)
    assert {first, first + 1, first + 2} <= set(allowed(unfiltered).tolist())


# --- closing an answer within its budget (structured_output/closing.py, sequence.py) ---------------------------------


class Owner(pydantic.BaseModel):
    name: str


class Answer(pydantic.BaseModel):
    owner: Owner
    tags: list[str] = pydantic.Field(min_length=2)
    colour: Colour
    score: float


ANSWER_SCHEMA = {"name": "answer", "schema": Answer.model_json_schema(), "strict": True}


def rambling_state(grammar, tokenizer, eos, max_new_tokens, *, max_context=None, resumed=()):
    from modelkiln.generation.sampling import SamplingParams
    from modelkiln.generation.sequence import SequenceState

    return SequenceState("r", [1, 2, 3], SamplingParams(max_new_tokens=max_new_tokens, constraint=grammar), tokenizer,
                         frozenset([eos]), max_context, resumed=resumed)


def ramble(state, tokenizer, eos, seed: int = 0) -> list[int]:
    """A model that never wants to stop: mostly a letter where the mask allows one (a string kept
    open), else any allowed token but end-of-sequence (more items, escapes, nested values), chosen
    by (seed, position) alone."""
    letters = [tokenizer.token_to_id(c) for c in "abcdefghijklmnop"]
    while not state.finished:
        tokens = allowed(state.bitmask())
        rng = np.random.default_rng([seed, len(state.generated_ids)])
        choices = [t for t in letters if t in tokens] if rng.random() < 0.8 else []
        choices = choices or [t for t in tokens if t != eos] or list(tokens)
        state.accept(int(rng.choice(choices)))
    return state.generated_ids


@pytest.mark.parametrize("max_new_tokens", [70, 90, 120, 200])
def test_a_rambling_answer_is_closed_within_its_budget(max_new_tokens, grammars, tokenizer, eos):
    """Whatever the model writes inside strings and arrays, the answer ends valid: the required keys,
    the array's two items and the enum are all there, and it ends with "stop", within max_tokens."""
    grammar = compile_constraint("json_schema", ANSWER_SCHEMA, grammars)
    assert grammar.shortest_answer == 65  # '{"owner": {"name": ""}, "tags": ["", ""], ...': short tokens
    for seed in range(6):
        state = rambling_state(grammar, tokenizer, eos, max_new_tokens)
        ramble(state, tokenizer, eos, seed)
        assert state.finish_reason == "stop", state.text
        assert len(state.generated_ids) <= max_new_tokens
        answer = Answer.model_validate_json(state.text)
        assert len(answer.tags) >= 2 and json.loads(state.text)["colour"] in ("red", "green")


def test_an_answer_too_long_for_its_budget_still_ends_with_length(grammars, tokenizer, eos):
    grammar = compile_constraint("json_schema", ANSWER_SCHEMA, grammars)
    state = rambling_state(grammar, tokenizer, eos, 3)
    ramble(state, tokenizer, eos)
    assert state.finish_reason == "length" and len(state.generated_ids) == 3


class Tree(pydantic.BaseModel):
    value: int = pydantic.Field(ge=0, le=100)
    children: list[Tree] = pydantic.Field(max_length=2)


def nest(state, tokenizer, eos, seed: int = 0) -> list[int]:
    """A model that nests forever (as SmolLM2 does in a recursive schema): an opening bracket
    wherever the mask allows one, else any allowed token but a closing one or end-of-sequence."""
    opening = {t for t in range(tokenizer.get_vocab_size()) if (tokenizer.id_to_token(t) or "").startswith(("[", "{"))}
    closing = {t for t in range(tokenizer.get_vocab_size()) if any(c in (tokenizer.id_to_token(t) or "") for c in "]}")}
    while not state.finished:
        tokens = [int(t) for t in allowed(state.bitmask())]
        rng = np.random.default_rng([seed, len(state.generated_ids)])
        choices = ([t for t in tokens if t in opening] or [t for t in tokens if t not in closing and t != eos]
                   or tokens)
        state.accept(int(rng.choice(choices)))
    return state.generated_ids


@pytest.mark.parametrize("max_new_tokens", [100, 400, 1000])
def test_a_deeply_nested_answer_is_closed_in_time(max_new_tokens, grammars, tokenizer, eos):
    """The path that closes a recursive answer grows with its depth, past any fixed distance from
    the end: the closing is looked at early enough for the path it finds, so a tree nested as deep
    as the budget allows still ends valid, with "stop"."""
    schema = {"name": "tree", "schema": Tree.model_json_schema(), "strict": True}
    grammar = compile_constraint("json_schema", schema, grammars)
    state = rambling_state(grammar, tokenizer, eos, max_new_tokens)
    nest(state, tokenizer, eos)
    assert state.finish_reason == "stop", state.text[-200:]
    assert len(state.generated_ids) <= max_new_tokens
    depth, tree = 0, Tree.model_validate_json(state.text)
    while tree.children:
        depth, tree = depth + 1, tree.children[0]
    assert depth >= max_new_tokens // 40, state.text  # it did nest: most of the budget went to depth
    whole = state.generated_ids
    for cut in (len(whole) // 2, len(whole) - 30, len(whole) - 1):  # resumed: the same looks, the same margin
        state = rambling_state(grammar, tokenizer, eos, max_new_tokens, resumed=whole[:cut])
        assert nest(state, tokenizer, eos) == whole, cut


def test_the_models_context_is_a_budget_too(grammars, tokenizer, eos):
    grammar = compile_constraint("json_schema", ANSWER_SCHEMA, grammars)
    state = rambling_state(grammar, tokenizer, eos, 1000, max_context=3 + 90)
    ramble(state, tokenizer, eos)
    assert state.finish_reason == "stop" and len(state.generated_ids) <= 90
    Answer.model_validate_json(state.text)


def test_far_from_the_end_the_mask_is_the_grammars(grammars, tokenizer, eos):
    """Closing costs nothing until the budget's end is near: the mask is the grammar's own."""
    grammar = compile_constraint("json_object", None, grammars)
    state = rambling_state(grammar, tokenizer, eos, 1000)
    words = np.zeros(PADDED_WORDS, dtype=np.int32)
    grammar.matcher().fill_bitmask(words)
    assert np.array_equal(state.bitmask(), words[:state.bitmask().size]) and state._closing is None


def test_closing_paths_close_before_they_open(grammars, tokenizer, eos):
    """The shortest completions, from the middle of a string, an array, a value and an accepting
    regex (the quote that closes, not a bracket inside the string; the bracket that closes, not a
    quote that opens one more item; an empty string, not an opening quote; end-of-sequence)."""
    def path(kind, spec, prefix, limit=40):
        matcher = compile_constraint(kind, spec, grammars).matcher()
        assert all(matcher.accept(t) for t in tokenizer.encode(prefix).ids), matcher.error
        return tokenizer.decode(matcher.closing_path(limit) or [], skip_special_tokens=False)

    strings = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "string"}}}, "required": ["a"]}
    assert path("json_schema", {"schema": strings, "strict": True}, '{"a": ["x] y') == '"]}'
    assert path("json_schema", {"schema": strings, "strict": True}, '{"a": [') == ']}'
    assert path("json_schema", {"schema": strings, "strict": True}, '{"a": ["b", ') == '""]}'
    assert path("json_object", None, '{"k": [1, {"j": "v') == '"}]}'
    assert path("regex", "[0-9]{1,3}", "4") == "<|im_end|>"
    assert compile_constraint("json_schema", ANSWER_SCHEMA, grammars).matcher().closing_path(3) is None


def test_a_closing_path_never_repeats_itself(grammars, tokenizer, eos):
    """A number that may be negative but is bounded: from '-0.' the grammar allows digits alone, and
    a zero leaves the same choices (the number must still differ from zero), so a path that takes
    the first longest token, a zero, would take zeros for ever; it takes a digit after which the
    grammar allows other tokens, and the answer it closes is valid."""
    schema = {"type": "object", "properties": {"t": {"type": "number", "minimum": -90, "maximum": 60},
                                               "u": {"type": "integer", "minimum": 1}}, "required": ["t", "u"]}
    for prefix in ('{"t": -0.', '{"t": -', '{"t": '):
        matcher = compile_constraint("json_schema", {"schema": schema, "strict": True}, grammars).matcher()
        assert all(matcher.accept(t) for t in tokenizer.encode(prefix).ids), matcher.error
        path = matcher.closing_path(40)
        assert path is not None, prefix
        answer = json.loads(prefix + tokenizer.decode(path, skip_special_tokens=True))
        assert -90 <= answer["t"] <= 60 and answer["u"] >= 1, answer


def test_a_resumed_answer_closes_as_the_uninterrupted_one(grammars, tokenizer, eos):
    """The closing depends only on the sequence's own tokens and budget: replaying any prefix of an
    answer (a resumed request) and going on gives the same tokens."""
    grammar = compile_constraint("json_schema", ANSWER_SCHEMA, grammars)
    whole = ramble(rambling_state(grammar, tokenizer, eos, 100), tokenizer, eos, seed=3)
    for cut in (1, 20, 35, 50, 70, len(whole) - 2, len(whole) - 1):
        state = rambling_state(grammar, tokenizer, eos, 100, resumed=whole[:cut])
        assert ramble(state, tokenizer, eos, seed=3) == whole, cut


def many_optional_properties(n: int) -> dict:
    """An object of n optional string properties with patterns: after '{' the parser's row holds
    about 4 items a property, past llguidance's 2,000 from ~500 properties on."""
    return {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 5 + 1}}}$"}
                                             for i in range(n)}}


def test_a_grammar_past_the_parsers_limits_is_refused_at_compile_time(grammars):
    """It passes its first mask ('{' only) and fails on the next token: found along its shortest
    answer before any compute, with a short message (no parser state, no grammar)."""
    with pytest.raises(InvalidInputError, match="too complex for the grammar engine: .*Current row has") as err:
        compile_constraint("json_schema", {"schema": many_optional_properties(3000)}, grammars)
    assert len(str(err.value)) < 300
    assert compile_constraint("json_schema", {"schema": many_optional_properties(300)}, grammars)


def test_a_grammar_past_the_limits_further_on_fails_its_answer_with_a_typed_400(grammars, tokenizer, eos):
    """The shortest answer of an array of such objects is '[]', which the compile-time walk takes;
    an answer that opens an object fails there with GrammarLimitError (400), not a bug's 500."""
    from modelkiln.errors import ErrorKind, GrammarLimitError

    schema = {"type": "array", "items": many_optional_properties(3000)}
    grammar = compile_constraint("json_schema", {"schema": schema}, grammars)
    state = rambling_state(grammar, tokenizer, eos, 20)
    opening, brace = tokenizer.token_to_id("["), tokenizer.token_to_id("{")
    assert opening in allowed(state.bitmask())
    state.accept(opening)
    assert brace in allowed(state.bitmask())
    with pytest.raises(GrammarLimitError, match="too complex for the grammar engine at answer token 2") as err:
        state.accept(brace)
    assert err.value.kind is ErrorKind.INVALID_INPUT


def test_a_token_the_mask_did_not_allow_is_the_engines_bug(grammars, tokenizer, eos):
    from modelkiln.errors import ErrorKind, KilnError

    state = rambling_state(compile_constraint("regex", "abc", grammars), tokenizer, eos, 5)
    state.bitmask()
    with pytest.raises(KilnError, match="the grammar refused token") as err:
        state.accept(tokenizer.encode("z").ids[0])
    assert err.value.kind is ErrorKind.INTERNAL
