"""``kiln bench`` for a text-generation artifact: prefill latency by prompt length, decode latency
per step and tokens/s by batch size (every sequence with a past of ``past`` tokens), for every
variant, PyTorch ``generate`` with its cache, llama.cpp on the same GGUF file when
``llama-cpp-python`` is installed, and onnxruntime-genai when ``onnxruntime-genai`` is. All inputs are real text (SQuAD paragraphs).

The artifact's own variants are timed in this process; the peers (PyTorch, llama.cpp) each in a child
process (bench/isolation.py), so that one that crashes, hangs or is missing becomes a note, not the end
of the command. Every backend runs the same loop, ``measure_backend``."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, ContextManager

from .. import native
from ..errors import KilnError
from ..generation.core import DEFAULT_MAX_RUNNING, Request, greedy, run_to_completion
from ..generation.model import CoreOptions, TextGenerationModel
from ..generation.sampling import SamplingParams
from ..extras import install_hint
from ..manifest import Variant
from .generation_backends import (LlamaCppBackend, OrtGenaiBackend, TorchBackend, gguf_path, llama_cpp_available,
                                  llama_cpp_install_hint, ort_genai_available)
from .isolation import DEFAULT_TIMEOUT_S, ChildFailed, run_in_child
from .runner import machine_info
from ..timing import Stats

PEERS = ("llama.cpp", "onnxruntime-genai")  # the peer engines `kiln bench --peers` can run

Steps = Callable[[str], ContextManager[None]]


@dataclass
class GenerationBenchConfig:
    prompt_lengths: list[int] = field(default_factory=lambda: [16, 128, 512])
    batches: list[int] = field(default_factory=lambda: [1, 8, 32])
    past: int = 128
    decode_steps: int = 16
    repeats: int = 3  # prefill runs per length (after one warm-up)
    threads: int | None = None
    variants: list[str] | None = None
    reference: bool = True
    peers: list[str] = field(default_factory=lambda: list(PEERS))  # engines besides PyTorch (PEERS)
    peer_timeout: float = DEFAULT_TIMEOUT_S  # seconds one peer row (PyTorch, llama.cpp) may run
    sampled: bool = False  # decode cells draw with SAMPLED's settings (each sequence its own seed), not greedy


@dataclass
class GenerationCell:
    backend: str
    phase: str  # "prefill" or "decode"
    batch: int
    tokens: int  # prompt length (prefill) or past length (decode)
    stats: Stats  # per call (prefill) or per step (decode), ms
    speedup: float | None = None
    matrix_engine: str = "—"  # the unit an own variant's products ran on (native.variant_matrix_engine); peers: unknown

    @property
    def tokens_per_s(self) -> float:
        per_call = self.tokens if self.phase == "prefill" else self.batch
        return per_call / (self.stats.median / 1000.0)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GenerationCell:
        return cls(**{**data, "stats": Stats(**data["stats"])})


@dataclass
class GenerationInputs:
    """The token ids every backend is timed on: one prompt per length, and the decode cells' prompts."""

    prompts: dict[int, list[int]]
    decode_prompts: list[list[int]]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GenerationInputs:  # JSON made the lengths strings
        return cls({int(n): ids for n, ids in data["prompts"].items()}, data["decode_prompts"])


@dataclass
class GenerationBenchResult:
    model: str
    task: str
    cells: list[GenerationCell]
    notes: list[str]
    machine: dict[str, Any]
    config: GenerationBenchConfig


def real_token_windows(model: TextGenerationModel, length: int, count: int) -> list[list[int]]:
    """``count`` different windows of ``length`` token ids cut from SQuAD paragraphs."""
    from ..data import read_squad
    from ..samples import SAMPLE_TEXTS

    try:
        paragraphs, _ = read_squad()
    except KilnError:
        paragraphs = list(SAMPLE_TEXTS)
    stream: list[int] = []
    for paragraph in paragraphs:
        stream += model.tokenizer.encode(paragraph + "\n", add_special_tokens=False).ids
        if len(stream) >= length + count * 17:
            break
    while len(stream) < length + count * 17:  # little text (the built-in samples): repeat it
        stream += stream
    return [stream[i * 17: i * 17 + length] for i in range(count)]


