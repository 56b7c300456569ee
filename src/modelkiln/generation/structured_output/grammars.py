"""Structured outputs: a grammar every generated token must keep the answer inside, with
llguidance (docs/structured-outputs.md says why this engine and what it was measured against).

The interface the engine core uses is three calls per sequence and step (a fourth near the end of
the answer's budget, from sequence.py)::

    grammars = Grammars(Vocabulary(tokenizer, eos_ids))  # once per model
    grammar = compile_constraint("json_schema", {"schema": {...}, "strict": True}, grammars)  # at request parsing
    matcher = grammar.matcher()                        # one per sequence, when it is admitted
    matcher.fill_bitmask(words)                        # int32[ceil(vocab / 32)], bit set = token allowed
    ... sample from the logits with the disallowed tokens at -inf ...
    matcher.accept(token)                              # False: the token was not allowed (a bug upstream)
    matcher.is_terminated()                            # the answer is complete: only end-of-sequence may follow
    matcher.closing_path(limit)                        # the shortest way to complete it (structured_output/closing.py), or None

``words`` may be wider than the tokenizer's vocabulary (a model's embedding is often padded to a
multiple of 64): the padded rows are never allowed. The end-of-sequence ids are the artifact's
(given to ``Vocabulary``); the mask allows them exactly where the grammar may end. Once
``is_terminated()`` the mask holds only them, so an engine may also end the answer at once with
``finish_reason: "stop"`` rather than spend a step on it.

Compiling is cheap (JSON Schema to a grammar text, well under a millisecond) and the first mask of a
grammar builds its lexer (about 1 ms for a small schema on SmolLM2's 49,152 tokens); a matcher is a
copy of a prototype that already has it (about 10 µs). A mask costs about 10-20 µs per token
(benchmarks/generation/grammar_engines.py, a shared AMD EPYC). llguidance releases the GIL while
it computes a mask, so masks for a batch can be filled in a thread while the model runs.

Errors are ``InvalidInputError`` raised here, at request parsing, before any compute: a schema
that is not JSON Schema, a feature the engine does not implement, a regex or grammar that does not
parse, a schema nested deeper than ``MAX_DEPTH`` or larger than ``MAX_SPEC_BYTES``, and a grammar
past llguidance's parser limits (``LLParserLimits``: 2,000 Earley items in a row, lexer fuel) on
its first mask or along its shortest answer. An object of 3,000 optional properties passes its
first mask and fails on the next token (its row after ``{`` holds 4 items a property); walking
the shortest answer at compile time finds it. A grammar that fails further on, on a path the
shortest answer does not take, fails the one answer with ``GrammarLimitError`` (sequence.py)."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from . import bitmask
from ...errors import InvalidInputError
from .closing import ClosingTokens, closing_path
from .vocabulary import Vocabulary

if TYPE_CHECKING:
    # a TypedDict its stub declares (the compiled module has no such name)
    from llguidance._lib import JsonCompileOptions

KINDS = ("json_object", "json_schema", "regex", "choice", "lark", "gbnf")
MAX_DEPTH = 32  # nesting of a schema's objects and arrays (a schema's own $ref recursion is not limited)
MAX_SPEC_BYTES = 256 * 1024  # a schema, regex or grammar, as compact JSON
CACHE_ENTRIES = 256
CACHE_BYTES = 64 << 20  # grammar texts; the compiled lexers they build are counted by entries alone
SHORTEST_ANSWER_LIMIT = 256  # tokens: a grammar whose shortest answer is longer is not measured

# One space after ',' and ':' and nowhere else: the output reads as json.dumps writes it, and a
# small model cannot spend its tokens on whitespace (free whitespace lets it loop on newlines).
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class Matcher:
    """One sequence's place in its grammar."""

    def __init__(self, matcher: Any, words: int, usable: np.ndarray | None = None,
                 closing: ClosingTokens | None = None):
        self._m = matcher
        self._words = words  # the tokenizer's vocabulary in int32 words; the rest of a mask is padding
        self._usable = usable  # tokens a grammar may allow at all (Vocabulary.usable_words)
        self._closing = closing  # the vocabulary's closing tokens (None: no closing path)

    def fill_bitmask(self, out: np.ndarray) -> None:
        """Write the allowed next tokens into ``out`` (int32, contiguous, at least the tokenizer's
        vocabulary in bits, ``bitmask.py``'s layout)."""
        if out.dtype != np.int32 or out.ndim != 1 or not out.flags["C_CONTIGUOUS"] or out.size < self._words:
            raise ValueError(f"the bitmask must be a contiguous int32 vector of at least {self._words} words")
        self._m.unsafe_compute_mask_ptr(out.ctypes.data, self._words * 4)
        out[self._words:] = 0
        if self._usable is not None:
            np.bitwise_and(out[:self._words], self._usable, out=out[:self._words])

    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id``; False when the grammar did not allow it (the matcher then
        stays in error: its sequence must end)."""
        return bool(self._m.consume_token(int(token_id)))

    def is_terminated(self) -> bool:
        """The answer is complete: only end-of-sequence may follow."""
        return bool(self._m.is_stopped())

    @property
    def error(self) -> str:
        """Why the matcher failed ('' when it did not)."""
        return self._m.get_error() if self._m.is_error() else ""

    # -- what structured_output/closing.py reads: the grammar's shortest way to its end ------------------------------
    def closing_path(self, limit: int) -> list[int] | None:
        """The tokens that complete the grammar from here (structured_output/closing.py), at most ``limit``; None
        when it takes more. This matcher does not move."""
        if self._closing is None:
            return None
        return closing_path(self.copy(), self._closing, limit)

    def copy(self) -> Matcher:
        return Matcher(self._m.deep_copy(), self._words, self._usable, self._closing)

    def is_accepting(self) -> bool:
        """The answer may end here (end-of-sequence is allowed), or must."""
        return bool(self._m.is_accepting())

    def forced_tokens(self) -> list[int]:
        """The tokens of the text the grammar forces next (empty when it forces none)."""
        forced = self._m.compute_ff_tokens()
        if self._usable is not None:  # never one the mask would refuse
            unusable = [i for i, t in enumerate(forced) if not bitmask.allows(self._usable, t)]
            forced = forced[:unusable[0]] if unusable else forced
        return forced

    def mask(self) -> np.ndarray:
        """The allowed next tokens as a new bitmask of the tokenizer's vocabulary."""
        words = np.zeros(self._words, dtype=np.int32)
        self.fill_bitmask(words)
        return words


