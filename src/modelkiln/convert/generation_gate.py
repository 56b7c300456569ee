"""The validation gate for a text-generation variant, on real text, against PyTorch:

- next-token logits at every prompt position: max |Δ| and cosine;
- the first ``new_tokens`` greedy tokens of each prompt, decoded alone through the engine core that
  ``kiln serve`` runs (chunked prefill, then decode steps); where they differ, the reference's top-2
  logit margin at the first differing step says whether it is a near-tie that the numeric
  difference explains;
- perplexity on held-out paragraphs, as a ratio to PyTorch's;
- batch invariance: each prompt's greedy tokens alone vs decoded among all the other prompts at
  once, through the same core (prompts prefilled chunk by chunk while others decode, rows joining
  and leaving); any difference refuses the variant.

Which thresholds a precision must meet is ``GateTolerance``'s job; fp32 must give PyTorch's greedy
tokens on every prompt (near-ties excepted), quantized variants must keep perplexity within 3%."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..generation.core import EngineCore, Request, complete, greedy, prompt_logits
from ..manifest import Validation


@dataclass(frozen=True)
class GateTolerance:
    max_ppl_increase: float  # relative: 0.03 = perplexity at most 3% above PyTorch's
    all_greedy: bool  # every prompt's greedy tokens equal PyTorch's (near-ties excepted)


DEFAULT_GATE = {
    "fp32": GateTolerance(max_ppl_increase=0.001, all_greedy=True),
    "int8": GateTolerance(max_ppl_increase=0.03, all_greedy=False),
    "int4": GateTolerance(max_ppl_increase=0.03, all_greedy=False),
    "fp16": GateTolerance(max_ppl_increase=0.01, all_greedy=False),
    # bf16 keeps 8 significant bits (fp16 11): the torch engine's half-precision variant on CUDA
    "bf16": GateTolerance(max_ppl_increase=0.02, all_greedy=False),
}


@dataclass
class GatePrompts:
    prompts: list[list[int]]  # token ids, chat template applied where the prompt is a chat
    kinds: list[str]  # "sts", "squad-chat", "text"
    paragraphs: list[list[int]]  # perplexity texts


@dataclass
class Run:
    """What one backend did on the gate: every prompt position's logits, greedy tokens, the
    logits of each greedy step, perplexity."""

    prompt_logits: list[np.ndarray] = field(default_factory=list)  # [len, vocab] per prompt
    tokens: list[list[int]] = field(default_factory=list)
    step_logits: list[np.ndarray] = field(default_factory=list)  # [new_tokens, vocab] per prompt
    perplexity: float = float("nan")


def perplexity(logits: list[np.ndarray], paragraphs: list[list[int]]) -> float:
    """exp(mean negative log-likelihood of each next token), over all paragraphs' tokens."""
    nll, count = 0.0, 0
    for lg, ids in zip(logits, paragraphs):
        lg = lg[:-1].astype(np.float64)
        m = lg.max(axis=1, keepdims=True)
        log_z = (m + np.log(np.exp(lg - m).sum(axis=1, keepdims=True)))[:, 0]
        nll += float((log_z - lg[np.arange(len(ids) - 1), ids[1:]]).sum())
        count += len(ids) - 1
    return math.exp(nll / max(count, 1))


# Gate prompts PyTorch runs together (left-padded, masked). A decode step at batch 1 reads every
# weight for one token; at batch 8 it reads them once for eight, for about the same time on a CPU.
REFERENCE_BATCH = 8