class OnnxBackend:
    """One of the artifact's own variants (an ONNX graph, or a torch variant), driven through the
    engine core as ``kiln serve`` drives it (chunked prefill, sampling, the engine's batch): what a
    request costs, not only the graph."""

    def __init__(self, model: TextGenerationModel, variant: str | None, threads: int | None, path: Path | None = None,
                 max_batch: int = DEFAULT_MAX_RUNNING):
        """``path``: a graph file to run instead of the artifact's ``variant`` (benchmarks of candidates)."""
        max_batch = max(max_batch, DEFAULT_MAX_RUNNING)
        options = CoreOptions(threads=threads, max_running=max_batch)
        self.core = model.core_for_file(path, options) if path else model.core(variant, options)

    def prefill_seconds(self, ids: list[int]) -> float:
        """Time to the first token of a lone request with this prompt, computed in full: the engine's
        prefix cache is emptied first (the bench repeats one prompt)."""
        self.core.engine.evict_prefixes(1 << 62)
        started = time.perf_counter()
        for _ in run_to_completion(self.core, [Request("bench", ids, greedy(1))]):
            pass
        return time.perf_counter() - started

    def decode_step_seconds(self, prompts: list[list[int]], steps: int, sampled: bool = False) -> list[float]:
        """Seconds per core step once every prompt is prefilled and decoding together (``sampled``:
        each sequence draws with SAMPLED's settings and its row as its seed)."""
        # long enough that the first sequences still run when the last prompt has joined (prompts join
        # as the step's prefill budget allows: one 128-token prompt per step)
        tokens = len(prompts) + steps + 8
        requests = [Request(("bench", row), ids, sampled_params(tokens, row) if sampled else greedy(tokens))
                    for row, ids in enumerate(prompts)]
        for request in requests:
            self.core.add_request(request)
        while self.core.decoding < len(prompts):  # prefill, chunk by chunk
            if any(output.error or output.finished for output in self.core.step()):
                raise KilnError(f"a sequence ended before all {len(prompts)} were decoding")
        self.core.step()  # warm-up at this batch size
        samples = []
        for _ in range(steps):
            started = time.perf_counter()
            self.core.step()
            samples.append(time.perf_counter() - started)
        for request in requests:
            self.core.abort(request.request_id)
        self.core.step()
        return samples


def sampled_params(tokens: int, seed: int) -> SamplingParams:
    """Exactly ``tokens`` tokens (end-of-sequence ignored) drawn as `kiln loadtest --sampled` asks
    (its SAMPLED settings: temperature 0.7, top_p 0.95), with ``seed``."""
    from ..loadtest.streaming import SAMPLED

    return SamplingParams(max_new_tokens=tokens, ignore_eos=True, temperature=SAMPLED["temperature"],
                          top_p=SAMPLED["top_p"], seed=seed)


