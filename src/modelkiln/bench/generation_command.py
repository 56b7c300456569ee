"""``kiln bench`` and ``kiln eval`` on a text-generation artifact (the CLI sends them here)."""

from __future__ import annotations

from pathlib import Path

from ..manifest import Manifest, is_artifact
from ..option_lists import number_list, split_list
from ..tasks.text_generation import is_generation


def generation_artifact(target: str | Path) -> bool:
    """Whether ``target`` is an artifact with a generation section (a causal language model)."""
    return is_artifact(target) and is_generation(Manifest.load(target))


def bench_generation(target: str, batch: str, seq: str, past: int, threads, variants, reference: bool,
                     json_path: Path | None, out, steps, peer_timeout: float, peers: str, sampled: bool = False) -> None:
    from ..errors import KilnError
    from ..generation.model import TextGenerationModel
    from .generation import PEERS, GenerationBenchConfig, run_generation_bench

    chosen = [] if peers.strip() == "none" else split_list(peers) or []
    unknown = [p for p in chosen if p not in PEERS]
    if unknown:
        raise KilnError(f"unknown peer {', '.join(unknown)} for --peers (choose from {', '.join(PEERS)}, or none)")
    from .generation_report import print_generation_bench, write_generation_json

    cfg = GenerationBenchConfig(prompt_lengths=number_list(seq or "16,128,512", "--seq"),
                                batches=number_list(batch, "--batch"), past=past, threads=threads,
                                variants=split_list(variants), reference=reference, peer_timeout=peer_timeout,
                                peers=chosen, sampled=sampled)
    result = run_generation_bench(TextGenerationModel(target), cfg, steps)
    print_generation_bench(out, result)
    if json_path:
        write_generation_json(json_path, result)
        out.print(f"Wrote {json_path}")


def eval_generation(artifact: Path, threads, reference: bool, out, steps) -> None:
    from ..generation.model import TextGenerationModel
    from .generation_eval import evaluate_generation
    from .generation_report import print_generation_scores

    print_generation_scores(out, evaluate_generation(TextGenerationModel(artifact), threads, reference, steps=steps))
