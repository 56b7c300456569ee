"""Batch invariance of PyTorch's kernels and of the torch engine, bit for bit, and what the invariant
kernels cost.

1. kernels: does row 0 of ``F.linear`` keep its bits when the call has M rows instead of 1? Does a
   decode row of ``scaled_dot_product_attention`` keep its bits when padded among longer rows?
2. the engine: every prompt's greedy tokens and logits alone vs all prompts at once through the
   engine core, with the invariant kernels on and off;
3. cost: ms per decode step at several batch sizes and per 128-token prefill chunk, invariant on and
   off, measured interleaved.

    python experiments/torch_batch_invariance/measure.py --artifact ARTIFACT [--device cpu] [--threads 2]

ARTIFACT: a text-generation artifact with a torch variant (``kiln convert MODEL --task
text-generation --engine torch``)."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F


def kernel_rows(device: str, threads: int) -> dict:
    torch.set_num_threads(threads)
    found = {}
    generator = torch.Generator(device="cpu").manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        if dtype == torch.float16 and device == "cpu":
            continue
        w = torch.randn(1536, 576, generator=generator).to(device, dtype)
        x = torch.randn(300, 576, generator=generator).to(device, dtype)
        alone = F.linear(x[:1], w)[0]
        differing = [m for m in (2, 3, 4, 8, 16, 17, 32, 64, 128, 129, 256, 300) if not torch.equal(F.linear(x[:m], w)[0], alone)]
        q = torch.randn(1, 3, 3, 64, generator=generator).to(device, dtype)
        k = torch.randn(1, 3, 100, 64, generator=generator).to(device, dtype)
        v = torch.randn(1, 3, 100, 64, generator=generator).to(device, dtype)
        single = F.scaled_dot_product_attention(q, k, v)[0]
        padded = []
        for width, rows in ((128, 1), (128, 4), (512, 4), (1024, 16)):
            K = torch.randn(rows, 3, width, 64, generator=generator).to(device, dtype)
            V = torch.randn(rows, 3, width, 64, generator=generator).to(device, dtype)
            Q = torch.randn(rows, 3, 3, 64, generator=generator).to(device, dtype)
            K[0, :, :100], V[0, :, :100], Q[0] = k[0], v[0], q[0]
            mask = torch.ones(rows, 1, 1, width, dtype=torch.bool, device=device)
            mask[0, ..., 100:] = False
            if not torch.equal(F.scaled_dot_product_attention(Q, K, V, attn_mask=mask)[0], single):
                padded.append(f"width {width} x {rows} rows")
        found[str(dtype).removeprefix("torch.")] = {"linear_row0_differs_at_M": differing, "sdpa_padded_row_differs": padded}
    return found


def engine_runs(artifact: str, device: str, threads: int, rows: int, new_tokens: int) -> dict:
    from modelkiln.convert.generation.pipeline import gate_prompts  # noqa: F401 - the same prompts as the gate
    from modelkiln.generation.core import Request, complete, greedy
    from modelkiln.generation.model import CoreOptions, TextGenerationModel
    from modelkiln.data import sts_sentences

    model = TextGenerationModel(artifact)
    prompts = [model.prompt_ids(t) for t in sts_sentences()[:rows]]
    found: dict = {}
    for variant in (v.name for v in model.manifest.kept_variants() if v.engine == "torch"):
        for invariant in (True, False):
            core = model.core(variant, CoreOptions(threads=threads, device=device, max_running=rows, keep_logits=True,
                                                   batch_invariant=invariant))
            alone = [complete(core, [Request(i, p, greedy(new_tokens))])[0] for i, p in enumerate(prompts)]
            together = complete(core, [Request(i, p, greedy(new_tokens)) for i, p in enumerate(prompts)])
            tokens = sum(a.token_ids != b.token_ids for a, b in zip(alone, together))
            bits = sum(not all(np.array_equal(x, y) for x, y in zip(a.logits, b.logits)) for a, b in zip(alone, together))
            worst = max(float(np.abs(x - y).max()) for a, b in zip(alone, together) for x, y in zip(a.logits, b.logits))
            found.setdefault(variant, {})["invariant" if invariant else "pytorch kernels"] = {
                "kernels": core.engine.decoder.kernels.describe(), "prompts": len(prompts), "greedy_tokens_differ": tokens,
                "logits_bits_differ": bits, "max_abs_diff": worst}
    return found


def costs(artifact: str, device: str, threads: int, batches: list[int], rounds: int) -> dict:
    from modelkiln.generation.core import Request, greedy
    from modelkiln.generation.model import CoreOptions, TextGenerationModel

    model = TextGenerationModel(artifact)
    variant = model.default_variant(device).name  # the one served: bf16 where it was kept
    cores = {inv: model.core(variant, CoreOptions(threads=threads, device=device, max_running=max(batches),
                                                  batch_invariant=inv, warm_up=True)) for inv in (True, False)}
    samples: dict[str, list[float]] = {}
    prompt = list(range(10, 138))  # 128 tokens: one prefill chunk
    for round_ in range(rounds):
        for batch in batches:
            for inv, core in cores.items():
                # answers long enough that the first ones still decode when the last prompt is in
                # (admission prefills a few prompts a step); aborted once timed
                ids = [(round_, batch, i) for i in range(batch)]
                for request_id in ids:
                    core.add_request(Request(request_id, prompt, greedy(512)))
                started = time.perf_counter()
                while core.decoding < batch:
                    core.step()
                prefill = (time.perf_counter() - started) / batch
                steps = []
                for _ in range(8):
                    started = time.perf_counter()
                    core.step()
                    steps.append(time.perf_counter() - started)
                for request_id in ids:
                    core.abort(request_id)
                while core.has_work():
                    core.step()
                key = "invariant" if inv else "pytorch kernels"
                samples.setdefault(f"{key} decode b{batch}", []).append(statistics.median(steps) * 1000)
                samples.setdefault(f"{key} prefill 128 (per prompt)", []).append(prefill * 1000)
    return {"variant": variant, **{k: round(statistics.median(v), 2) for k, v in samples.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=8, help="prompts decoded alone and together")
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--batches", default="1,8,16")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    result = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__, "device": args.device,
              "threads": args.threads}
    if args.device == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
    # each part printed as it ends: a run cut short still reports the parts it finished
    result["kernels"] = {f"threads {t}": kernel_rows(args.device, t) for t in sorted({1, args.threads})}
    print(json.dumps({"kernels": result["kernels"]}, indent=2), flush=True)
    result["engine"] = engine_runs(args.artifact, args.device, args.threads, args.rows, args.tokens)
    print(json.dumps({"engine": result["engine"]}, indent=2), flush=True)
    result["cost_ms"] = costs(args.artifact, args.device, args.threads, [int(b) for b in args.batches.split(",")],
                              args.rounds)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