def torch_run(model, gate: GatePrompts, new_tokens: int, batch: int = REFERENCE_BATCH) -> Run:  # type: ignore[no-untyped-def]
    """PyTorch's own forward with its cache: the reference. Prompts are sorted by length and run
    ``batch`` at a time, left-padded and masked (positions counted from each prompt's first token),
    so padding costs little and a prompt's logits are its own: only the matrix shapes differ from a
    run alone (differences near 1e-6, far inside the near-tie rule of ``judge``)."""
    import torch

    count = len(gate.prompts)
    run = Run(prompt_logits=[None] * count, tokens=[None] * count, step_logits=[None] * count)  # type: ignore[list-item]
    order = sorted(range(count), key=lambda i: len(gate.prompts[i]))
    with torch.inference_mode():
        for start in range(0, count, batch):
            group = order[start:start + batch]
            logits, past, mask, positions = _padded_prefill(model, [gate.prompts[i] for i in group], torch)
            for row, i in enumerate(group):
                run.prompt_logits[i] = logits[row, logits.shape[1] - len(gate.prompts[i]):].numpy().copy()
            last, chosen, steps = logits[:, -1], [], []
            del logits
            for k in range(new_tokens):
                steps.append(last.numpy().copy())
                chosen.append(last.argmax(-1))
                if k < new_tokens - 1:
                    mask = torch.cat([mask, mask.new_ones(len(group), 1)], dim=1)
                    positions = positions[:, -1:] + 1
                    out = model(input_ids=chosen[-1][:, None], attention_mask=mask, position_ids=positions,
                                past_key_values=past, use_cache=True)
                    past, last = out.past_key_values, out.logits[:, -1].float()
            tokens, step_logits = torch.stack(chosen, dim=1).tolist(), np.stack(steps, axis=1)
            for row, i in enumerate(group):
                run.tokens[i], run.step_logits[i] = tokens[row], step_logits[row]
        para = []
        for start in range(0, len(gate.paragraphs), batch):
            rows = gate.paragraphs[start:start + batch]
            logits = _padded_prefill(model, rows, torch)[0]
            para += [logits[r, logits.shape[1] - len(ids):].numpy().copy() for r, ids in enumerate(rows)]
    run.perplexity = perplexity(para, gate.paragraphs)
    return run


def _padded_prefill(model, rows: list[list[int]], torch):  # type: ignore[no-untyped-def]
    """One forward over ``rows`` left-padded to the longest: (fp32 logits, cache, mask, positions)."""
    width = max(len(ids) for ids in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)  # padding id 0: masked, never attended to
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, width - len(row):] = torch.tensor(row)
        mask[r, width - len(row):] = 1
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
    return out.logits.float(), out.past_key_values, mask, positions


def core_run(core: EngineCore, prompts: list[list[int]], new_tokens: int, together: bool) -> Run:
    """Greedy tokens and the logits each was chosen from, through the engine core: every prompt
    alone (one after another), or all submitted at once."""
    requests = [Request(i, ids, greedy(new_tokens)) for i, ids in enumerate(prompts)]
    done = complete(core, requests) if together else [complete(core, [r])[0] for r in requests]
    return Run(tokens=[c.token_ids for c in done], step_logits=[np.stack(c.logits) for c in done])


def onnx_run(core: EngineCore, gate: GatePrompts, new_tokens: int) -> Run:
    """The same through the product: every prompt position's logits and the greedy tokens from
    ``core`` (made with ``keep_logits``), each prompt alone."""
    run = core_run(core, gate.prompts, new_tokens, together=False)
    run.prompt_logits = [prompt_logits(core, ids, ("prompt", i)) for i, ids in enumerate(gate.prompts)]
    run.perplexity = perplexity([prompt_logits(core, ids, ("p", j)) for j, ids in enumerate(gate.paragraphs)],
                                gate.paragraphs)
    return run


def _row_cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return (a * b).sum(1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-30)


