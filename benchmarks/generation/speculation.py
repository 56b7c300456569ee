"""Speculative decoding (n-gram drafts) against plain decoding on the ONNX serving engine, on an
artifact whose serving graph has KilnAttention (a GGUF variant converted by this kiln):

    kiln convert $(python -m modelkiln.embedded SmolLM2-135M-Instruct) --out /tmp/smollm2-ka
    PYTHONPATH=src python benchmarks/generation/speculation.py /tmp/smollm2-ka --rounds 3 \
        --out benchmarks/results/speculation/smollm2-135m.json

Prompts: benchmarks/generation/prompts/speculation.json, written for this benchmark: 'grounded'
ones whose answers quote their prompt (extraction to JSON, rewriting or correcting a paragraph,
editing code) and 'open' chat prompts, each through the artifact's chat template. Per set and
sampling (greedy; temperature 0.7, top_p 0.95, seeded): one stream at a time, each prompt answered
plainly and with speculation in turn (the order swapped every round, so another load on the machine
falls on both), decode tokens/s = (tokens - 1) / (last token's time - first token's), summed over
the prompts; then 16 streams at once (8 grounded + 8 open prompts), tokens/s over the wall time.
Every speculative answer is compared with the plain one: the number that differ must be 0. The
acceptance: accepted / drafted tokens (the core's hooks)."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

PROMPTS = Path(__file__).parent / "prompts" / "speculation.json"
SAMPLINGS = {"greedy": {}, "t0.7 top_p0.95": {"temperature": 0.7, "top_p": 0.95}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--variant", default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--draft-tokens", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--limit", type=int, default=None, help="prompts per set (a quick run)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from modelkiln.generation.core import CoreHooks, EngineCore, Request, run_to_completion
    from modelkiln.generation.engines.registry import EngineOptions
    from modelkiln.generation.model import TextGenerationModel
    from modelkiln.generation.sampling import SamplingParams
    from modelkiln.generation.speculation import DEFAULT_DRAFT_TOKENS, SpeculationOptions
    from modelkiln.machine import cpu_description

    class Acceptance(CoreHooks):
        def __init__(self) -> None:
            self.drafts = self.drafted = self.accepted = 0

        def speculated(self, request, drafted, accepted):  # type: ignore[no-untyped-def]
            self.drafts, self.drafted, self.accepted = self.drafts + 1, self.drafted + drafted, self.accepted + accepted

    model = TextGenerationModel(Path(args.artifact))
    engine = model.engine(args.variant, EngineOptions(threads=args.threads, max_rows=16))
    if not engine.capabilities.verifies_drafts:
        raise SystemExit("this artifact's serving graph has no KilnAttention: nothing to speculate with")
    engine.warm_up()
    draft_tokens = args.draft_tokens or DEFAULT_DRAFT_TOKENS
    acceptance = Acceptance()
    cores = {"plain": EngineCore(engine, model.tokenizer, model.eos_ids, max_running=16),
             "speculative": EngineCore(engine, model.tokenizer, model.eos_ids, max_running=16, hooks=acceptance,
                                       speculation=SpeculationOptions("ngram", draft_tokens))}
    prompts = json.loads(PROMPTS.read_text())
    sets = {name: [model.prompt_ids(text, chat=True) for text in prompts[name][:args.limit]]
            for name in ("grounded", "open")}

    def run(mode: str, batch: list[tuple[str, list[int], SamplingParams]]) -> tuple[dict, float, float]:
        """Answers (token ids) by id, the decode seconds summed over requests, the wall seconds."""
        firsts: dict = {}
        lasts: dict = {}
        answers: dict = {}
        started = time.perf_counter()
        for output in run_to_completion(cores[mode], [Request(rid, ids, params) for rid, ids, params in batch]):
            if output.error is not None:
                raise output.error
            now = time.perf_counter()
            firsts.setdefault(output.request_id, now)
            lasts[output.request_id] = now
            answers.setdefault(output.request_id, []).append(output.delta.token_id)
        wall = time.perf_counter() - started
        return answers, sum(lasts[r] - firsts[r] for r in answers), wall

    results: dict = {"model": model.name, "artifact": str(args.artifact), "cpu": cpu_description(), "threads": args.threads,
                     "draft_tokens": draft_tokens, "max_tokens": args.max_tokens, "rounds": []}
    changed = 0
    for round_ in range(args.rounds):
        order = ["plain", "speculative"] if round_ % 2 == 0 else ["speculative", "plain"]
        row: dict = {"order": order}
        for set_name, set_prompts in sets.items():
            for sampling_name, sampling in SAMPLINGS.items():
                tokens = {m: 0 for m in order}
                seconds = {m: 0.0 for m in order}
                before = (acceptance.drafted, acceptance.accepted)
                for i, ids in enumerate(set_prompts):
                    params = SamplingParams(max_new_tokens=args.max_tokens, seed=1000 + i, **sampling)
                    got = {}
                    for mode in order:
                        answers, decode_s, _ = run(mode, [((mode, i), ids, params)])
                        got[mode] = answers[(mode, i)]
                        tokens[mode] += len(got[mode]) - 1
                        seconds[mode] += decode_s
                    changed += got["plain"] != got["speculative"]
                drafted, accepted = acceptance.drafted - before[0], acceptance.accepted - before[1]
                rates = {m: tokens[m] / seconds[m] for m in order}
                row[f"{set_name} {sampling_name}"] = {
                    "plain_tok_s": round(rates["plain"], 1), "speculative_tok_s": round(rates["speculative"], 1),
                    "ratio": round(rates["speculative"] / rates["plain"], 3), "tokens": tokens["plain"],
                    "acceptance": round(accepted / drafted, 3) if drafted else None, "drafted": drafted}
                print(round_, set_name, sampling_name, row[f"{set_name} {sampling_name}"], flush=True)
        # 16 streams at once: 8 grounded and 8 open prompts
        crowd = (sets["grounded"][:8] + sets["open"][:8])[:16]
        for sampling_name, sampling in SAMPLINGS.items():
            walls, tokens16, got16 = {}, {}, {}
            for mode in order:
                batch = [((mode, i), ids, SamplingParams(max_new_tokens=args.max_tokens, seed=2000 + i, **sampling))
                         for i, ids in enumerate(crowd)]
                answers, _, walls[mode] = run(mode, batch)
                tokens16[mode] = sum(len(a) for a in answers.values())
                got16[mode] = [answers[(mode, i)] for i in range(len(crowd))]
            changed += sum(a != b for a, b in zip(got16["plain"], got16["speculative"]))
            rates = {m: tokens16[m] / walls[m] for m in order}
            row[f"16 streams {sampling_name}"] = {"plain_tok_s": round(rates["plain"], 1),
                                                  "speculative_tok_s": round(rates["speculative"], 1),
                                                  "ratio": round(rates["speculative"] / rates["plain"], 3)}
            print(round_, "16 streams", sampling_name, row[f"16 streams {sampling_name}"], flush=True)
        results["rounds"].append(row)
    keys = [k for k in results["rounds"][0] if k != "order"]
    results["median_ratio"] = {k: round(statistics.median(r[k]["ratio"] for r in results["rounds"]), 3) for k in keys}
    results["answers_changed"] = changed
    print(json.dumps({"cpu": results["cpu"], "median_ratio": results["median_ratio"], "answers_changed": changed},
                     indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
