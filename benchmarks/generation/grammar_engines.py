"""Grammar engines for structured outputs, compared on one tokenizer: llguidance, xgrammar and
outlines-core (each a Rust or C++ library with Python bindings on PyPI).

For each engine, in a child process of its own (so that memory and imports are its alone):
- import: the seconds ``import`` takes and whether it brings torch or transformers along
  (the CPU serving path must not import them);
- set-up: the seconds to build the engine's tokenizer index from ``tokenizer.json`` alone;
- per schema: compile seconds (cold: the engine's cache is cleared or bypassed), then a walk of a
  valid instance token by token: the time to fill the next-token bitmask at each step (median,
  p99, mean), whether every token of the instance was allowed, and whether end-of-sequence is
  allowed at the end; and whether an invalid instance is refused;
- coverage: which JSON Schema features compile and hold (nested objects, arrays with bounds,
  enums, numeric bounds, optional fields, $ref and recursion, anyOf, patterns, formats);
- the GIL: a pure-Python counter in the main thread while a second thread fills masks in a
  loop; a counter that keeps most of its idle rate means the engine released the GIL;
- memory: the process's peak RSS after everything (MiB).

    python benchmarks/generation/grammar_engines.py --tokenizer artifacts/SmolLM2-135M-Instruct/tokenizer.json \\
        [--engines llguidance,xgrammar,outlines_core] [--eos 2] [--vocab-size 49152] [--json out.json]

The engines are not the project's dependencies (only the chosen one is, in the ``serve`` extra):
install the others by hand to run this (xgrammar needs torch and transformers; outlines-core's
JSON Schema goes through a regex). Figures from a shared machine are for A/B checks only."""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np

ENGINES = ("llguidance", "xgrammar", "outlines_core")

# name -> (schema, a valid instance, an invalid instance). Instances are written compactly in the
# schema's property order, which every engine accepts.
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0,
                                                                               "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
SCHEMAS: dict[str, tuple[dict[str, Any], Any, Any]] = {
    "flat": (PERSON, {"name": "Ada Lovelace", "age": 36}, {"name": "Ada", "age": -3}),
    "nested_arrays": ({
        "type": "object", "properties": {
            "title": {"type": "string"},
            "authors": {"type": "array", "items": PERSON, "minItems": 1, "maxItems": 4},
            "tags": {"type": "array", "items": {"type": "string"}},
            "meta": {"type": "object", "properties": {"pages": {"type": "integer"}, "score": {"type": "number"}},
                     "required": ["pages", "score"], "additionalProperties": False}},
        "required": ["title", "authors", "tags", "meta"], "additionalProperties": False},
        {"title": "Notes", "authors": [{"name": "Ada", "age": 36}, {"name": "Charles", "age": 79}],
         "tags": ["maths", "engines"], "meta": {"pages": 65, "score": 4.5}},
        {"title": "Notes", "authors": [], "tags": [], "meta": {"pages": 1, "score": 1}}),
    "enum_bounds_optional": ({
        "type": "object", "properties": {
            "colour": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "L"]},
            "price": {"type": "number", "minimum": 0, "maximum": 1000},
            "count": {"type": "integer", "minimum": 1, "maximum": 12},
            "note": {"type": "string", "maxLength": 20}},
        "required": ["colour", "size", "price"], "additionalProperties": False},
        {"colour": "green", "size": "M", "price": 19.99, "count": 3},
        {"colour": "purple", "size": "M", "price": 19.99}),
    "recursive_ref": ({
        "$defs": {"node": {"type": "object", "properties": {
            "value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
            "required": ["value", "children"], "additionalProperties": False}},
        "$ref": "#/$defs/node"},
        {"value": 1, "children": [{"value": 2, "children": []}, {"value": 3, "children": [{"value": 4, "children": []}]}]},
        {"value": 1, "children": [{"value": "x", "children": []}]}),
    "anyof_pattern_format": ({
        "type": "object", "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "when": {"type": "string", "format": "date"},
            "value": {"anyOf": [{"type": "integer"}, {"type": "null"}]}},
        "required": ["id", "when", "value"], "additionalProperties": False},
        {"id": "ABC-1234", "when": "2024-05-01", "value": None},
        {"id": "abc-12", "when": "2024-05-01", "value": None}),
}
JSON_OBJECT = "json_object"  # any JSON object: OpenAI's response_format json_object


