"""The fault suite: a real ``kiln serve`` attacked by misrouting, bad-input, overload, disconnect,
SIGTERM, soak and security probes, each reported with a count, an outcome and its goal, in
``benchmarks/results/reliability.{json,txt}``. Exits 1 when a probe misses its goal.

    python tests/reliability/fault_suite.py                        # full: 100,000 answers, 30-minute soak
    python tests/reliability/fault_suite.py --short                # CI's form: a few thousand requests, < 3 min
    python tests/reliability/fault_suite.py ARTIFACT --variant fp32 --soak-minutes 5 --probes misrouting,soak

The artifact (default ``artifacts/all-MiniLM-L6-v2``, from ``make demo``) is a sentence-embeddings
model (a vector per text is what makes a swapped answer visible) or a text-generation model (the
generation mode: greedy answers, streamed; its probes are ``faultsuite/generation_*.py``). Texts
are real (STS-B sentences, SQuAD questions and paragraphs packaged with modelkiln). Every answer is
checked against the answer its text gets alone, on the idle server, before any load. The server
runs with an API key (every probe sends it), its default bind address, a small queue (so that 10x
the concurrency it holds is a few hundred connections) and otherwise its defaults. The probes are
in ``tests/reliability/faultsuite/``; docs/reliability.md explains each and shows a run. Its short form is
a test (``test_reliability.py`` beside it, ``make reliability``); the long form is this command, whose report
``benchmarks/results/`` keeps."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# As pytest's pythonpath has it: src/, and tests/ for the test suite's shared tables (error_cases.py); then
# this folder, for faultsuite/.
sys.path[:0] = [str(Path(__file__).resolve().parent), str(REPO / "src"), str(REPO / "tests")]

from faultsuite import generation_hostile, generation_load, hostile, load  # noqa: E402
from faultsuite.harness import KilnServer, ProbeResult, References, load_texts, once, request_bytes  # noqa: E402

PROBES = ("misrouting", "bad-input", "disconnects", "overload", "soak", "security", "sigterm")
MODEL = "emb"  # the name the model is served under (tests/error_cases.py's embedding model)
QUEUE = 128
# Generation: sequences running together and requests waiting. 10x their sum is the overload probe's
# connections (240), as the encoder's 160.
GENERATION_RUNNING, GENERATION_QUEUE = 8, 16


def plan(args: argparse.Namespace) -> dict:
    """How much of each probe: the short form (CI) or the full one."""
    short = args.short
    return {"short_texts": 300 if short else None, "long_texts": 30 if short else None,
            "answers": args.answers or (3_000 if short else 100_000), "clients": 24,
            "repeats": 1 if short else 10, "fuzz": 150 if short else 2_000, "good_clients": 4,
            "disconnects": 10 if short else 30, "overload_s": 5.0 if short else 20.0,
            "soak_s": 60 * (args.soak_minutes if args.soak_minutes is not None else (0.33 if short else 30.0)),
            "soak_clients": 8, "sigterm_clients": 16, "sigterm_load_s": 1.5 if short else 3.0}


def plan_generation(args: argparse.Namespace) -> dict:
    """How much of each probe in the generation mode. Answers are greedy, ``max_tokens`` long at
    most; each prompt's answer alone is taken on each of the three streamed routes first."""
    short = args.short
    return {"short_prompts": 40 if short else 60, "long_prompts": 8 if short else 12, "max_tokens": 16 if short else 32,
            "answers": args.answers or (1_000 if short else 5_000), "clients": 16,
            "repeats": 1 if short else 10, "fuzz": 150 if short else 2_000, "good_clients": 4,
            "disconnects": 5 if short else 20, "overload_s": 5.0 if short else 20.0,
            "soak_s": 60 * (args.soak_minutes if args.soak_minutes is not None else (0.33 if short else 30.0)),
            "soak_clients": 8, "sigterm_clients": 16, "sigterm_load_s": 1.5 if short else 3.0}


