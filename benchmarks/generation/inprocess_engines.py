"""SmolLM2-135M-Instruct in process, no HTTP: kiln's engine core, onnxruntime-genai's Generator and
OpenVINO GenAI's ContinuousBatchingPipeline on the same chats, the same token ids, 2 threads each.

Each engine runs in a child process of its own (OpenVINO GenAI in its own virtual environment:
``--openvino-python``), one at a time, in interleaved rounds (the order reversed every other round).
Per engine and number of streams N:
- N = 1: the first 8 prompts one after another; time to first token and inter-token time (p50);
- N = 16, 64: the first N prompts submitted together, each answered with 128 tokens (end-of-sequence
  ignored); output tokens/s over the wave;
- answers: each of the first 8 prompts' tokens within the N-stream wave compared with the same
  prompt alone (the N = 1 run): "changed" counts those that differ.

``--mode sampled`` draws instead of taking the most likely token: temperature 0.7, top_p 0.95, the
prompt's index as its seed (the same seed alone and in a wave, so an answer that changes under load
is one the batch changed). onnxruntime-genai takes one seed per batch, so its answers are not compared.

The prompts: STS-B sentences as one-message chats in the model's chat template, in the order
`kiln loadtest --inputs sts` sends them (seeded shuffle), tokenized once by the parent.

    python benchmarks/generation/inprocess_engines.py ARTIFACT --ov-model OV_FOLDER \\
        --openvino-python /work/peers/ov-venv/bin/python --rounds 2 --out benchmarks/results/generation-inprocess

``--ov-model``: the GGUF exported by optimum-intel (``optimum-cli export openvino --weight-format int4
--group-size 64``; see benchmarks/README.md)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ALONE = 8  # prompts timed one at a time, and compared within the waves
ORT_GENAI_MAX_BATCH = 32  # onnxruntime-genai 0.18: "batch_size (64) must be in [1, 32]"
SAMPLED = {"temperature": 0.7, "top_p": 0.95}  # --mode sampled: what most chat clients send


def percentile50(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def stream_stats(token_times: list[list[float]], starts: list[float]) -> dict:
    """TTFT and inter-token p50 (ms) from per-request token timestamps."""
    ttft = [times[0] - start for times, start in zip(token_times, starts) if times]
    gaps = [b - a for times in token_times for a, b in zip(times, times[1:])]
    return {"ttft_p50_ms": 1000 * percentile50(ttft), "itl_p50_ms": 1000 * percentile50(gaps)}


# ----------------------------------------------------------------------------------------------------------------
# The engines (each runs in the child; imports stay inside so each child needs only its own packages)

def run_kiln(spec: dict) -> dict:
    from modelkiln.generation.core import Request, greedy, run_to_completion
    from modelkiln.generation.model import CoreOptions, TextGenerationModel
    from modelkiln.native import variant_matrix_engine

    model = TextGenerationModel(spec["artifact"])
    variant = spec.get("variant") or model.default_variant().name
    core = model.core(variant, CoreOptions(threads=spec["threads"], max_running=max(spec["streams"])))
    chosen = model.manifest.variant(variant)
    unit = variant_matrix_engine(chosen.details, chosen.precision, chosen.device)  # AMX on or refused: the core exists

    drawn = SAMPLED if spec["mode"] == "sampled" else {}

    def wave(prompts: list[list[int]], tag: str, first: int) -> tuple[list[list[int]], list[list[float]], list[float],
                                                                      float]:
        requests = [Request(f"{tag}-{i}", ids, greedy(spec["tokens"], **drawn, seed=first + i if drawn else None))
                    for i, ids in enumerate(prompts)]
        tokens: dict = {r.request_id: [] for r in requests}
        times: dict = {r.request_id: [] for r in requests}
        started = time.perf_counter()
        for output in run_to_completion(core, requests):
            if output.error is not None:
                raise output.error
            tokens[output.request_id].append(output.delta.token_id)
            times[output.request_id].append(time.perf_counter())
        elapsed = time.perf_counter() - started
        ids = [r.request_id for r in requests]
        return [tokens[i] for i in ids], [times[i] for i in ids], [started] * len(ids), elapsed

    return drive(spec, wave, f"kiln {variant} (engine core, {unit})")


def run_ort_genai(spec: dict) -> dict:
    import numpy as np

    from modelkiln.bench.generation_backends import OrtGenaiBackend
    from modelkiln.generation.model import TextGenerationModel

    # kiln bench's peer: its builder's int4 of the artifact's source, built once into the cache
    backend = OrtGenaiBackend(TextGenerationModel(spec["artifact"]), spec["threads"])
    og, model, pad = backend.og, backend.model, backend.pad_token_id

    def wave(prompts: list[list[int]], tag: str, first: int) -> tuple[list[list[int]], list[list[float]], list[float],
                                                                      float]:
        # its Generator takes at most 32 rows: more prompts run as static batches one after the other
        started = time.perf_counter()
        tokens: list[list[int]] = []
        times: list[list[float]] = []
        for first in range(0, len(prompts), ORT_GENAI_MAX_BATCH):
            batch_tokens, batch_times = static_batch(prompts[first:first + ORT_GENAI_MAX_BATCH])
            tokens += batch_tokens
            times += batch_times
        return tokens, times, [started] * len(prompts), time.perf_counter() - started

    def static_batch(prompts: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
        # prompts right-padded with its pad token to the longest, as its own Tokenizer.encode_batch pads them
        width = max(len(p) for p in prompts)
        batch = np.asarray([p + [pad] * (width - len(p)) for p in prompts], dtype=np.int32)
        params = og.GeneratorParams(model)
        length = width + spec["tokens"]
        if spec["mode"] == "sampled":  # one seed for the whole batch: its answers are not compared
            params.set_search_options(max_length=length, min_length=length, do_sample=True, random_seed=0,
                                      batch_size=len(prompts), **SAMPLED)
        else:
            params.set_search_options(max_length=length, min_length=length, do_sample=False, batch_size=len(prompts))
        generator = og.Generator(model, params)
        generator.append_tokens(batch)
        tokens: list[list[int]] = [[] for _ in prompts]
        times: list[list[float]] = [[] for _ in prompts]
        for _ in range(spec["tokens"]):
            generator.generate_next_token()
            now = time.perf_counter()
            for row, token in enumerate(generator.get_next_tokens()):
                tokens[row].append(int(token))
                times[row].append(now)
        return tokens, times

    return drive(spec, wave, "onnxruntime-genai int4 (its builder; static batches of at most 32)",
                 comparable=spec["mode"] != "sampled")


def run_openvino(spec: dict) -> dict:
    import openvino as ov
    import openvino_genai as ovg

    scheduler = ovg.SchedulerConfig()
    scheduler.enable_prefix_caching = True
    scheduler.max_num_batched_tokens = spec["ov_batched_tokens"]
    scheduler.max_num_seqs = max(spec["streams"])
    scheduler.cache_size = 1  # GB of KV cache
    pipe = ovg.ContinuousBatchingPipeline(spec["ov_model"], scheduler, "CPU",
                                          {"INFERENCE_NUM_THREADS": spec["threads"]})
    counter = iter(range(10**9))

    def config(seed: int) -> ovg.GenerationConfig:
        made = ovg.GenerationConfig()
        made.max_new_tokens = spec["tokens"]
        made.ignore_eos = True
        made.do_sample = spec["mode"] == "sampled"
        if made.do_sample:
            made.temperature, made.top_p, made.rng_seed = SAMPLED["temperature"], SAMPLED["top_p"], seed
        return made

    def wave(prompts: list[list[int]], tag: str, first: int) -> tuple[list[list[int]], list[list[float]], list[float],
                                                                      float]:
        started = time.perf_counter()
        handles = [pipe.add_request(next(counter), ov.Tensor(__import__("numpy").asarray([p], dtype="int64")),
                                    config(first + i)) for i, p in enumerate(prompts)]
        tokens: list[list[int]] = [[] for _ in prompts]
        times: list[list[float]] = [[] for _ in prompts]
        while pipe.has_non_finished_requests():
            pipe.step()
            now = time.perf_counter()
            for row, handle in enumerate(handles):
                if handle.can_read():
                    for output in handle.read().values():
                        tokens[row].extend(output.generated_ids)
                        times[row].extend([now] * len(output.generated_ids))
        return tokens, times, [started] * len(prompts), time.perf_counter() - started

    return drive(spec, wave, f"OpenVINO GenAI int4 (ContinuousBatchingPipeline, max_num_batched_tokens "
                             f"{spec['ov_batched_tokens']}, prefix caching)")


def drive(spec: dict, wave, label: str, comparable: bool = True) -> dict:
    """The N = 1 runs, then the waves; the same for every engine. ``comparable``: whether a prompt's
    answer in a wave should be its answer alone (not where a seed is shared by a batch)."""
    prompts = spec["prompts"]
    wave(prompts[:1], "warm", 0)  # first-call costs out of the figures
    alone_tokens, alone_times, alone_starts, alone_seconds = [], [], [], 0.0
    for i in range(ALONE):
        tokens, times, starts, seconds = wave([prompts[i]], f"alone{i}", i)
        alone_tokens += tokens
        alone_times += times
        alone_starts += starts
        alone_seconds += seconds
    results = [{"streams": 1, "prompts": ALONE, "output_tokens_per_s": sum(map(len, alone_tokens)) / alone_seconds,
                **stream_stats(alone_times, alone_starts), "changed": None}]
    for streams in spec["streams"]:
        if streams == 1:
            continue
        tokens, times, starts, seconds = wave(prompts[:streams], f"wave{streams}", 0)
        compared = min(ALONE, streams)
        changed = sum(tokens[i] != alone_tokens[i] for i in range(compared))
        results.append({"streams": streams, "prompts": streams, "output_tokens_per_s": sum(map(len, tokens)) / seconds,
                        **stream_stats(times, starts), "changed": f"{changed}/{compared}" if comparable else None,
                        "tokens_per_answer": statistics.median(map(len, tokens))})
    return {"engine": label, "results": results}


ENGINES = {"kiln": run_kiln, "onnxruntime-genai": run_ort_genai, "openvino-genai": run_openvino}


# ----------------------------------------------------------------------------------------------------------------
# The parent

def prompt_ids(artifact: Path, count: int) -> list[list[int]]:
    from modelkiln.generation.model import TextGenerationModel
    from modelkiln.loadtest.inputs import load_items, select

    model = TextGenerationModel(artifact)
    return [model.prompt_ids(text, chat=True) for text in select(load_items("sts"), limit=count)]


def run_child(name: str, spec: dict, python: str, out: Path) -> dict:
    spec_file = out / f"spec-{name}.json"
    spec_file.write_text(json.dumps(spec))
    done = subprocess.run([python, __file__, "--child", name, "--spec", str(spec_file)], capture_output=True,
                          text=True, env={**os.environ, "OMP_NUM_THREADS": str(spec["threads"])})
    if done.returncode != 0:
        return {"engine": name, "failed": (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(runs: list[dict]) -> list[str]:
    lines = ["| engine | streams | output tok/s (rounds) | TTFT p50 ms | ITL p50 ms | answers changed vs alone |",
             "|---|---|---|---|---|---|"]
    by_engine: dict[str, list[dict]] = {}
    for run in runs:
        by_engine.setdefault(run["engine"], []).append(run)
    for engine, mine in by_engine.items():
        if all("failed" in r for r in mine):
            lines.append(f"| {engine} | – | did not run: {mine[0]['failed'][:200]} | | | |")
            continue
        measured = [r for r in mine if "failed" not in r]
        for index, first in enumerate(measured[0]["results"]):
            cells = [r["results"][index] for r in measured]
            rates = [c["output_tokens_per_s"] for c in cells]
            changed = ", ".join(c["changed"] for c in cells if c["changed"] is not None) or "–"
            lines.append(f"| {engine} | {first['streams']} | {statistics.median(rates):.1f} "
                         f"({', '.join(f'{r:.1f}' for r in rates)}) | "
                         f"{statistics.median(c['ttft_p50_ms'] for c in cells):.1f} | "
                         f"{statistics.median(c['itl_p50_ms'] for c in cells):.1f} | {changed} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", type=Path, nargs="?")
    parser.add_argument("--engines", default="kiln,onnxruntime-genai,openvino-genai")
    parser.add_argument("--variant", default=None, help="kiln's variant (default: the artifact's default)")
    parser.add_argument("--ov-model", type=Path, help="the optimum-intel export (OpenVINO IR folder)")
    parser.add_argument("--openvino-python", default=None, help="the python of OpenVINO GenAI's environment")
    parser.add_argument("--ov-batched-tokens", type=int, default=256, help="its max_num_batched_tokens")
    parser.add_argument("--streams", default="1,16,64")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--mode", choices=("greedy", "sampled"), default="greedy",
                        help=f"sampled: {SAMPLED}, each prompt's index its seed")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/generation-inprocess"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(ENGINES[args.child](json.loads(args.spec.read_text()))))
        return

    from modelkiln.machine import cpu_description

    streams = [int(s) for s in args.streams.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    names = [n.strip() for n in args.engines.split(",")]
    spec = {"artifact": str(args.artifact.resolve()), "variant": args.variant, "threads": args.threads,
            "tokens": args.tokens, "mode": args.mode, "streams": streams, "prompts": prompt_ids(args.artifact, max(streams + [ALONE])),
            "ov_model": str(args.ov_model) if args.ov_model else None, "ov_batched_tokens": args.ov_batched_tokens}
    cpu = cpu_description()
    mode = "greedy" if args.mode == "greedy" else f"sampled ({', '.join(f'{k} {v}' for k, v in SAMPLED.items())}, seeded)"
    pythons = {"openvino-genai": args.openvino_python or sys.executable}
    header = (f"# {args.artifact.resolve().name} in process: {args.threads} threads, STS-B chats, {args.tokens} tokens per "
              f"answer (end-of-sequence ignored), {mode}; median of {args.rounds} rounds; "
              f"{cpu['cpu']} ({cpu['isa']}), {cpu['cores']} cores")
    runs = []
    for round_ in range(1, args.rounds + 1):
        for name in names if round_ % 2 else list(reversed(names)):
            load = " ".join(f"{x:.2f}" for x in os.getloadavg())
            run = {**run_child(name, spec, pythons.get(name, sys.executable), args.out), "round": round_, "load_before": load}
            print(json.dumps(run), flush=True)
            runs.append(run)
    lines = [header, "", *table(runs), "", "load average before each run: " +
             "; ".join(f"r{r['round']} {r['engine']}: {r['load_before']}" for r in runs)]
    (args.out / "runs.json").write_text(json.dumps(runs, indent=1))
    (args.out / "table.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