def measure_backend(backend: Any, label: str, inputs: GenerationInputs, cfg: GenerationBenchConfig,
                    steps: Steps = lambda d: contextlib.nullcontext(),
                    peer: bool = False) -> tuple[list[GenerationCell], list[str]]:
    """Every prefill and decode cell of one backend (anything with ``prefill_seconds`` and
    ``decode_step_seconds``), and notes on the cells it cannot run. A ``peer``'s decode cell that
    fails (an engine's own bound, as onnxruntime-genai's Generator refuses more than 32 sequences) is
    a note, and its other cells stay; an own variant's failure ends the bench."""
    cells: list[GenerationCell] = []
    notes: list[str] = []
    for n, ids in inputs.prompts.items():
        with steps(f"{label}: prefill {n} tokens"):
            backend.prefill_seconds(ids)  # warm-up
            samples = [backend.prefill_seconds(ids) for _ in range(cfg.repeats)]
        cells.append(GenerationCell(label, "prefill", 1, n, Stats.of(samples)))
    for b in cfg.batches:
        if b > 1 and not getattr(backend, "batched", True):
            notes.append(f"{label}: batch {b} not measured (llama-cpp-python's Llama runs one sequence)")
            continue
        with steps(f"{label}: decode at batch {b}, past {cfg.past}"):
            try:
                samples = backend.decode_step_seconds(inputs.decode_prompts[:b], cfg.decode_steps, cfg.sampled)
            except Exception as exc:  # noqa: BLE001 - a peer engine's own refusal of this cell
                if not peer:
                    raise
                notes.append(f"{label}: batch {b} not measured ({type(exc).__name__}: {exc})")
                continue
        cells.append(GenerationCell(label, "decode", b, cfg.past, Stats.of(samples)))
    return cells, notes