async def run_generation(args: argparse.Namespace, written: Callable[[list[ProbeResult]], object]) -> list[ProbeResult]:
    p = plan_generation(args)
    chosen = [x.strip() for x in args.probes.split(",")] if args.probes else list(PROBES)
    server_args = ["--max-batch-size", str(GENERATION_RUNNING), "--max-queue-size", str(GENERATION_QUEUE)]
    server_args += ["--variant", args.variant] if args.variant else []
    server_args += ["--workers", str(args.workers)] if args.workers else []
    short_texts, paragraphs = load_texts(p["short_prompts"])
    from modelkiln.data import read_squad

    _, questions = read_squad()
    squad = [(q.context, q.question) for q in questions]
    squad = list(dict(squad).items())[: p["long_prompts"]]  # one question per paragraph
    long_texts = [generation_load.squad_prompt(c, q) for c, q in squad]
    results: list[ProbeResult] = []

    def done(result: ProbeResult) -> None:
        results.append(result)
        report(result)
        written(results)

    server = KilnServer(args.artifact, MODEL, server_args)
    try:
        answers = await generation_load.Answers.build(server.port, MODEL, short_texts, long_texts, p["max_tokens"])
        print(f"references: {len(answers.raws)} requests alone ({len(answers.raws) // 3} prompts x 3 routes; "
              f"{answers.dropped} prompts dropped as answered like another)", file=sys.stderr)
        steps = {
            "misrouting": lambda: generation_load.misrouting(answers, p["answers"], p["clients"]),
            "bad-input": lambda: hostile.attack(
                server, generation_hostile.generation_cases(MODEL, 8 * 1024 * 1024)
                + hostile.handmade_cases(MODEL, "text_input", 8 * 1024 * 1024), generation_hostile.generation_bodies(MODEL),
                p["repeats"], p["fuzz"], generation_load.GoodStreams(answers, p["good_clients"])),
            "disconnects": lambda: generation_hostile.hang_ups(server, answers, p["disconnects"], *squad[0]),
            "overload": lambda: generation_load.overload(server, answers, GENERATION_RUNNING + GENERATION_QUEUE,
                                                         p["overload_s"]),
            "soak": lambda: generation_load.soak(server, answers, p["soak_clients"], p["soak_s"]),
            "security": lambda: hostile.security(server, generation_hostile.routes(MODEL)),
        }
        for name, step in steps.items():
            if name in chosen:
                done(await step())
    finally:
        server.stop()
    if "sigterm" in chosen:
        fresh = KilnServer(args.artifact, MODEL, server_args)
        try:
            done(await generation_load.sigterm(fresh, answers, p["sigterm_clients"], p["sigterm_load_s"]))
        finally:
            fresh.stop()
    return results


async def run(args: argparse.Namespace, written: Callable[[list[ProbeResult]], object]) -> list[ProbeResult]:
    if generation_mode(args):
        return await run_generation(args, written)
    p = plan(args)
    chosen = [x.strip() for x in args.probes.split(",")] if args.probes else list(PROBES)
    server_args = ["--max-queue-size", str(QUEUE)] + (["--variant", args.variant] if args.variant else [])
    server_args += ["--workers", str(args.workers)] if args.workers else []
    short_texts, long_texts = load_texts(p["short_texts"])
    long_texts = long_texts[: p["long_texts"]] if p["long_texts"] else long_texts
    results: list[ProbeResult] = []
    server = KilnServer(args.artifact, MODEL, server_args)
    try:
        meta = await once(server.port, request_bytes("GET", f"/v2/models/{MODEL}"))
        input_name = meta.json()["inputs"][0]["name"]  # type: ignore[union-attr]
        refs = await References.build(server.port, MODEL, short_texts + long_texts)
        long_set = set(long_texts)
        work = load.Workload(refs, MODEL, input_name,
                             short=[i for i, t in enumerate(refs.texts) if t not in long_set],
                             long=[i for i, t in enumerate(refs.texts) if t in long_set])
        print(f"references: {len(refs.texts)} texts alone ({refs.dropped} dropped as near-duplicates)", file=sys.stderr)
        steps = {
            "misrouting": lambda: load.misrouting(server, work, p["answers"], p["clients"]),
            "bad-input": lambda: hostile.bad_input(server, work, p["repeats"], p["fuzz"], p["good_clients"],
                                                   8 * 1024 * 1024),
            "disconnects": lambda: hostile.disconnects(server, work, p["disconnects"]),
            "overload": lambda: load.overload(server, work, QUEUE, p["overload_s"]),
            "soak": lambda: load.soak(server, load.Workload(refs, MODEL, input_name, work.short, work.long,
                                                            long_share=0.2), p["soak_clients"], p["soak_s"]),
            "security": lambda: hostile.security(server),
        }
        for name, step in steps.items():
            if name in chosen:
                results.append(await step())
                report(results[-1])
                written(results)
    finally:
        server.stop()
    if "sigterm" in chosen:
        fresh = KilnServer(args.artifact, MODEL, server_args)
        try:
            results.append(await load.sigterm(fresh, work, p["sigterm_clients"], p["sigterm_load_s"]))
            report(results[-1])
            written(results)
        finally:
            fresh.stop()
    return results


