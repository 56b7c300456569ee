"""The host sampler alone: milliseconds to choose one token from one row of real logits, for the
settings people use, and the same tokens as the whole-vocabulary rule.

Rows: SmolLM2-135M-Instruct's own logits (vocabulary 49,152) while it answers STS-B sentences as chat
prompts, sampled at temperature 0.7 and top_p 0.95 through the engine core. Rows of 151,936 (Qwen2.5's
vocabulary) are the same rows extended with values drawn from each row's lower half, so the likely
tokens stay as the model gave them and the vocabulary passes cost what they would at that size. A last
table takes flat rows (normal, standard deviation 0.5: what a model with random weights gives, whose
nucleus holds most of the vocabulary), the hardest case for top-p.

For each setting: the time of ``TokenChooser.choose`` (bias and penalties included, one row at a
time as the host engines call it) with today's sampler, with its exact path alone (numpy's own
exponentials and sums: ``selection.exact_draw``, what takes the rows the bounded draw declines), and
with the whole-vocabulary rule they must equal (``selection.reference_draw``, the first sampler); how
many of the chosen tokens differ from the rule's over every row and several uniforms (must be 0); and
how many rows the bounded draw declined.

    python benchmarks/generation/sampler.py ARTIFACT --rows 256 --out benchmarks/results/sampler
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from modelkiln.data import sts_sentences
from modelkiln.generation.core import Request
from modelkiln.generation.model import CoreOptions, TextGenerationModel
from modelkiln.generation.sampling import SamplingParams, TokenChooser
from modelkiln.generation.sampling import selection
from modelkiln.machine import cpu_description
from modelkiln.native import sampling_library

SETTINGS = {
    "greedy": SamplingParams(),
    "temperature 0.7": SamplingParams(temperature=0.7),
    "temperature 0.7, top_p 0.95": SamplingParams(temperature=0.7, top_p=0.95),
    "temperature 0.7, top_k 40": SamplingParams(temperature=0.7, top_k=40),
    "temperature 0.7, min_p 0.05": SamplingParams(temperature=0.7, min_p=0.05),
    "temperature 0.7, top_p 0.95, min_p 0.05": SamplingParams(temperature=0.7, top_p=0.95, min_p=0.05),
    "top_p 0.95, top_k 40, min_p 0.05, penalties, bias": SamplingParams(
        temperature=0.7, top_p=0.95, top_k=40, min_p=0.05, repetition_penalty=1.1, frequency_penalty=0.5,
        presence_penalty=0.3, logit_bias=((11, 2.0), (13, -5.0))),
}
LARGE_VOCAB = 151_936


def real_rows(artifact: Path, count: int) -> np.ndarray:
    """``count`` rows of the model's logits, as its sampled answers to STS-B sentences produce them."""
    model = TextGenerationModel(artifact)
    core = model.core(options=CoreOptions(threads=2, keep_logits=True))
    rows: list[np.ndarray] = []
    params = SamplingParams(max_new_tokens=64, temperature=0.7, top_p=0.95, seed=0)
    for i, text in enumerate(sts_sentences()):
        if len(rows) >= count:
            break
        core.add_request(Request(i, model.prompt_ids(text, chat=True), params))
        while core.has_work():
            rows += [np.asarray(output.logits, dtype=np.float32) for output in core.step() if output.logits is not None]
    return np.stack(rows[:count])


def extended(rows: np.ndarray, vocab: int, rng: np.random.Generator) -> np.ndarray:
    out = np.empty((rows.shape[0], vocab), dtype=np.float32)
    for i, row in enumerate(rows):
        low = row[row < np.median(row)]
        out[i] = np.concatenate([row, rng.choice(low, vocab - row.shape[0])])
    return out


def chooser_drawing_with(draw: Callable[[np.ndarray, SamplingParams, float], int]) -> type[TokenChooser]:
    """A TokenChooser with the same bias and penalties whose sampled rows are drawn by ``draw``."""

    class Chooser(TokenChooser):
        def choose(self, logits, allowed=None):
            scores = self._processed(logits)
            p = self.params
            token = int(np.argmax(scores)) if p.greedy else draw(scores, p, self._uniform())
            self._record(token)
            return token

    return Chooser


