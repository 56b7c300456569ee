"""``kiln eval`` for a text-generation artifact, per variant next to PyTorch:

- perplexity on SQuAD paragraphs (every token predicted from the ones before it);
- SQuAD answered by generation: context and question in the chat template, greedy, scored by
  exact match and F1 with the official SQuAD normalisation (unanswerable questions skipped)."""

from __future__ import annotations

import collections
import contextlib
import math
import re
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import ContextManager

import numpy as np

from ..data import SquadQuestion, read_squad
from ..generation.core import Request, complete, prompt_logits
from ..generation.model import CoreOptions, TextGenerationModel
from ..generation.sampling import SamplingParams

SQUAD_INSTRUCTION = "Answer the question with a short phrase copied from the context.\n\nContext: {context}\n\nQuestion: {question}"


@dataclass(frozen=True)
class GenerationScore:
    backend: str
    perplexity: float
    exact_match: float  # ×100
    f1: float  # ×100
    paragraphs: int
    questions: int
    perplexity_delta: float | None = None  # relative to PyTorch, e.g. +0.012 = 1.2% higher


def normalize_answer(text: str) -> str:
    """The official SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def f1_score(prediction: str, truth: str) -> float:
    pred, gold = normalize_answer(prediction).split(), normalize_answer(truth).split()
    common = sum((collections.Counter(pred) & collections.Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def squad_scores(predictions: list[str], questions: list[SquadQuestion]) -> tuple[float, float]:
    em = [max(float(normalize_answer(p) == normalize_answer(a)) for a in q.answers) for p, q in zip(predictions, questions)]
    f1 = [max(f1_score(p, a) for a in q.answers) for p, q in zip(predictions, questions)]
    return 100.0 * float(np.mean(em)), 100.0 * float(np.mean(f1))


def perplexity_of(token_logits: Callable[[list[int]], np.ndarray], texts: list[list[int]]) -> float:
    """exp(mean negative log-likelihood) over every predicted token of every text."""
    nll, count = 0.0, 0
    for ids in texts:
        logits = token_logits(ids).astype(np.float64)[:-1]
        shifted = logits - logits.max(axis=-1, keepdims=True)
        log_probs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
        nll -= float(log_probs[np.arange(len(ids) - 1), ids[1:]].sum())
        count += len(ids) - 1
    return math.exp(nll / count)


def eval_inputs(model: TextGenerationModel, paragraphs: int, questions: int, max_tokens: int, max_new_tokens: int):
    """Paragraph token ids (cut to ``max_tokens``), and the first answerable questions whose prompt
    and answer fit the model's context, with their prompt ids."""
    texts, squad = read_squad()
    limit = min(max_tokens, model.max_context or max_tokens)
    ids = [model.tokenizer.encode(t, add_special_tokens=False).ids[:limit] for t in texts[:paragraphs]]
    answerable, prompts = [], []
    for q in (q for q in squad if q.answers):
        prompt = model.prompt_ids(SQUAD_INSTRUCTION.format(context=q.context, question=q.question),
                                  chat=bool(model.chat_template))
        if model.max_context and len(prompt) + max_new_tokens > model.max_context:
            continue
        answerable.append(q)
        prompts.append(prompt)
        if len(prompts) == questions:
            break
    return ids, answerable, prompts


def evaluate_generation(model: TextGenerationModel, threads: int | None, reference: bool, paragraphs: int = 16,
                        questions: int = 24, max_tokens: int = 256, max_new_tokens: int = 24,
                        variants: list[str] | None = None,
                        steps: Callable[[str], ContextManager[None]] = lambda d: contextlib.nullcontext()) -> list[GenerationScore]:
    texts, answerable, prompts = eval_inputs(model, paragraphs, questions, max_tokens, max_new_tokens)
    params = SamplingParams(max_new_tokens=max_new_tokens, stop=("\n",))
    scores: list[GenerationScore] = []
    if reference:
        from .generation_backends import TorchBackend

        with steps("Loading the PyTorch model"):
            torch_model = TorchBackend(model, threads)
        with steps(f"pytorch: perplexity on {len(texts)} paragraphs"):
            ppl = perplexity_of(torch_model.logits, texts)
        with steps(f"pytorch: {len(prompts)} SQuAD questions"):
            answers = [torch_model.greedy_text(p, params, model) for p in prompts]
        scores.append(GenerationScore("pytorch fp32", ppl, *squad_scores(answers, answerable), len(texts), len(prompts)))
        del torch_model
    for v in model.manifest.kept_variants():
        if v.device != "cpu" or (variants and v.name not in variants):
            continue
        core = model.core(v.name, CoreOptions(threads=threads, max_running=8))

        def logits(ids: list[int], core=core) -> np.ndarray:
            return prompt_logits(core, ids)

        with steps(f"{v.name}: perplexity on {len(texts)} paragraphs"):
            ppl = perplexity_of(logits, texts)
        with steps(f"{v.name}: {len(prompts)} SQuAD questions"):
            done = complete(core, [Request(i, p, params) for i, p in enumerate(prompts)])
        scores.append(GenerationScore(f"onnxruntime {v.name}", ppl, *squad_scores([c.text for c in done], answerable),
                                      len(texts), len(prompts)))
    base = next((s.perplexity for s in scores if s.backend.startswith("pytorch")), None)
    return [s if base is None else GenerationScore(**{**s.__dict__, "perplexity_delta": s.perplexity / base - 1.0})
            for s in scores]