def generation_mode(args: argparse.Namespace) -> bool:
    from modelkiln.manifest import Manifest
    from modelkiln.tasks.text_generation import is_generation

    return is_generation(Manifest.load(args.artifact))


def report(r: ProbeResult) -> None:
    print(f"[{'PASS' if r.passed else 'FAIL'}] {r.name} ({r.seconds:.1f} s): {r.outcome}", file=sys.stderr)


def table(results: list[ProbeResult]) -> str:
    lines = ["| probe | requests | outcome | goal | met |", "|---|---:|---|---|---|"]
    for r in results:
        lines.append(f"| {r.name} | {r.count:,} | {r.outcome} | {r.goal} | {'yes' if r.passed else '**no**'} |")
    return "\n".join(lines)


def write(args: argparse.Namespace, results: list[ProbeResult], started: float, load_before: tuple) -> str:
    """Write the results so far (after every probe: a long run stopped early keeps what it measured)."""
    seconds = time.monotonic() - started
    load_now = os.getloadavg()
    command = "python tests/reliability/fault_suite.py " + " ".join(sys.argv[1:])
    context = {"command": command, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "artifact": str(args.artifact), "variant": args.variant or "kiln serve's default",
               "workers": args.workers or "kiln serve's default",
               "seconds": round(seconds, 1), "cpus": os.cpu_count(), "python": platform.python_version(),
               "load_average_before": [round(x, 2) for x in load_before],
               "load_average_after": [round(x, 2) for x in load_now],
               "mode": "generation" if generation_mode(args) else "encoder",
               "plan": plan_generation(args) if generation_mode(args) else plan(args)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps({**context, "probes": [asdict(r) for r in results]},
                                                           indent=2, default=str) + "\n")
    met = sum(r.passed for r in results)
    text = (f"{command}\n{context['date']}, {seconds:.0f} s, {os.cpu_count()} CPUs, load average "
            f"{load_before[0]:.2f} before / {load_now[0]:.2f} after; artifact {args.artifact.name} ({context['mode']}), "
            f"variant {context['variant']}\n{met} of {len(results)} probes met their goal\n\n{table(results)}\n")
    (args.out / f"{args.name}.txt").write_text(text)
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", nargs="?", type=Path, default=REPO / "artifacts" / "all-MiniLM-L6-v2")
    parser.add_argument("--variant", help="the variant to serve (default: what kiln serve picks)")
    parser.add_argument("--short", action="store_true", help="the CI form: a few thousand requests, under 3 minutes")
    parser.add_argument("--workers", type=int, help="kiln serve --workers (default: what kiln serve picks)")
    parser.add_argument("--answers", type=int, help="answers the misrouting probe checks (default 100,000; short 3,000; "
                                                    "generation: 5,000; short 1,000)")
    parser.add_argument("--soak-minutes", type=float, help="soak length (default 30; short 0.33)")
    parser.add_argument("--probes", help=f"comma-separated subset of {','.join(PROBES)}")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results", help="where to write the results")
    parser.add_argument("--name", default="reliability", help="file name of the results, without suffix")
    args = parser.parse_args()
    started, load_before = time.monotonic(), os.getloadavg()
    results = asyncio.run(run(args, lambda done: write(args, done, started, load_before)))
    print(write(args, results, started, load_before))
    return 0 if all(r.passed for r in results) and results else 1


if __name__ == "__main__":
    sys.exit(main())
