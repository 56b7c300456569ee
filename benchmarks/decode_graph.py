"""One graph for prefill and decode, or a second graph for decode steps only? Exports the
artifact's source model again with the sequence axis fixed to 1 (``export_decoder(...,
decode_only=True)``), builds the same variant from it (int4: the GGUF's blocks packed, as
``kiln convert`` does), and times decode steps at batch 1, past 128, of both graphs in
interleaved rounds.

    python benchmarks/decode_graph.py ARTIFACT --out FOLDER [--variant int4] [--one-graph PATH]
        [--accuracy-level 4] [--rounds 5] [--threads 2]

``--one-graph``: the one graph to compare with, when it is not the artifact's variant of that name.

FOLDER receives the decode graph (weights: as large as the artifact's; never commit it)."""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from modelkiln.bench.generation import OnnxBackend, real_token_windows
from modelkiln.convert import source as src
from modelkiln.convert.decoder_export import export_decoder
from modelkiln.convert.generation import load_causal_lm
from modelkiln.convert.gguf_blocks import pack_gguf_blocks
from modelkiln.generation.model import TextGenerationModel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("artifact")
    parser.add_argument("--out", required=True)
    parser.add_argument("--variant", default="int4", choices=["fp32", "int4"])
    parser.add_argument("--one-graph", type=Path, default=None)
    parser.add_argument("--accuracy-level", type=int, default=4, help="int4: MatMulNBits accuracy level")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    model = TextGenerationModel(args.artifact)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fp32 = out / "decode.onnx"
    if not fp32.exists():
        source = src.load_source(model.manifest.source["model"])
        export_decoder(load_causal_lm(source), fp32, decode_only=True)
    graph = fp32
    if args.variant == "int4":
        graph = out / "decode.int4.onnx"
        if not graph.exists():
            gguf = Path(model.manifest.source["model"])
            pack_gguf_blocks(fp32, graph, gguf, args.accuracy_level)
    one_graph = OnnxBackend(model, None if args.one_graph else args.variant, args.threads, path=args.one_graph)
    backends = {f"one graph {args.variant}": one_graph,
                f"decode graph {args.variant}": OnnxBackend(model, None, args.threads, path=graph)}
    past = real_token_windows(model, 128, 1)
    rates: dict[str, list[float]] = {name: [] for name in backends}
    for round_ in range(args.rounds):
        names = list(backends) if round_ % 2 == 0 else list(reversed(backends))
        for name in names:
            rates[name].append(1.0 / statistics.median(backends[name].decode_step_seconds(past, args.steps)))
        print(f"round {round_ + 1}: " + "; ".join(f"{n} {rates[n][-1]:.1f} tok/s" for n in backends), flush=True)
    one, two = list(backends)
    ratios = [b / a for a, b in zip(rates[one], rates[two])]
    print(f"decode graph vs one graph: ×{statistics.median(ratios):.3f} (rounds {', '.join(f'{r:.3f}' for r in ratios)})")
    print("medians: " + "; ".join(f"{n} {statistics.median(rates[n]):.1f} tok/s" for n in backends))


if __name__ == "__main__":
    main()