@dataclass(frozen=True, eq=False)
class Grammar:
    """A compiled constraint: hand ``matcher()`` to each sequence that uses it."""

    kind: str
    key: str  # the canonical spec (kind and spec as sorted compact JSON): the cache key
    _prototype: Any
    _words: int
    _usable: np.ndarray | None = None
    _closing: ClosingTokens | None = None
    # tokens in the grammar's shortest answer as structured_output/closing.py finds it (0: none within
    # SHORTEST_ANSWER_LIMIT): how early a sequence looks at closing its answer (sequence.py)
    shortest_answer: int = 0

    def matcher(self) -> Matcher:
        return Matcher(self._prototype.deep_copy(), self._words, self._usable, self._closing)

    @property
    def spec(self) -> tuple[str, Any]:
        """(kind, spec) as ``compile_constraint`` takes them: what another process compiles it from
        (a compiled grammar does not cross processes)."""
        return self.kind, json.loads(self.key)[1]


class Grammars:
    """One model's grammar compiler and its cache of compiled grammars (LRU, bounded by count
    and by the size of the grammar texts; safe from any thread)."""

    def __init__(self, vocabulary: Vocabulary, max_entries: int = CACHE_ENTRIES, max_bytes: int = CACHE_BYTES):
        import llguidance

        self._llg = llguidance
        self.vocabulary = vocabulary
        self.vocab_size = vocabulary.size
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._bytes = 0
        self.closing = ClosingTokens(vocabulary)
        # llguidance's default limits; errors without the parser's state and the whole grammar,
        # which a 400 would otherwise carry (a 3,000-property schema's error was 120 kB)
        self._limits = llguidance.LLParserLimits(verbose_errors=False)
        self._lock = threading.Lock()

    @property
    def cached(self) -> int:
        return len(self._cache)

    def compile(self, kind: str, spec: Any) -> Grammar:
        key = _canonical(kind, spec)
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
                return grammar
        grammar = self._build(kind, spec, key)  # outside the lock: llguidance releases the GIL while it builds
        with self._lock:
            if key not in self._cache:
                self._cache[key] = grammar
                self._bytes += len(key)
                while len(self._cache) > self.max_entries or (self._bytes > self.max_bytes and len(self._cache) > 1):
                    old, _ = self._cache.popitem(last=False)
                    self._bytes -= len(old)
        return grammar

    def _build(self, kind: str, spec: Any, key: str) -> Grammar:
        if not self.vocabulary.eos_ids:
            raise InvalidInputError("this model names no end-of-sequence token, so a constrained answer could not end")
        llg = self._llg.LLMatcher
        if kind == "json_object":
            text = llg.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        elif kind == "json_schema":
            schema, strict = _schema_and_strict(spec)
            text = llg.grammar_from_json_schema(strict_schema(schema) if strict else schema, defaults=JSON_OPTIONS)
        elif kind == "regex":
            text = llg.grammar_from_regex(_string(kind, spec))
        elif kind == "choice":
            text = llg.grammar_from_regex("|".join(_regex_escape(c) for c in _choices(spec)))
        elif kind == "lark":
            text = llg.grammar_from_lark(_string(kind, spec))
        elif kind == "gbnf":
            from llguidance.gbnf_to_lark import gbnf_to_lark

            try:
                text = llg.grammar_from_lark(gbnf_to_lark(_string(kind, spec)))
            except Exception as exc:  # noqa: BLE001 - the converter raises plain exceptions on bad input
                raise InvalidInputError(f"the GBNF grammar does not parse: {exc}") from None
        else:
            raise InvalidInputError(f"unknown constraint kind {kind!r} (one of {', '.join(KINDS)})")
        prototype = llg(self.vocabulary.llg, text, log_level=0, limits=self._limits)
        if prototype.is_error():
            raise InvalidInputError(f"{_NAMES[kind]} cannot be used: {_first_line(prototype.get_error())}")
        # build the lexer now (the first mask), so that each sequence's copy starts with it
        words = bitmask.words(self.vocab_size)
        scratch = bitmask.empty(self.vocab_size)  # held by a name: llguidance writes through its address
        prototype.unsafe_compute_mask_ptr(scratch.ctypes.data, scratch.nbytes)
        if prototype.is_error():
            raise InvalidInputError(f"{_NAMES[kind]} cannot be used: {_first_line(prototype.get_error())}")
        probe = Matcher(prototype.deep_copy(), words, self.vocabulary.usable_words, self.closing)
        shortest = closing_path(probe, self.closing, SHORTEST_ANSWER_LIMIT)
        if probe.error:  # it failed on a token it allowed: past the parser's limits, as every answer would be
            raise InvalidInputError(f"{_NAMES[kind]} is too complex for the grammar engine: {_first_line(probe.error)}")
        return Grammar(kind, key, prototype, words, self.vocabulary.usable_words, self.closing, len(shortest or ()))


