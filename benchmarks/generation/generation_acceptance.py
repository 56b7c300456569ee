"""The acceptance ratios of text generation, measured in interleaved rounds (the machine is shared:
a burst of load from elsewhere hits every backend of a round alike, so compare within rounds).

    python benchmarks/generation/generation_acceptance.py ARTIFACT [--variant int4 --variant int8 ...]
        [--onnx NAME=PATH ...] [--rounds 5] [--threads 2] [--no-prefill]

Per round and backend: decode tokens/s at batch 1 with a past of 128 (16 steps) and the latency of
a 512-token prefill. Backends: each ONNX variant through the engine (``--onnx``: a candidate graph
file that is not in the artifact, e.g. the same int4 at another accuracy level), PyTorch
``generate``, and llama.cpp on the artifact's GGUF file (when the artifact came from one and
llama-cpp-python is installed). Prints every round and the median of the per-round ratios of
each ONNX backend against every other backend."""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from modelkiln.bench.generation import OnnxBackend, real_token_windows
from modelkiln.bench.generation_backends import LlamaCppBackend, TorchBackend, gguf_path, llama_cpp_available
from modelkiln.generation.model import TextGenerationModel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("artifact")
    parser.add_argument("--variant", action="append", default=[], help="a variant of the artifact (repeatable)")
    parser.add_argument("--onnx", action="append", default=[], help="NAME=PATH: another graph file (repeatable)")
    parser.add_argument("--no-prefill", action="store_true", help="decode only")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    model = TextGenerationModel(args.artifact)
    backends: dict = {}
    for wanted in args.variant or [None]:
        variant, _ = model.variant_path(wanted)
        backends[f"onnxruntime {variant}"] = OnnxBackend(model, variant, args.threads)
    for spec in args.onnx:
        name, path = spec.split("=", 1)
        backends[f"onnxruntime {name}"] = OnnxBackend(model, None, args.threads, path=Path(path))
    ours = list(backends)
    backends["pytorch"] = TorchBackend(model, args.threads)
    gguf = gguf_path(model.manifest.source)
    if gguf and llama_cpp_available():
        backends["llama.cpp"] = LlamaCppBackend(gguf, args.threads, 1024)
    past = real_token_windows(model, 128, 1)
    prompt = real_token_windows(model, 512, 1)[0]
    for backend in backends.values():  # warm-up
        backend.prefill_seconds(prompt[:64])
    decode: dict[str, list[float]] = {name: [] for name in backends}
    prefill: dict[str, list[float]] = {name: [] for name in backends}
    for round_ in range(args.rounds):
        names = list(backends) if round_ % 2 == 0 else list(reversed(backends))
        for name in names:
            steps = backends[name].decode_step_seconds(past, args.steps)
            decode[name].append(1.0 / statistics.median(steps))
            prefill[name].append(float("nan") if args.no_prefill else backends[name].prefill_seconds(prompt))
        print(f"round {round_ + 1}: " + "; ".join(
            f"{n} {decode[n][-1]:.1f} tok/s, prefill 512 {prefill[n][-1]:.2f} s" for n in backends), flush=True)
    for i, mine in enumerate(ours):
        for other in (n for n in backends if n not in ours[:i + 1]):
            d = [a / b for a, b in zip(decode[mine], decode[other])]
            line = f"{mine} vs {other}: decode batch 1 tokens/s ×{statistics.median(d):.2f} (rounds {', '.join(f'{x:.2f}' for x in d)})"
            if not args.no_prefill:
                p = [b / a for a, b in zip(prefill[mine], prefill[other])]
                line += f"; prefill 512 speed ×{statistics.median(p):.2f} (rounds {', '.join(f'{x:.2f}' for x in p)})"
            print(line)
    print("medians: " + "; ".join(f"{n} {statistics.median(decode[n]):.1f} tok/s, prefill 512 "
                                  f"{statistics.median(prefill[n]):.2f} s" for n in backends))


if __name__ == "__main__":
    main()
