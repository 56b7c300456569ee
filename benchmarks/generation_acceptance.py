"""The acceptance ratios of text generation, measured in interleaved rounds (the machine is shared:
a burst of load from elsewhere hits every backend of a round alike, so compare within rounds).

    python benchmarks/generation_acceptance.py ARTIFACT [--variant int4] [--rounds 5] [--threads 2]

Per round and backend: decode tokens/s at batch 1 with a past of 128 (16 steps) and the latency of
a 512-token prefill. Backends: the ONNX variant through the engine, PyTorch ``generate``, and
llama.cpp on the artifact's GGUF file (when the artifact came from one and llama-cpp-python is
installed). Prints every round and the median of the per-round ratios."""

from __future__ import annotations

import argparse
import statistics

from modelkiln.bench.generation import OnnxBackend, real_token_windows
from modelkiln.bench.generation_backends import LlamaCppBackend, TorchBackend, gguf_path, llama_cpp_available
from modelkiln.generation.model import TextGenerationModel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("artifact")
    parser.add_argument("--variant", default=None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    model = TextGenerationModel(args.artifact)
    variant, _ = model.variant_path(args.variant)
    backends = {f"onnxruntime {variant}": OnnxBackend(model, variant, args.threads),
                "pytorch": TorchBackend(model, args.threads)}
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
            prefill[name].append(backends[name].prefill_seconds(prompt))
        print(f"round {round_ + 1}: " + "; ".join(
            f"{n} {decode[n][-1]:.1f} tok/s, prefill 512 {prefill[n][-1]:.2f} s" for n in backends), flush=True)
    ours = f"onnxruntime {variant}"
    for other in (n for n in backends if n != ours):
        d = [a / b for a, b in zip(decode[ours], decode[other])]
        p = [b / a for a, b in zip(prefill[ours], prefill[other])]
        print(f"{ours} vs {other}: decode batch 1 tokens/s ×{statistics.median(d):.2f} "
              f"(rounds {', '.join(f'{x:.2f}' for x in d)}); prefill 512 speed ×{statistics.median(p):.2f} "
              f"(rounds {', '.join(f'{x:.2f}' for x in p)})")
    print("medians: " + "; ".join(f"{n} {statistics.median(decode[n]):.1f} tok/s, prefill 512 "
                                  f"{statistics.median(prefill[n]):.2f} s" for n in backends))


if __name__ == "__main__":
    main()
