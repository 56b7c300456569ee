"""The validation gate for a text-generation variant, on real text, against a PyTorch fp32 reference
(``generation/reference.py``):

- next-token logits at every prompt position: max |Δ| and cosine;
- the first ``new_tokens`` greedy tokens of each prompt, decoded alone through the engine core that
  ``kiln serve`` runs (chunked prefill, then decode steps), checked by teacher forcing: the
  reference reads the prompt followed by the variant's own tokens, and at each step the variant's
  token must be the reference's argmax, or a near-tie: the reference prefers its own token by no
  more than twice the largest logit difference at that step (a difference that size in each of the
  two logits explains the swap). Teacher forcing checks every step, not only the steps before a
  first difference, and needs one reference pass for all variants;
- perplexity on held-out paragraphs, as a ratio to the reference's;
- batch invariance: each prompt's greedy tokens alone vs decoded among all the other prompts at
  once, through the same core (prompts prefilled chunk by chunk while others decode, rows joining
  and leaving); any difference refuses the variant.

The variants run first (their tokens are the reference's input), each writing its logits to a
``LogitStore`` file; then the reference runs once for every variant's sequences; then each variant
is judged, a sequence at a time. Which thresholds a precision must meet is ``GateTolerance``'s job."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ...generation.core import EngineCore, Request, complete, greedy, prompt_logits
from ...manifest import Validation
from .logit_store import LogitStore


@dataclass(frozen=True)
class GateTolerance:
    max_ppl_increase: float  # relative: 0.03 = perplexity at most 3% above the reference's
    all_greedy: bool  # every greedy token the reference's argmax (near-ties excepted)


DEFAULT_GATE = {
    "fp32": GateTolerance(max_ppl_increase=0.001, all_greedy=True),
    # The GGUF's own blocks are the reference's weights; only the kernel's int8 activations
    # (accuracy level 4) differ: SmolLM2's Q4_1 file +0.6% on the gate's paragraphs.
    "gguf": GateTolerance(max_ppl_increase=0.03, all_greedy=False),
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


def teacher_forced(prompt: list[int], tokens: list[int]) -> tuple[int, ...]:
    """The sequence whose logits give the prompt's and each greedy step's: step k reads token k − 1."""
    return tuple(prompt) + tuple(tokens[:-1])


@dataclass
class CandidateRun:
    """What one variant did on the gate: greedy tokens; in ``logits``, ("prompt", i) → every
    position of prompt i, ("steps", i) → the logits each greedy token was chosen from; perplexity."""

    tokens: list[list[int]]
    logits: LogitStore
    perplexity: float


def nll_sum(logits: np.ndarray, ids: list[int], rows: int = 32) -> tuple[float, int]:
    """Summed negative log-likelihood of each next token of ``ids``, and how many (in float64, a
    few rows at a time: a whole paragraph's logits in float64 would be 0.3 GB for a 152k vocabulary)."""
    total = 0.0
    for a in range(0, len(ids) - 1, rows):
        lg = logits[a:min(a + rows, len(ids) - 1)].astype(np.float64)
        m = lg.max(axis=1, keepdims=True)
        log_z = (m + np.log(np.exp(lg - m).sum(axis=1, keepdims=True)))[:, 0]
        total += float((log_z - lg[np.arange(len(lg)), ids[a + 1:a + 1 + len(lg)]]).sum())
    return total, len(ids) - 1


def perplexity(logits: list[np.ndarray], paragraphs: list[list[int]]) -> float:
    """exp(mean negative log-likelihood of each next token), over all paragraphs' tokens."""
    sums = [nll_sum(lg, ids) for lg, ids in zip(logits, paragraphs)]
    return math.exp(sum(s for s, _ in sums) / max(sum(n for _, n in sums), 1))


def core_run(core: EngineCore, prompts: list[list[int]], new_tokens: int, together: bool) -> list[tuple[list[int], np.ndarray]]:
    """(greedy tokens, the logits each was chosen from [tokens, vocab]) per prompt, through the
    engine core: every prompt alone (one after another), or all submitted at once."""
    if not together:
        return [_alone(core, i, ids, new_tokens) for i, ids in enumerate(prompts)]
    out = []
    for done in complete(core, [Request(i, ids, greedy(new_tokens)) for i, ids in enumerate(prompts)]):
        out.append((done.token_ids, np.stack(done.logits)))
        done.logits.clear()  # one copy of the logits at a time
    return out


def _alone(core: EngineCore, i: int, ids: list[int], new_tokens: int) -> tuple[list[int], np.ndarray]:
    done = complete(core, [Request(i, ids, greedy(new_tokens))])[0]
    return done.token_ids, np.stack(done.logits)


def candidate_run(core: EngineCore, gate: GatePrompts, new_tokens: int, vocab: int) -> CandidateRun:
    """The gate through the product: greedy tokens from ``core`` (made with ``keep_logits``), each
    prompt alone; every prompt position's logits, computed the way a request's prompt is; the
    paragraphs' perplexity. Logits go to a temporary file as they come (a 152k-token vocabulary
    makes 0.6 MB a row)."""
    store = LogitStore(vocab)
    tokens = []
    for i, ids in enumerate(gate.prompts):
        chosen, steps = _alone(core, i, ids, new_tokens)
        tokens.append(chosen)
        store.put(("steps", i), steps)
    for i, ids in enumerate(gate.prompts):
        store.put(("prompt", i), prompt_logits(core, ids, ("prompt", i)))
    total, count = 0.0, 0
    for j, ids in enumerate(gate.paragraphs):
        s, n = nll_sum(prompt_logits(core, ids, ("p", j)), ids)
        total, count = total + s, count + n
    return CandidateRun(tokens, store, math.exp(total / max(count, 1)))


def _row_cosines(a: np.ndarray, b: np.ndarray, rows: int = 32) -> np.ndarray:
    """Cosine of each row pair, in float64 a few rows at a time."""
    out = np.empty(len(a))
    for r in range(0, len(a), rows):
        x, y = a[r:r + rows].astype(np.float64), b[r:r + rows].astype(np.float64)
        out[r:r + rows] = (x * y).sum(1) / np.maximum(np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1), 1e-30)
    return out