def compile_constraint(kind: str, spec: Any, grammars: Grammars) -> Grammar:
    """The compiled grammar for one request's constraint (cached by its canonical spec).

    ``kind`` and ``spec``: ``json_object`` (spec ignored), ``json_schema`` ({"schema": {...},
    "strict": bool} as OpenAI's ``response_format.json_schema``, or a bare schema), ``regex`` (a
    string), ``choice`` (a list of strings: exactly one of them), ``lark`` (llguidance's Lark
    grammar), ``gbnf`` (llama.cpp's GBNF, converted to Lark)."""
    return grammars.compile(kind, spec)


def json_answer_schema(kind: str, spec: Any) -> dict[str, Any] | None:
    """The JSON schema a ``json_object`` or ``json_schema`` constraint puts the answer under (strict
    mode applied), to embed in a larger grammar; None for the other kinds."""
    if kind == "json_object":
        return {"type": "object"}
    if kind != "json_schema":
        return None
    _check_depth(spec, kind)
    schema, strict = _schema_and_strict(spec)
    return strict_schema(schema) if strict else schema


_NAMES = {"json_object": "the JSON object grammar", "json_schema": "the JSON schema", "regex": "the regex",
          "choice": "the choice list", "lark": "the Lark grammar", "gbnf": "the GBNF grammar"}