def _instance_text(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte (for engines that need each token's bytes)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


# --- the engines, behind one small adapter each ---------------------------------------------------------


class Llguidance:
    def setup(self, tokenizer_json: str, vocab_size: int, eos: int) -> None:
        import llguidance

        self.llg = llguidance
        self.tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=[eos])

    def compile(self, schema: dict[str, Any] | str) -> Any:
        llg = self.llg
        grammar = llg.LLMatcher.grammar_from_json_schema(
            {"type": "object"} if schema == JSON_OBJECT else schema, defaults={"whitespace_flexible": True})
        error = llg.LLMatcher.validate_grammar(grammar, self.tok)
        if error:
            raise ValueError(error)
        return grammar

    def matcher(self, compiled: Any) -> Any:
        m = self.llg.LLMatcher(self.tok, compiled, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def fill(self, matcher: Any, bitmask: np.ndarray) -> None:
        matcher.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.consume_token(token)


class Xgrammar:
    def setup(self, tokenizer_json: str, vocab_size: int, eos: int) -> None:
        import xgrammar
        from tokenizers import Tokenizer

        self.xgr = xgrammar
        tok = Tokenizer.from_str(tokenizer_json)
        vocab = [""] * vocab_size
        for token, i in tok.get_vocab().items():
            vocab[i] = token
        info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.BYTE_LEVEL, vocab_size=vocab_size,
                                      stop_token_ids=[eos])
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, schema: dict[str, Any] | str) -> Any:
        if schema == JSON_OBJECT:
            return self.compiler.compile_builtin_json_grammar()
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=True)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher: Any, bitmask: np.ndarray) -> None:
        matcher.fill_next_token_bitmask(bitmask[None, :])

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.accept_token(token)


class OutlinesCore:
    def setup(self, tokenizer_json: str, vocab_size: int, eos: int) -> None:
        import outlines_core
        from tokenizers import Tokenizer

        self.oc = outlines_core
        tok = Tokenizer.from_str(tokenizer_json)
        alphabet = _bytes_to_unicode()
        special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
        tokens: dict[bytes, list[int]] = {}
        for token, i in tok.get_vocab().items():
            if i in special:
                continue
            tokens.setdefault(bytes(alphabet[c] for c in token), []).append(i)
        self.vocabulary = outlines_core.Vocabulary(eos, tokens)

    def compile(self, schema: dict[str, Any] | str) -> Any:
        if schema == JSON_OBJECT:  # outlines-core has no unbounded JSON: the generic object schema
            schema = {"type": "object"}
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema))
        return self.oc.Index(regex, self.vocabulary)

    def matcher(self, compiled: Any) -> Any:
        return self.oc.Guide(compiled)

    def fill(self, matcher: Any, bitmask: np.ndarray) -> None:
        matcher.write_mask_into(bitmask.ctypes.data, bitmask.size, 4)

    def accept(self, matcher: Any, token: int) -> bool:
        try:
            matcher.advance(token, False)
            return True
        except ValueError:
            return False


ADAPTERS = {"llguidance": Llguidance, "xgrammar": Xgrammar, "outlines_core": OutlinesCore}


