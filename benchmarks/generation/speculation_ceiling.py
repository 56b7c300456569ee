"""How far prompt lookup can take speculative decoding on a model's own answers: the speed-up that
drafting by n-gram lookup (``NgramDrafter``) could give at best, against what the policy gets.

    PYTHONPATH=src python benchmarks/generation/speculation_ceiling.py ARTIFACT \
        --out benchmarks/results/speculation/ceiling-smollm2.json

It records the artifact's plain answers to the speculation benchmark's prompts (greedy, and seeded
temperature 0.7 / top_p 0.95; ``prompts/speculation.json``), and the seconds of a one-row decode
call feeding 1 + k tokens (k drafted tokens, all accepted: an oracle drafter). Then it replays
speculation over the recorded answers, which fix every step's outcome (a drafted token is accepted
while it equals the answer's token there):
- ``policy``: the core's speculator (``speculation/policy.py``) with the measured call costs;
- ``best length``: the same proposals, each cut to exactly the tokens that will be accepted (no
  drafted token wasted: what no length policy can beat);
- ``free verify, c candidates``: tokens per call if verifying cost nothing more than a decode step,
  with the best of up to c proposals (the continuations of different earlier occurrences of the last
  1-3 tokens, as a tree of drafts would verify them): the most prompt lookup can give at all.
Ratios are against plain decoding's time for the same answers (a call of one token per token)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from speculation import PROMPTS, SAMPLINGS  # noqa: E402
from speculation_oracle import OracleSpeculation  # noqa: E402

DRAFTS = range(1, 17)  # drafted tokens per call whose cost is measured


def replay(prompt: list[int], answer: list[int], speculator, cost: Callable[[int], float],
           cut: bool = False) -> tuple[float, int, int]:
    """Seconds, drafted and accepted tokens of speculating ``answer`` (its first token is the
    prompt's); ``cut``: every proposal cut to the tokens that will be accepted."""
    seconds, drafted, accepted, at = 0.0, 0, 0, 1

    def relative(k: int) -> float:
        return cost(1 + k) / cost(1)

    while at < len(answer):
        left = len(answer) - at - 1
        draft = speculator.draft(answer[:at], min(16, left), 1, relative) if left > 0 else []
        match = 0
        while match < len(draft) and draft[match] == answer[at + match]:
            match += 1
        if cut:
            draft = draft[:match]
        if draft:
            speculator.verified(len(draft), match)
        seconds += cost(1 + len(draft))
        drafted, accepted, at = drafted + len(draft), accepted + match, at + match + 1
    return seconds, drafted, accepted


class Proposals:
    """Every distinct continuation (up to ``limit``) of the last 3, 2 or 1 tokens' earlier occurrences
    in prompt + answer, longest match and latest occurrence first."""

    def __init__(self, limit: int):
        self.limit = limit

    def __call__(self, tokens: Sequence[int], k: int = 16) -> list[list[int]]:
        found: list[list[int]] = []
        end = len(tokens)
        for n in range(min(3, end - 1), 0, -1):
            suffix = list(tokens[end - n:])
            for start in range(end - n - 1, -1, -1):
                if list(tokens[start:start + n]) == suffix:
                    continuation = list(tokens[start + n:start + n + k])
                    if continuation and continuation not in found:
                        found.append(continuation)
                        if len(found) == self.limit:
                            return found
        return found


def tokens_per_call(prompt: list[int], answer: list[int], proposals: Proposals) -> tuple[int, int]:
    """Answer tokens after the first, and calls, verifying the best proposal each call at no cost."""
    at, calls = 1, 0
    while at < len(answer):
        best = 0
        for continuation in proposals(prompt + answer[:at]):
            match = 0
            while match < len(continuation) and at + match < len(answer) and continuation[match] == answer[at + match]:
                match += 1
            best = max(best, match)
        at, calls = at + best + 1, calls + 1
    return len(answer) - 1, calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--variant", default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from modelkiln.generation.core import EngineCore, Request, run_to_completion
    from modelkiln.generation.engines.registry import EngineOptions
    from modelkiln.generation.model import TextGenerationModel
    from modelkiln.generation.sampling import SamplingParams
    from modelkiln.generation.speculation import DEFAULT_DRAFT_TOKENS, NgramDrafter, Speculator
    from modelkiln.machine import cpu_description

    model = TextGenerationModel(Path(args.artifact))
    engine = model.engine(args.variant, EngineOptions(threads=args.threads, max_rows=4))
    if not engine.capabilities.verifies_drafts:
        raise SystemExit("this artifact's serving graph has no KilnAttention: nothing to speculate with")
    engine.warm_up()
    plain = EngineCore(engine, model.tokenizer, model.eos_ids, max_running=4)

    def answer(core: EngineCore, ids: list[int], params: SamplingParams) -> list[int]:
        tokens = []
        for output in run_to_completion(core, [Request(0, ids, params)]):
            if output.error is not None:
                raise output.error
            tokens.append(output.delta.token_id)
        return tokens

    texts = json.loads(PROMPTS.read_text())
    answers: dict[str, list[tuple[list[int], list[int]]]] = {}
    for set_name in ("grounded", "open"):
        for sampling_name, sampling in SAMPLINGS.items():
            rows = []
            for i, text in enumerate(texts[set_name]):
                ids = model.prompt_ids(text, chat=True)
                rows.append((ids, answer(plain, ids, SamplingParams(max_new_tokens=args.max_tokens, seed=1000 + i,
                                                                      **sampling))))
            answers[f"{set_name} {sampling_name}"] = rows
    # a call's seconds by the tokens it feeds: the core measures its calls while speculating
    grounded = answers["grounded greedy"][:6]
    measured: dict[int, float] = {}
    for k in DRAFTS:
        core = EngineCore(engine, model.tokenizer, model.eos_ids, max_running=4,
                          speculation=OracleSpeculation({tuple(p): a for p, a in grounded}, 0.0, k))
        for ids, _ in grounded:
            answer(core, ids, SamplingParams(max_new_tokens=args.max_tokens))
        measured.update({n: s for n, s in core._call_costs._seconds.items() if n not in measured or n == 1 + k})
    # a bigger call costs at least what a smaller one does: a sample above a later one is noise
    sizes = sorted(measured)
    costs = {n: min(measured[m] for m in sizes if m >= n) for n in sizes}

    def cost(n: int) -> float:
        return costs[min(n, max(sizes))]

    results: dict = {"model": model.name, "artifact": str(args.artifact), "cpu": cpu_description(),
                     "threads": args.threads, "call_ms": {n: round(s * 1000, 3) for n, s in costs.items()}, "sets": {}}
    lines = [f"{model.name}: prompt lookup's ceiling on its own answers, {args.threads} threads, CPU {results['cpu']}",
             "call ms by tokens fed: " + ", ".join(f"{n}: {s * 1000:.2f}" for n, s in costs.items()),
             f"{'answers':24s} {'policy':>8s} {'best length':>12s} " +
             " ".join(f"{'free, ' + str(c):>9s}" for c in (1, 2, 4, 8)) + "   (x plain; free, c: tokens a call)"]
    for name, rows in answers.items():
        plain_s = sum((len(a) - 1) * cost(1) for _, a in rows)
        policy = [replay(p, a, Speculator(NgramDrafter(p), DEFAULT_DRAFT_TOKENS), cost) for p, a in rows]
        best = [replay(p, a, Speculator(NgramDrafter(p), 16), cost, cut=True) for p, a in rows]
        free = {}
        for c in (1, 2, 4, 8):
            counts = [tokens_per_call(p, a, Proposals(c)) for p, a in rows]
            free[c] = round(sum(t for t, _ in counts) / sum(n for _, n in counts), 3)
        row = {"policy": round(plain_s / sum(s for s, _, _ in policy), 3),
               "policy_acceptance": round(sum(a for _, _, a in policy) / max(1, sum(d for _, d, _ in policy)), 3),
               "best_length": round(plain_s / sum(s for s, _, _ in best), 3), "free_verify_tokens_per_call": free}
        results["sets"][name] = row
        lines.append(f"{name:24s} {row['policy']:8.3f} {row['best_length']:12.3f} " +
                     " ".join(f"{free[c]:9.3f}" for c in (1, 2, 4, 8)))
    print("\n".join(lines))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
        Path(args.out).with_suffix(".txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
