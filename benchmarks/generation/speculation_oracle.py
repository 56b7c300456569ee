"""Speculative decoding's speed-up as a function of acceptance, with an oracle drafter: it proposes the plain
answer's next tokens with a set share of them replaced by a wrong token, so the acceptance is chosen rather
than earned. For a model with random weights (whose own drafts would mean nothing) this is the curve a real
drafter would sit on; a share of 0 is the cost of the machinery when every draft is right.
``--draft-model DRAFT`` adds a real drafter to the same rounds: ``--speculate draft-model`` with that
artifact (the target itself: every greedy draft right, and the draft model's own calls paid).

    PYTHONPATH=src python benchmarks/generation/speculation_oracle.py ARTIFACT [--shares 0,0.25,0.5,0.75] \
        [--draft-model DRAFT] [--prompts 4] [--max-tokens 48] [--rounds 2] [--out FILE]

ARTIFACT: a text-generation artifact whose serving graph has KilnAttention. One stream; each prompt (the
grounded and open prompts of prompts/speculation.json through the chat template) answered greedily, plainly
and with the oracle at each share in turn, the order turned every round; decode tokens/s = (tokens - 1) /
(last token's time - first token's), summed over the prompts; the drafter's proposals go through kiln's
own policy (how many tokens to draft from the measured acceptance and the call costs). Every answer is
compared with the plain one: the number that differ must be 0."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

PROMPTS = Path(__file__).parent / "prompts" / "speculation.json"


class OracleDrafter:
    """The plain answer's next tokens, each replaced (by the next token id) with probability ``share``,
    decided once per position (a seeded draw), so a token refused once is refused again."""

    costly = False  # known answers: a proposal costs nothing
    token_seconds = 0.0

    def __init__(self, answer: Sequence[int], share: float, seed: int):
        rng = random.Random(seed)
        self.tokens = [t + 1 if rng.random() < share else t for t in answer]
        self.at = 0  # answer tokens seen

    def extend(self, tokens: Iterable[int]) -> None:
        self.at += sum(1 for _ in tokens)

    def propose(self, k: int) -> list[int]:
        return self.tokens[self.at:self.at + k]

    def close(self) -> None:
        pass


class OracleSpeculation:
    """What the core asks of its speculation settings, with an oracle for each prompt."""

    method = "ngram"  # a drafter without a model of its own (the core opens none)

    def __init__(self, answers: dict[tuple[int, ...], list[int]], share: float, draft_tokens: int):
        self.answers, self.share, self.draft_tokens = answers, share, draft_tokens
        self.on = True

    def speculator(self, prompt_ids: Sequence[int], draft_model=None):  # type: ignore[no-untyped-def]
        from modelkiln.generation.speculation import Speculator

        key = tuple(prompt_ids)
        return Speculator(OracleDrafter(self.answers[key], self.share, hash(key) & 0xFFFF), self.draft_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--variant", default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shares", default="0,0.25,0.5,0.75", help="shares of the drafted tokens made wrong")
    parser.add_argument("--prompts", type=int, default=4, help="prompts of each set (grounded, open)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--draft-tokens", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--draft-model", default=None, help="also speculate with this draft model's artifact")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from modelkiln.generation.core import CoreHooks, EngineCore, Request, greedy, run_to_completion
    from modelkiln.generation.engines.registry import EngineOptions
    from modelkiln.generation.model import CoreOptions, TextGenerationModel
    from modelkiln.generation.speculation import DEFAULT_DRAFT_TOKENS, SpeculationOptions
    from modelkiln.machine import cpu_description

    class Acceptance(CoreHooks):
        def __init__(self) -> None:
            self.drafted = self.accepted = 0

        def speculated(self, request, drafted, accepted):  # type: ignore[no-untyped-def]
            self.drafted, self.accepted = self.drafted + drafted, self.accepted + accepted

    model = TextGenerationModel(Path(args.artifact))
    engine = model.engine(args.variant, EngineOptions(threads=args.threads, max_rows=4))
    if not engine.capabilities.verifies_drafts:
        raise SystemExit("this artifact's serving graph has no KilnAttention: nothing to speculate with")
    engine.warm_up()
    texts = json.loads(PROMPTS.read_text())
    prompts = [model.prompt_ids(text, chat=True) for name in ("grounded", "open") for text in texts[name][:args.prompts]]
    plain = EngineCore(engine, model.tokenizer, model.eos_ids, max_running=4)

    def run(core: EngineCore, i: int, ids: list[int]) -> tuple[list[int], float]:
        """The answer's tokens and its decode seconds (first token to last)."""
        first = last = 0.0
        tokens: list[int] = []
        for output in run_to_completion(core, [Request(i, ids, greedy(args.max_tokens))]):
            if output.error is not None:
                raise output.error
            last = time.perf_counter()
            first = first or last
            tokens.append(output.delta.token_id)
        return tokens, last - first

    answers = {tuple(ids): run(plain, i, ids)[0] for i, ids in enumerate(prompts)}
    shares = [float(s) for s in args.shares.split(",") if s]
    draft_tokens = args.draft_tokens or DEFAULT_DRAFT_TOKENS
    ways: dict[str, tuple[EngineCore, Acceptance | None]] = {"plain": (plain, None)}
    for share in shares:
        hooks = Acceptance()
        core = EngineCore(engine, model.tokenizer, model.eos_ids, max_running=4, hooks=hooks)
        core.speculation = OracleSpeculation(answers, share, draft_tokens)  # type: ignore[assignment]
        ways[f"{share:.0%} wrong"] = (core, hooks)
    if args.draft_model:  # the product's own path: the draft model's artifact checked and opened by the model
        speculation = SpeculationOptions("draft-model", draft_tokens, args.draft_model)
        draft = model.draft_model(CoreOptions(threads=args.threads, max_running=4, speculation=speculation,
                                              warm_up=True))
        hooks = Acceptance()
        ways["draft model"] = (EngineCore(engine, model.tokenizer, model.eos_ids, max_running=4, hooks=hooks,
                                          speculation=speculation, draft_model=draft), hooks)
    rates: dict[str, list[float]] = {way: [] for way in ways}
    changed = 0
    for round_ in range(args.rounds):
        order = list(ways) if round_ % 2 == 0 else list(reversed(ways))
        tokens = {way: 0 for way in ways}
        seconds = {way: 0.0 for way in ways}
        for i, ids in enumerate(prompts):
            for way in order:
                got, decode_s = run(ways[way][0], i, ids)
                changed += got != answers[tuple(ids)]
                tokens[way] += len(got) - 1
                seconds[way] += decode_s
        for way in ways:
            rates[way].append(tokens[way] / seconds[way])
        print(f"round {round_ + 1}: " + ", ".join(f"{w} {rates[w][-1]:.1f} tok/s" for w in ways), flush=True)
    base = statistics.median(rates["plain"])
    table = {}
    for way, (_, hooks) in ways.items():
        rate = statistics.median(rates[way])
        table[way] = {"tok_s": round(rate, 2), "vs_plain": round(rate / base, 3),
                      "acceptance": round(hooks.accepted / hooks.drafted, 3) if hooks and hooks.drafted else None}
    drafter = f", draft model {Path(args.draft_model).name}" if args.draft_model else ""
    header = (f"{model.name}{drafter}: one stream, {len(prompts)} prompts, {args.max_tokens} greedy tokens, up to {draft_tokens} "
              f"drafted a step, {args.rounds} rounds (medians), {args.threads} threads; CPU {cpu_description()}")
    lines = [header, f"{'drafter':<12} {'tok/s':>8} {'vs plain':>9} {'acceptance':>11}"]
    lines += [f"{w:<12} {r['tok_s']:>8.2f} {r['vs_plain']:>9.3f} {r['acceptance'] if r['acceptance'] is not None else '-':>11}"
              for w, r in table.items()]
    lines.append(f"answers that differ from the plain ones: {changed}")
    print("\n".join(lines))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(lines) + "\n")
        Path(args.out).with_suffix(".json").write_text(json.dumps({"table": table, "answers_changed": changed,
                                                                   "args": vars(args)}, indent=1) + "\n")


if __name__ == "__main__":
    main()