def _allowed(bitmask: np.ndarray, token: int) -> bool:
    return bool((int(bitmask[token // 32]) >> (token % 32)) & 1)


def _walk(engine: Any, compiled: Any, ids: list[int], eos: int, bitmask: np.ndarray) -> dict[str, Any]:
    """Drive a matcher through ``ids``: mask time per step, every token allowed, EOS allowed at the end."""
    started = time.perf_counter()
    matcher = engine.matcher(compiled)
    engine.fill(matcher, bitmask)  # the first mask: some engines finish compiling here
    first = time.perf_counter() - started
    times, all_allowed = [], True
    for token in ids:
        started = time.perf_counter()
        engine.fill(matcher, bitmask)
        times.append(time.perf_counter() - started)
        if not _allowed(bitmask, token) or not engine.accept(matcher, token):
            all_allowed = False
            break
    engine.fill(matcher, bitmask)
    return {"mask_us": times, "first_mask_s": first, "valid_accepted": all_allowed and _allowed(bitmask, eos)}


def _refuses(engine: Any, compiled: Any, ids: list[int], bitmask: np.ndarray, eos: int) -> bool:
    matcher = engine.matcher(compiled)
    for token in ids:
        engine.fill(matcher, bitmask)
        if not _allowed(bitmask, token) or not engine.accept(matcher, token):
            return True
    engine.fill(matcher, bitmask)
    return not _allowed(bitmask, eos)


def _gil_share(engine: Any, compiled: Any, bitmask: np.ndarray, seconds: float = 1.0) -> dict[str, float]:
    """The main thread's pure-Python count rate while another thread fills masks, over its idle rate;
    and the same beside a worker that runs Python (holds the GIL) for comparison."""
    def count(stop: threading.Event) -> int:
        n = 0
        while not stop.is_set():
            n += 1
        return n

    def timed_count() -> float:
        stop = threading.Event()
        timer = threading.Timer(seconds, stop.set)
        timer.start()
        return count(stop) / seconds

    def beside(work: Any) -> float:
        stop = threading.Event()
        worker = threading.Thread(target=lambda: [work() for _ in iter(stop.is_set, True)])
        worker.start()
        rate = timed_count()
        stop.set()
        worker.join()
        return rate

    idle = timed_count()
    own, matcher = np.empty_like(bitmask), engine.matcher(compiled)
    python = beside(lambda: sum(range(2000)))  # a worker that holds the GIL: the floor
    masks = beside(lambda: engine.fill(matcher, own))
    return {"gil_share": masks / idle, "gil_share_python_worker": python / idle}


def run_engine(name: str, tokenizer_path: str, vocab_size: int | None, eos: int) -> dict[str, Any]:
    from tokenizers import Tokenizer

    text = open(tokenizer_path, encoding="utf-8").read()
    tokenizer = Tokenizer.from_str(text)
    vocab_size = vocab_size or tokenizer.get_vocab_size()
    before = set(sys.modules)
    started = time.perf_counter()
    __import__(name)
    imported = time.perf_counter() - started
    heavy = sorted({"torch", "transformers"} & (set(sys.modules) - before))
    engine = ADAPTERS[name]()
    started = time.perf_counter()
    engine.setup(text, vocab_size, eos)
    setup_s = time.perf_counter() - started
    bitmask = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
    out: dict[str, Any] = {"engine": name, "import_s": imported, "imports": heavy, "setup_s": setup_s, "schemas": {}}
    cases = {**{k: v for k, v in SCHEMAS.items()}, JSON_OBJECT: (JSON_OBJECT, {"a": [1, {"b": None}], "c": "d"}, None)}
    for case, (schema, good, bad) in cases.items():
        row: dict[str, Any] = {}
        try:
            started = time.perf_counter()
            compiled = engine.compile(schema)
            row["compile_s"] = time.perf_counter() - started
        except Exception as exc:  # noqa: BLE001 - an unsupported feature is a result here
            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            out["schemas"][case] = row
            continue
        ids = tokenizer.encode(_instance_text(good), add_special_tokens=False).ids
        walk = _walk(engine, compiled, ids, eos, bitmask)
        times = sorted(walk.pop("mask_us"))
        row.update(walk, steps=len(times), mask_median_us=1e6 * statistics.median(times),
                   mask_p99_us=1e6 * times[min(len(times) - 1, int(0.99 * len(times)))],
                   mask_mean_us=1e6 * statistics.fmean(times))
        if bad is not None:
            row["invalid_refused"] = _refuses(engine, compiled, tokenizer.encode(_instance_text(bad),
                                                                                 add_special_tokens=False).ids,
                                              bitmask, eos)
        out["schemas"][case] = row
    compiled = engine.compile(SCHEMAS["nested_arrays"][0])
    out.update(_gil_share(engine, compiled, bitmask))
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def _table(results: list[dict[str, Any]]) -> str:
    lines = ["| engine | import s (brings) | set-up s | schema | compile + first mask ms | mask median / p99 / mean µs | "
             "valid held | invalid refused |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "failed" in r:
            lines.append(f"| {r['engine']} | failed: {r['failed']} | | | | | | |")
            continue
        head = f"| {r['engine']} | {r['import_s']:.2f} ({', '.join(r['imports']) or '-'}) | {r['setup_s']:.2f} |"
        for case, row in r["schemas"].items():
            if "error" in row:
                lines.append(f"{head} {case} | error: {row['error'][:60]} | | | |")
            else:
                lines.append(f"{head} {case} | {1e3 * row['compile_s']:.1f} + {1e3 * row['first_mask_s']:.1f} | {row['mask_median_us']:.0f} / "
                             f"{row['mask_p99_us']:.0f} / {row['mask_mean_us']:.0f} | {row['valid_accepted']} | "
                             f"{row.get('invalid_refused', '-')} |")
            head = "| | | |"
        lines.append(f"| {r['engine']} | GIL: a Python counter runs at {100 * r['gil_share']:.0f}% of its idle rate beside "
                     f"a thread filling masks ({100 * r['gil_share_python_worker']:.0f}% beside a Python thread) | "
                     f"peak RSS {r['peak_rss_mib']:.0f} MiB | | | | | |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", required=True, help="a tokenizer.json (a kiln artifact's)")
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--eos", type=int, default=2, help="the end-of-sequence id (SmolLM2's <|im_end|>: 2)")
    parser.add_argument("--vocab-size", type=int, default=None, help="the model's vocabulary (default: the tokenizer's)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_engine(args.child, args.tokenizer, args.vocab_size, args.eos)))
        return
    results = []
    for name in args.engines.split(","):
        command = [sys.executable, __file__, "--tokenizer", args.tokenizer, "--eos", str(args.eos), "--child", name]
        if args.vocab_size:
            command += ["--vocab-size", str(args.vocab_size)]
        done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        if done.returncode:
            results.append({"engine": name, "failed": done.stderr.strip().splitlines()[-1] if done.stderr else done.returncode})
        else:
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