def judge(reference: Run, candidate: Run, tolerance: GateTolerance) -> tuple[Validation, dict, str]:
    """(validation record, details, the reason it failed or "")."""
    max_diff, cosines, divergences = 0.0, [], []
    for i, (ref, got) in enumerate(zip(reference.prompt_logits, candidate.prompt_logits)):
        max_diff = max(max_diff, float(np.abs(ref - got).max()))
        cosines.append(_row_cosines(ref, got))
        ref_tokens, got_tokens = reference.tokens[i], candidate.tokens[i]
        if ref_tokens != got_tokens:
            k = next(j for j, (a, b) in enumerate(zip(ref_tokens, got_tokens)) if a != b)
            ref_step, got_step = reference.step_logits[i][k], candidate.step_logits[i][k]
            top2 = np.sort(ref_step)[-2:]
            margin = float(top2[1] - top2[0])
            step_diff = float(np.abs(ref_step - got_step).max())
            # Greedy choices swap when the two leading logits move apart by more than their margin:
            # a difference of at least margin/2 in each explains the swap.
            divergences.append({"prompt": i, "step": k, "top2_margin": round(margin, 6),
                                "max_abs_diff_at_step": round(step_diff, 6), "near_tie": margin <= 2 * step_diff})
    all_cos = np.concatenate(cosines)
    same = 1.0 - len(divergences) / max(len(reference.tokens), 1)
    ratio = candidate.perplexity / reference.perplexity
    reasons = []
    if not math.isfinite(ratio) or ratio - 1 > tolerance.max_ppl_increase:
        reasons.append(f"perplexity {candidate.perplexity:.3f} vs PyTorch {reference.perplexity:.3f} "
                       f"({(ratio - 1) * 100:+.2f}% > {tolerance.max_ppl_increase * 100:g}%)")
    unexplained = [d for d in divergences if not d["near_tie"]]
    if tolerance.all_greedy and unexplained:
        d = unexplained[0]
        reasons.append(f"greedy tokens differ from PyTorch on {len(unexplained)} prompts, not near-ties "
                       f"(prompt {d['prompt']} step {d['step']}: top-2 margin {d['top2_margin']:.2e}, "
                       f"|Δ| {d['max_abs_diff_at_step']:.2e})")
    validation = Validation(max_abs_diff=max_diff, min_cosine=float(all_cos.min()), mean_cosine=float(all_cos.mean()),
                            agreement=same, texts=len(reference.tokens), passed=not reasons,
                            tolerance={"max_ppl_increase": tolerance.max_ppl_increase,
                                       "all_greedy": float(tolerance.all_greedy)})
    details = {"perplexity": round(candidate.perplexity, 4), "perplexity_pytorch": round(reference.perplexity, 4),
               "perplexity_change": round(ratio - 1, 5), "divergences": divergences,
               "greedy_tokens_equal": f"{len(reference.tokens) - len(divergences)}/{len(reference.tokens)}"}
    return validation, details, "; ".join(reasons)


# --- batch invariance ---------------------------------------------------------------------------------


@dataclass
class BatchInvariance:
    """Each prompt's greedy tokens alone vs decoded among all the other prompts (``core_run``)."""

    differing: list[int]  # prompts whose batched greedy tokens differ from their lone run's
    prompts: int
    max_abs_diff: float  # largest |Δ| of a step's logits, alone vs batched, before tokens part
    min_cosine: float  # lowest cosine of a step's logits, alone vs batched, same steps

    @property
    def agreement(self) -> float:
        return 1.0 - len(self.differing) / max(self.prompts, 1)

    def reason(self) -> str:
        if not self.differing:
            return ""
        return (f"batch-variant: {len(self.differing)} of {self.prompts} prompts decode other greedy tokens "
                f"among other prompts than alone (first: prompt {self.differing[0]}; logits |Δ| up to "
                f"{self.max_abs_diff:.2e})")


def batch_invariance(alone: Run, batched: Run) -> BatchInvariance:
    """Compare greedy tokens, and the logits of the steps both runs fed the same tokens."""
    differing, max_diff, min_cos = [], 0.0, 1.0
    for i, (a, b) in enumerate(zip(alone.tokens, batched.tokens)):
        if a != b:
            differing.append(i)
        same = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) + 1  # step k's logits precede token k
        same = min(same, len(a))
        la, lb = alone.step_logits[i][:same], batched.step_logits[i][:same]
        max_diff = max(max_diff, float(np.abs(la - lb).max()))
        min_cos = min(min_cos, float(_row_cosines(la, lb).min()))
    return BatchInvariance(differing, len(alone.tokens), max_diff, min_cos)


def check_batch_invariance(core: EngineCore, gate: GatePrompts, alone: Run, new_tokens: int) -> BatchInvariance:
    """The gate's batch check for one variant: ``alone`` is its ``onnx_run`` on the same core."""
    return batch_invariance(alone, core_run(core, gate.prompts, new_tokens, together=True))