@dataclass
class ReferenceRun:
    """The reference's logits of every teacher-forced sequence (keyed by the sequence's ids) and
    its perplexity on the paragraphs; ``description`` says which reference it was."""

    logits: LogitStore
    perplexity: float
    description: str


def judge(reference: ReferenceRun, candidate: CandidateRun, prompts: list[list[int]],
          tolerance: GateTolerance) -> tuple[Validation, dict, str]:
    """(validation record, details, the reason it failed or "")."""
    max_diff, cosines, divergences, prompts_equal = 0.0, [], [], 0
    for i, prompt in enumerate(prompts):
        tokens = candidate.tokens[i]
        ref = reference.logits.get(teacher_forced(prompt, tokens))
        got = candidate.logits.get(("prompt", i))
        max_diff = max(max_diff, float(np.abs(ref[:len(prompt)] - got).max()))
        cosines.append(_row_cosines(ref[:len(prompt)], got))
        ref_steps, got_steps = ref[len(prompt) - 1:], candidate.logits.get(("steps", i))
        first = None
        for k, token in enumerate(tokens):
            best = int(ref_steps[k].argmax())
            if token == best:
                continue
            margin = float(ref_steps[k, best] - ref_steps[k, token])
            step_diff = float(np.abs(ref_steps[k] - got_steps[k]).max())
            record = {"prompt": i, "step": k, "margin": round(margin, 6), "max_abs_diff_at_step": round(step_diff, 6),
                      "near_tie": margin <= 2 * step_diff}
            if first is None or (first["near_tie"] and not record["near_tie"]):
                first = record  # a prompt's first step that is not a near-tie, else its first difference
        if first is None:
            prompts_equal += 1
        else:
            divergences.append(first)
    all_cos = np.concatenate(cosines)
    ratio = candidate.perplexity / reference.perplexity
    reasons = []
    if not math.isfinite(ratio) or ratio - 1 > tolerance.max_ppl_increase:
        reasons.append(f"perplexity {candidate.perplexity:.3f} vs PyTorch {reference.perplexity:.3f} "
                       f"({(ratio - 1) * 100:+.2f}% > {tolerance.max_ppl_increase * 100:g}%)")
    unexplained = [d for d in divergences if not d["near_tie"]]
    if tolerance.all_greedy and unexplained:
        d = unexplained[0]
        reasons.append(f"greedy tokens differ from PyTorch's argmax on {len(unexplained)} prompts, not near-ties "
                       f"(prompt {d['prompt']} step {d['step']}: margin {d['margin']:.2e}, "
                       f"|Δ| {d['max_abs_diff_at_step']:.2e})")
    validation = Validation(max_abs_diff=max_diff, min_cosine=float(all_cos.min()), mean_cosine=float(all_cos.mean()),
                            agreement=prompts_equal / max(len(prompts), 1), texts=len(prompts), passed=not reasons,
                            tolerance={"max_ppl_increase": tolerance.max_ppl_increase,
                                       "all_greedy": float(tolerance.all_greedy)})
    details = {"perplexity": round(candidate.perplexity, 4), "perplexity_pytorch": round(reference.perplexity, 4),
               "perplexity_change": round(ratio - 1, 5), "divergences": divergences,
               "greedy_tokens_equal": f"{prompts_equal}/{len(prompts)}"}
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


def batch_invariance(alone: list[list[int]], alone_logits: Callable[[int], np.ndarray],
                     batched: list[tuple[list[int], np.ndarray]]) -> BatchInvariance:
    """Compare greedy tokens, and the logits of the steps both runs fed the same tokens
    (``alone_logits(i)``: prompt i's steps alone)."""
    differing, max_diff, min_cos = [], 0.0, 1.0
    for i, (a, (b, lb)) in enumerate(zip(alone, batched)):
        if a != b:
            differing.append(i)
        same = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) + 1  # step k's logits precede token k
        same = min(same, len(a))
        la = alone_logits(i)[:same]
        max_diff = max(max_diff, float(np.abs(la - lb[:same]).max()))
        min_cos = min(min_cos, float(_row_cosines(la, lb[:same]).min()))
    return BatchInvariance(differing, len(alone), max_diff, min_cos)


def check_batch_invariance(core: EngineCore, gate: GatePrompts, alone: CandidateRun, new_tokens: int) -> BatchInvariance:
    """The gate's batch check for one variant: ``alone`` is its ``candidate_run`` on the same core."""
    batched = core_run(core, gate.prompts, new_tokens, together=True)
    return batch_invariance(alone.tokens, lambda i: alone.logits.get(("steps", i)), batched)