def _peers(model: TextGenerationModel, cfg: GenerationBenchConfig, notes: list[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(label, what the child builds) for every peer row to run."""
    if cfg.reference:
        yield "pytorch fp32 (generate)", {"peer": "pytorch", "artifact": str(model.folder)}
    if "llama.cpp" in cfg.peers:
        gguf = gguf_path(model.manifest.source)
        if not gguf:
            notes.append("llama.cpp: the artifact was not converted from a GGUF file")
        elif not llama_cpp_available():
            notes.append(f"llama.cpp: not installed ({llama_cpp_install_hint()})")
        else:
            yield "llama.cpp (same GGUF)", {"peer": "llama.cpp", "gguf": gguf,
                                            "context": max(cfg.prompt_lengths + [cfg.past + cfg.decode_steps + 8])}
    if "onnxruntime-genai" in cfg.peers:
        if not ort_genai_available():
            notes.append(f"onnxruntime-genai: not installed ({install_hint('ortgenai')})")
        else:
            yield "onnxruntime-genai int4 (its own builder)", {"peer": "onnxruntime-genai", "artifact": str(model.folder)}


def measure_peer(argument: dict[str, Any]) -> dict[str, Any]:
    """One peer row, in the child process the bench starts: build the backend, run the bench's loop on
    the inputs it was given, return its cells and notes (as JSON)."""
    cfg = GenerationBenchConfig(**argument["config"])
    backend = _peer_backend(argument, cfg.threads)
    cells, notes = measure_backend(backend, argument["label"], GenerationInputs.from_dict(argument["inputs"]), cfg,
                                   peer=True)
    return {"cells": [asdict(c) for c in cells], "notes": notes}


def _peer_backend(argument: dict[str, Any], threads: int | None) -> Any:
    """The backend ``argument["peer"]`` names (a new peer engine is one more branch here, and its row in
    bench/generation.py's ``_peers``)."""
    if argument["peer"] == "pytorch":
        return TorchBackend(TextGenerationModel(argument["artifact"]), threads)
    if argument["peer"] == "llama.cpp":
        return LlamaCppBackend(argument["gguf"], threads, argument["context"])
    if argument["peer"] == "onnxruntime-genai":
        return OrtGenaiBackend(TextGenerationModel(argument["artifact"]), threads)
    raise ValueError(f"unknown peer {argument['peer']!r}")


def _run_peer(label: str, peer: dict[str, Any], inputs: GenerationInputs, cfg: GenerationBenchConfig,
              steps: Steps) -> tuple[list[GenerationCell], list[str]]:
    argument = {**peer, "label": label, "config": asdict(cfg), "inputs": asdict(inputs)}
    try:
        with steps(f"{label}: prefill and decode (in a child process)"):
            out = run_in_child(measure_peer, argument, cfg.peer_timeout, log_name=label)
    except ChildFailed as exc:
        missing_llama = peer["peer"] == "llama.cpp" and exc.missing == "llama_cpp"
        return [], [f"{label}: " + (f"not installed ({llama_cpp_install_hint()})" if missing_llama else str(exc))]
    return [GenerationCell.from_dict(c) for c in out["cells"]], out["notes"]


# the artifact's own rows ("onnxruntime int4", "kiln torch-fp32"; the onnxruntime-genai peer is not one)
OWN_PREFIXES = ("onnxruntime ", "kiln ")


def _own_variants(model: TextGenerationModel, cfg: GenerationBenchConfig) -> Iterator[tuple[str, Callable[[], Any], Variant]]:
    """(label, the backend's factory, the variant)"""
    for v in model.manifest.kept_variants():
        if v.device != "cpu" or (cfg.variants and v.name not in cfg.variants):
            continue
        label = f"kiln {v.name}" if v.engine == "torch" else f"onnxruntime {v.name}"
        yield label, partial(OnnxBackend, model, v.name, cfg.threads, max_batch=max(cfg.batches)), v


def run_generation_bench(model: TextGenerationModel, cfg: GenerationBenchConfig,
                         steps: Steps = lambda d: contextlib.nullcontext()) -> GenerationBenchResult:
    for name in cfg.variants or []:
        model.manifest.variant(name)  # an unknown name fails here, listing the kept ones
    limit = model.max_context or 10**9
    lengths = [n for n in cfg.prompt_lengths if n <= limit]
    notes = [f"prompt length {n}: longer than the model's context of {limit}" for n in cfg.prompt_lengths if n > limit]
    inputs = GenerationInputs({n: real_token_windows(model, n, 1)[0] for n in lengths},
                              real_token_windows(model, cfg.past, max(cfg.batches)))
    cells: list[GenerationCell] = []
    for label, peer in _peers(model, cfg, notes):
        peer_cells, peer_notes = _run_peer(label, peer, inputs, cfg, steps)
        cells += peer_cells
        notes += peer_notes
    for label, factory, variant in _own_variants(model, cfg):
        with steps(f"Loading {label}"):
            backend = factory()
        # the unit this process runs it on (loaded: AMX is on, or refused), not the one convert recorded
        engine = native.variant_matrix_engine(variant.details, variant.precision, variant.device)
        own_cells, own_notes = measure_backend(backend, label, inputs, cfg, steps)
        for cell in own_cells:
            cell.matrix_engine = engine
        refusal = native.variant_amx_refusal(variant.details)
        if refusal and not any(note.startswith("KILN_AMX=1") for note in notes):
            notes.append(f"KILN_AMX=1: AMX refused ({refusal}); kiln's GGUF operators ran on {engine}")
        cells += own_cells
        notes += own_notes
        del backend  # free it before the next variant loads
    reference = {(c.phase, c.batch, c.tokens): c.stats.median for c in cells if c.backend.startswith("pytorch")}
    for c in cells:
        base = reference.get((c.phase, c.batch, c.tokens))
        c.speedup = base / c.stats.median if base else None
    return GenerationBenchResult(model.name, model.manifest.task, cells, notes, machine_info(cfg.threads), cfg)


def best_ratio(result: GenerationBenchResult, phase: str, batch: int, tokens: int, against: str) -> float | None:
    """Fastest ONNX variant's tokens/s over ``against``'s in one cell (for the summary line)."""
    ours = [c.tokens_per_s for c in result.cells if c.backend.startswith(OWN_PREFIXES)
            and (c.phase, c.batch, c.tokens) == (phase, batch, tokens)]
    theirs = [c.tokens_per_s for c in result.cells if c.backend.startswith(against)
              and (c.phase, c.batch, c.tokens) == (phase, batch, tokens)]
    return max(ours) / statistics.median(theirs) if ours and theirs else None
