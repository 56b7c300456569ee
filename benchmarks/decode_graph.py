"""One graph for prefill and decode, or a second graph for decode steps only? Exports the
artifact's source model again with the sequence axis fixed to 1 (``export_decoder(...,
decode_only=True)``), builds the same variant from it (int4: the GGUF's blocks packed, as
``kiln convert`` does), and times decode steps at batch 1, past 128, of both graphs in
interleaved rounds.

    python benchmarks/decode_graph.py ARTIFACT (--out FOLDER | --fixed-seq) [--variant int4] [--one-graph PATH]
        [--accuracy-level 4] [--rounds 5] [--threads 2]

``--one-graph``: the one graph to compare with, when it is not the artifact's variant of that name.
``--fixed-seq``: no new export; the one graph itself with its sequence axis declared 1 (written
beside it, sharing its weights file), so onnxruntime's optimizer specialises the shapes at load.

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
from modelkiln.generation.decoder import DecoderSession
from modelkiln.generation.engine import GenerationEngine
from modelkiln.generation.model import TextGenerationModel


class TwoGraphs:
    """The engine's decoder made of two graphs: prompts (more than one token) through the one
    graph, decode steps (one token per sequence) through the decode graph. Both take and give the
    same cache tensors, so a sequence moves from one to the other without a copy."""

    def __init__(self, prefill: DecoderSession, decode: DecoderSession):
        self.prefill, self.decode = prefill, decode

    def __getattr__(self, name: str):  # cache helpers, names, shapes: the decode graph's (the same)
        return getattr(self.decode, name)

    def forward(self, input_ids, attention_mask, position_ids, past):  # type: ignore[no-untyped-def]
        session = self.decode if input_ids.shape[1] == 1 else self.prefill
        return session.forward(input_ids, attention_mask, position_ids, past)


def fixed_sequence_copy(path: Path) -> Path:
    """``path`` with input_ids/position_ids declared [batch, 1], saved beside it (same weights file)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    for value in model.graph.input:
        if value.name in ("input_ids", "position_ids"):
            dim = value.type.tensor_type.shape.dim[1]
            dim.Clear()
            dim.dim_value = 1
    copy = path.with_name(path.stem + ".seq1.onnx")
    onnx.save_model(model, str(copy))
    return copy


def decode_export(model: TextGenerationModel, out: Path, variant: str, accuracy_level: int) -> Path:
    """The artifact's source exported again with the sequence axis fixed to 1 (and packed to int4)."""
    out.mkdir(parents=True, exist_ok=True)
    fp32 = out / "decode.onnx"
    if not fp32.exists():
        export_decoder(load_causal_lm(src.load_source(model.manifest.source["model"])), fp32, decode_only=True)
    if variant != "int4":
        return fp32
    graph = out / "decode.int4.onnx"
    if not graph.exists():
        pack_gguf_blocks(fp32, graph, Path(model.manifest.source["model"]), accuracy_level)
    return graph


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("artifact")
    parser.add_argument("--out", default=None)
    parser.add_argument("--variant", default="int4", choices=["fp32", "int4"])
    parser.add_argument("--one-graph", type=Path, default=None)
    parser.add_argument("--accuracy-level", type=int, default=4, help="int4: MatMulNBits accuracy level")
    parser.add_argument("--fixed-seq", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    model = TextGenerationModel(args.artifact)
    one_path = args.one_graph or model.variant_path(args.variant)[1]
    graph: Path
    if args.fixed_seq:
        graph = fixed_sequence_copy(one_path)
    elif args.out:
        graph = decode_export(model, Path(args.out), args.variant, args.accuracy_level)
    else:
        parser.error("--out FOLDER is needed for a new export (or --fixed-seq)")
    one_graph = OnnxBackend(model, None, args.threads, path=one_path)
    two_graphs = OnnxBackend(model, None, args.threads, path=one_path)
    two_graphs.engine = GenerationEngine(TwoGraphs(DecoderSession(one_path, threads=args.threads),
                                                   DecoderSession(graph, threads=args.threads)))
    backends = {f"one graph {args.variant}": one_graph, f"prefill graph + decode graph {args.variant}": two_graphs}
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