ReferenceChooser = chooser_drawing_with(selection.reference_draw)  # the sampler before: the whole-vocabulary rule
ExactChooser = chooser_drawing_with(selection.exact_draw)  # today's without its bounded draw: numpy's exponentials


def declined(params: SamplingParams, rows: np.ndarray, seeds: int) -> int:
    """How many of the rows x seeds draws the bounded draw hands to the exact path."""
    library = sampling_library()
    if params.greedy or library is None:
        return 0
    count = 0
    for seed in range(seeds):
        chooser = TokenChooser(params, seed, range(200))
        for row in rows:
            scores, u = chooser._processed(row), chooser._uniform()
            count += selection.bounded_draw(library, scores, params, u) < 0
            chooser.choose(row)
    return count


def per_token_ms(chooser_type: type, params: SamplingParams, rows: np.ndarray, repeats: int) -> float:
    """Median over ``repeats`` passes of the mean time a row (a new chooser a pass, as a new request)."""
    times = []
    for r in range(repeats):
        chooser = chooser_type(params, seed=r, prompt_ids=range(200))
        started = time.perf_counter()
        for row in rows:
            chooser.choose(row)
        times.append((time.perf_counter() - started) / rows.shape[0] * 1e3)
    return float(np.median(times))


def differing(params: SamplingParams, rows: np.ndarray, seeds: int) -> tuple[int, int]:
    """(tokens that differ between the two samplers, tokens compared) over every row and ``seeds`` seeds."""
    differ = compared = 0
    for seed in range(seeds):
        new, old = TokenChooser(params, seed, range(200)), ReferenceChooser(params, seed, range(200))
        for row in rows:
            differ += new.choose(row) != old.choose(row)
            compared += 1
    return differ, compared


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seeds", type=int, default=4, help="seeds of the equality check (rows x seeds draws)")
    parser.add_argument("--out", type=Path, help="write OUT.txt and OUT.json")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    rows = real_rows(args.artifact, args.rows)
    tables = {(rows.shape[1], "real"): rows, (LARGE_VOCAB, "real"): extended(rows, LARGE_VOCAB, rng),
              (128_256, "flat"): rng.normal(0, 0.5, (min(64, rows.shape[0]), 128_256)).astype(np.float32)}
    lines = [f"host sampler, one row at a time: {cpu_description()}; {rows.shape[0]} rows of real logits",
             f"{'rows':>5} {'vocabulary':>10}  {'setting':<52} {'before ms':>9} {'exact ms':>8} {'now ms':>8} "
             f"{'x exact':>7} {'differ':>12} {'declined':>12}"]
    results = []
    for (vocab, kind), table in tables.items():
        for name, params in SETTINGS.items():
            repeats = args.repeats if kind == "real" else 1
            before = per_token_ms(ReferenceChooser, params, table, repeats)
            exact = per_token_ms(ExactChooser, params, table, repeats)
            now = per_token_ms(TokenChooser, params, table, repeats)
            seeds = args.seeds if vocab == rows.shape[1] else 1
            differ, compared = differing(params, table, seeds)
            refused = declined(params, table, seeds)
            results.append({"rows": kind, "vocab": vocab, "setting": name, "before_ms": before, "exact_ms": exact,
                            "now_ms": now, "differ": differ, "compared": compared, "declined": refused})
            lines.append(f"{kind:>5} {vocab:>10,}  {name:<52} {before:9.3f} {exact:8.3f} {now:8.3f} "
                         f"{exact / now:6.1f}x {differ:>4} of {compared:<5} {refused:>4} of {compared:<5}")
            print(lines[-1], flush=True)
    text = "\n".join(lines)
    print()
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".txt").write_text(text + "\n")
        args.out.with_suffix(".json").write_text(json.dumps({"cpu": cpu_description(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