def _first_line(message: str) -> str:
    return (message.strip().splitlines() or ["(no message)"])[0][:500]


def _canonical(kind: str, spec: Any) -> str:
    if kind not in KINDS:
        raise InvalidInputError(f"unknown constraint kind {kind!r} (one of {', '.join(KINDS)})")
    _check_depth(spec, kind)
    try:
        key = json.dumps([kind, None if kind == "json_object" else spec], sort_keys=True, separators=(",", ":"),
                         ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(f"{_NAMES[kind]} is not JSON: {exc}") from None
    if len(key.encode()) > MAX_SPEC_BYTES:
        raise InvalidInputError(f"{_NAMES[kind]} takes {len(key.encode())} bytes; at most {MAX_SPEC_BYTES} are accepted")
    return key


def _check_depth(spec: Any, kind: str) -> None:
    """Refuse a spec nested deeper than ``MAX_DEPTH`` (walked without recursion)."""
    stack = [(spec, 1)]
    while stack:
        value, depth = stack.pop()
        children: Iterable[Any]
        if isinstance(value, dict):
            children = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        if depth > MAX_DEPTH:
            raise InvalidInputError(f"{_NAMES.get(kind, 'the constraint')} is nested more than {MAX_DEPTH} levels deep")
        stack.extend((child, depth + 1) for child in children)


def _string(kind: str, spec: Any) -> str:
    if not isinstance(spec, str) or not spec:
        raise InvalidInputError(f"{_NAMES[kind]} must be a non-empty string")
    return spec


def _choices(spec: Any) -> list[str]:
    if not isinstance(spec, list) or not spec or not all(isinstance(c, str) and c for c in spec):
        raise InvalidInputError("the choice list must be a non-empty list of non-empty strings")
    return spec


_REGEX_META = set("\\.+*?()|[]{}^$#&-~")  # what Rust's regex_syntax::escape escapes


def _regex_escape(text: str) -> str:
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


def _schema_and_strict(spec: Any) -> tuple[dict[str, Any], bool]:
    """OpenAI's ``json_schema`` object ({"name", "schema", "strict"}) or a bare schema."""
    if isinstance(spec, dict) and "schema" in spec:  # "schema" is no JSON Schema keyword ("$schema" is)
        schema, strict = spec["schema"], spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidInputError(f"'strict' must be true or false, got {strict!r}")
    else:
        schema, strict = spec, False
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise InvalidInputError("the JSON schema must be an object")
    return schema, bool(strict)


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema
_VALUES = ("enum", "const", "default", "examples", "required")  # JSON values, not schemas


def strict_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's strict mode: an object has only the properties its schema lists
    (``additionalProperties`` is false where the schema does not say). Applied to every subschema."""
    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(n) for n in node]
        if not isinstance(node, dict):
            return node
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key in _SCHEMA_MAPS and isinstance(value, dict):
                out[key] = {name: walk(sub) for name, sub in value.items()}
            elif key in _VALUES:
                out[key] = value
            else:
                out[key] = walk(value)
        if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out

    return walk(schema)
