"""``kiln convert MODEL --task text-generation``: a causal LM (Hugging Face folder, hub id or GGUF
file) to an artifact the generation engine runs: one decoder graph with its KV cache per variant,
each through the gate on real text (``generation/gate.py``) and kept only if it passes (and, but
for fp32, decodes faster than fp32); the tokenizer, chat template, special and end-of-sequence ids
and generation defaults in ``kiln.json``'s ``generation`` section.

The variants: ``gguf`` (a GGUF source's own blocks in MatMulNBits: the default, and for a GGUF
source the only default), ``fp32``, ``int8`` and ``int4`` (quantized from fp32 by onnxruntime),
``fp16`` (CUDA only); with ``--engine torch``, the weights for the torch engine (``torch-fp32``,
``torch-bf16``, ``torch-fp16``). Where the weights come from, and which reference the gate compares with, is
``generation/sources.py``'s: a GGUF of the Llama family is read by tensor name and never held in
fp32; anything else is loaded by transformers.

The graph is the serving graph (``serving_graph.py``: GroupQueryAttention, in-place cache, fused
projections) for the Llama family; other architectures (GPT-2, GPT-NeoX, ...) get the torch
export (``decoder_export.py``), and the manifest says which and why (``generation.graph``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ...atomic import atomic_folder
from ...errors import ConversionError, ModelLoadError, ValidationFailedError
from ...generation.core import EngineCore, Request, greedy
from ...generation.engines.registry import ONNX_EXPORT, ONNX_SERVING, TORCH
from ...generation.model import CoreOptions, TextGenerationModel
from ...machine import cpu_description
from ...manifest import Manifest, TokenizerSpec, Variant
from ... import native
from ...native import LAYOUT as NATIVE_LAYOUT
from .. import source as src
from .. import variants as build
from ..artifact import TORCH_ENGINE, default_precisions, remove_variant_file, versions
from .decoder_export import DecoderShape
from .gate import (DEFAULT_GATE, CandidateRun, GatePrompts, ReferenceRun, candidate_run, check_batch_invariance,
                              judge, teacher_forced)
from .sources import FP32_VARIANTS, GgufSource, TransformersSource, open_source
from .logit_store import LogitStore
from .torch_weights import TORCH_PRECISIONS, save_weights, weights_file
from .torch_weights import variant_name as torch_variant_name

log = logging.getLogger(__name__)

TASK = "text-generation"
PRECISIONS = ("gguf", "fp32", "int8", "int4", "fp16")
GREEDY_TOKENS = 32  # greedy tokens compared per gate prompt
PARAGRAPH_TOKENS = 256  # perplexity paragraphs are cut to this many tokens
INT8_BLOCK = 32  # weights per int8 scale: SmolLM2 perplexity +0.7% (docs/generation.md)
DECODE_PAST = 64  # variants are timed decoding one token at batch 1 after this many
DECODE_STEPS = 32  # steps timed per round and variant
# KilnAttention's KV cache (the gguf variant with kiln's native operators): f16 halves a token's memory and
# the bytes each step reads, as llama.cpp's default cache (docs/generation.md has its gate figures)
KV_CACHE_TYPES = ("f16", "f32")
DEFAULT_PPL_BUDGET = 0.01  # the default variant's perplexity is at most 1% above PyTorch's
TIMING_ROUNDS = 20  # at most; fewer when the time budget (--timing-seconds) runs out
GATE_ROWS = 16  # the torch engine's rows during the gate (its cache is allocated up front on CUDA)
GATE_ROW_TOKENS = 4096  # and tokens per row: gate prompts are cut to 4096 - GREEDY_TOKENS


# --- source ----------------------------------------------------------------------------------------


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


def generation_settings(source: src.SourceModel, cfg: Any, gen_cfg: Any, shape: DecoderShape) -> dict[str, Any]:
    """The manifest's ``generation`` section (read by generation/model.py)."""
    tok = source.tokenizer
    eos: list[int] = []
    for candidate in (_ids(getattr(gen_cfg, "eos_token_id", None)), _ids(getattr(cfg, "eos_token_id", None)),
                      _ids(tok.eos_token_id)):
        eos += [i for i in candidate if i not in eos]
    special = {k: getattr(tok, k) for k in ("bos_token", "eos_token", "pad_token", "unk_token")
               if isinstance(getattr(tok, k, None), str)}
    defaults: dict[str, Any] = {"max_new_tokens": 256}
    if gen_cfg is not None and getattr(gen_cfg, "do_sample", False):
        for key in ("temperature", "top_k", "top_p"):
            if getattr(gen_cfg, key, None) is not None:
                defaults[key] = getattr(gen_cfg, key)
    if gen_cfg is not None and getattr(gen_cfg, "repetition_penalty", None) not in (None, 1.0):
        defaults["repetition_penalty"] = gen_cfg.repetition_penalty
    max_context = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    return {"eos_token_ids": eos, "chat_template": getattr(tok, "chat_template", None) or None,
            "special_tokens": special, "special_token_ids": {k: tok.convert_tokens_to_ids(v) for k, v in special.items()},
            "max_context": int(max_context) if max_context else None, "defaults": defaults,
            "layers": shape.layers, "heads": shape.heads, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim,
            "vocab_size": shape.vocab}


# --- gate prompts ------------------------------------------------------------------------------------


def gate_prompts(artifact: Any, source: src.SourceModel, texts: Sequence[str] | None, short: int, squad: int,
                 limit: int) -> GatePrompts:
    """STS-B sentences as short plain prompts and SQuAD question + context in the chat template (or
    the user's texts); SQuAD paragraphs for perplexity. Prompts longer than ``limit`` tokens are skipped."""
    from ...data import read_squad, sts_sentences

    prompts, kinds = [], []
    chats: list[str]
    if texts:
        plain, chats, paragraphs_text = list(texts[:short + squad]), [], list(texts[:squad])
    else:
        plain = sts_sentences()[:short]
        paragraphs_all, questions = read_squad()
        seen: set[str] = set()
        chats = []
        for q in questions:
            if q.context not in seen and len(chats) < squad and artifact.chat_template:
                seen.add(q.context)
                chats.append(f"{q.context}\n\nQuestion: {q.question}\nAnswer briefly.")
        paragraphs_text = [p for p in paragraphs_all if p not in seen][:squad]
    for text in plain:
        prompts.append(artifact.prompt_ids(text))
        kinds.append("text" if texts else "sts")
    mismatched = [t for t, ids in zip(plain, prompts) if source.tokenizer(t)["input_ids"] != ids]
    if mismatched:
        raise ConversionError(f"the exported tokenizer.json disagrees with transformers on {len(mismatched)} of "
                              f"{len(plain)} texts (first: {mismatched[0][:60]!r})")
    for text in chats:
        ids = artifact.prompt_ids(text, chat=True)
        if len(ids) <= limit:
            prompts.append(ids)
            kinds.append("squad-chat")
    paragraphs = [artifact.prompt_ids(t)[:PARAGRAPH_TOKENS] for t in paragraphs_text]
    paragraphs = [p for p in paragraphs if len(p) >= 2]
    return GatePrompts(prompts, kinds, paragraphs)


# --- the conversion ------------------------------------------------------------------------------------


@dataclass
class Built:
    """A variant's file, written and waiting for the gate: its precision (the gate's tolerance) and
    the engine that runs it."""

    name: str
    path: Path
    precision: str
    engine: str
    details: dict[str, Any] = field(default_factory=dict)


def convert_generation(cfg: Any, source: src.SourceModel, steps: Any) -> Manifest:
    """``cfg`` is convert.pipeline.ConvertConfig; ``source`` is loaded already. ``cfg.engine``:
    "onnx" (the decoder graphs) or "torch" (the weights for the torch engine, on ``cfg.device``)."""
    torch_engine = cfg.engine == TORCH_ENGINE
    known = TORCH_PRECISIONS if torch_engine else PRECISIONS
    wanted = list(cfg.precisions or default_precisions(TASK, cfg.device, cfg.engine, gguf=source.gguf_path is not None))
    unknown = [p for p in wanted if p not in known]
    if unknown:
        raise ConversionError(f"unknown precision {unknown} for text generation with --engine {cfg.engine} "
                              f"(choose from {', '.join(known)})")
    if not getattr(source.tokenizer, "is_fast", False):
        raise ModelLoadError(f"{source.ref} has no fast tokenizer (tokenizer.json); the engine needs one")
    origin = open_source(source, wanted, cfg.max_model_gb, steps, torch_engine=torch_engine)
    shape = DecoderShape.of(origin.config)
    settings = generation_settings(source, origin.config, origin.generation_config, shape)
    settings["graph"] = origin.graph
    tok = source.tokenizer
    pad = tok.pad_token if isinstance(tok.pad_token, str) else (tok.eos_token or "")
    manifest = Manifest(
        name=cfg.name or Path(cfg.out).name, task=TASK,
        input_names=["input_ids"] if torch_engine else shape.input_names,
        output_names=["logits"] if torch_engine else shape.output_names, max_length=int(settings["max_context"] or 2048),
        tokenizer=TokenizerSpec(pad_token=str(pad), pad_token_id=int(tok.convert_tokens_to_ids(pad) or 0)),
        variants=[], generation=settings,
        source={"model": cfg.model, "model_type": source.model_type, "architecture": source.architecture,
                "gguf_file": source.gguf_file, "max_positions": settings["max_context"]},
        versions=versions(), opset=settings["graph"]["opset"], machine=cpu_description(),
    )
    with atomic_folder(Path(cfg.out), cfg.force) as folder:
        tok.backend_tokenizer.save(str(folder / manifest.tokenizer.file))
        origin.config.to_json_file(str(folder / "config.json"))
        manifest.save(folder)  # provisional, no variant yet: the gate reads prompts through the artifact's own code
        if torch_engine:
            assert isinstance(origin, TransformersSource)  # open_source's source for the torch engine
            built = _build_torch(origin.model, folder, wanted, steps)
        else:
            built = _build_onnx(cfg, origin, folder, wanted, steps)
            manifest.input_names, manifest.output_names = _graph_io_names(built[0].path)
            manifest.save(folder)
        artifact = TextGenerationModel(folder)
        limit = min(settings["max_context"] or 4096, 4096) - GREEDY_TOKENS
        texts = [t if isinstance(t, str) else " ".join(t) for t in cfg.calibration_texts or []]
        gate = gate_prompts(artifact, source, texts, cfg.gate_short, cfg.gate_squad, limit)
        reference = origin.reference()
        variants = _gate(cfg, artifact, gate, built, reference, shape.vocab, steps)
        if "fp16" in wanted and not torch_engine:
            variants.append(Variant("fp16", "fp16", "cuda", None, False,
                                    reason="needs a CUDA device (onnxruntime CUDAExecutionProvider); fp16 is slow on CPU"))
        settings["reference"] = reference.description
        _keep(variants, wanted, folder)
        if not any(v.kept for v in variants):
            summary = "; ".join(f"{v.name}: {v.reason}" for v in variants)
            raise ValidationFailedError(f"no variant passed validation ({summary})")
        settings["default_variant"] = _default_variant(variants, cfg.device)
        manifest.variants = variants
        manifest.save(folder)
    return manifest


def _native_ops_built() -> bool:
    from ...native import library_path

    if library_path() is None:
        log.warning("kiln's native GGUF operators are not built on this machine: MatMulNBits is used")
        return False
    return True


def _build_onnx(cfg: Any, origin: Any, folder: Path, wanted: list[str], steps: Any) -> list[Built]:
    """Every ONNX variant's graph file: fp32 first where the others are made from it."""
    built: list[Built] = []
    engine = ONNX_SERVING if origin.graph["kind"] == "serving" else ONNX_EXPORT
    fp32_path = folder / "model.onnx"
    needs_fp32 = any(p in wanted for p in FP32_VARIANTS) or not isinstance(origin, GgufSource)
    if needs_fp32:
        if origin.graph["kind"] == "serving":
            what = "the GGUF's tensors, dequantized a tensor at a time" if isinstance(origin, GgufSource) else "PyTorch's weights"
            description = f"Writing the serving graph in fp32 ({what})"
        else:
            description = f"Exporting to ONNX with a KV cache (torch.export; {origin.graph['why']})"
        with steps(description):
            origin.write_fp32(fp32_path)
        built.append(Built("fp32", fp32_path, "fp32", engine))
    level = cfg.int4_accuracy_level
    if "gguf" in wanted:
        path = folder / "model.gguf.onnx"
        notes = origin.unpackable_notes()
        native = cfg.native_gguf and _native_ops_built() and isinstance(origin, GgufSource)  # the serving graph's
        into = "kiln's native operators (Q4_0..Q8_0, Q2_K..Q6_K as stored) and MatMulNBits" if native else "MatMulNBits"
        with steps(f"Packing the GGUF's own blocks into {into} (accuracy level {level})"
                   + "".join(f"; {n}" for n in notes)):
            types = origin.write_packed(path, fp32_path if needs_fp32 else None, level, native=native,
                                        kv_halves=native and cfg.kv_cache == "f16")
        native_details = {"native_ops": NATIVE_LAYOUT, "kv_cache": cfg.kv_cache} if native else {}
        built.append(Built("gguf", path, "gguf", engine, {"from_gguf": types, "accuracy_level": level, **native_details,
                                                          **({"notes": notes} if notes else {})}))
    if "int8" in wanted:
        path = folder / "model.int8.onnx"
        # Weight-only MatMulNBits: dynamic int8's per-tensor activation scale is broken by Llama-family
        # outlier channels, and shared across the step's sequences.
        with steps(f"Quantizing to int8 (weight-only MatMulNBits, block {INT8_BLOCK}, accuracy level {level})"):
            build.quantize_int8_weights(fp32_path, path, INT8_BLOCK, level)
        built.append(Built("int8", path, "int8", engine, {"weight_only": True, "block_size": INT8_BLOCK, "accuracy_level": level}))
    if "int4" in wanted:
        path = folder / "model.int4.onnx"
        with steps(f"Quantizing to int4 (MatMulNBits, block {cfg.int4_block_size}, accuracy level {level})"):
            build.quantize_int4(fp32_path, path, cfg.int4_block_size, level)
        built.append(Built("int4", path, "int4", engine, {"block_size": cfg.int4_block_size, "accuracy_level": level}))
    return built


def _build_torch(model: Any, folder: Path, wanted: list[str], steps: Any) -> list[Built]:
    """The weights in each wanted precision, for the torch engine."""
    built = []
    for precision in wanted:
        path = folder / weights_file(precision)
        with steps(f"Writing the {precision} weights for the torch engine"):
            save_weights(model, path, precision)
        built.append(Built(torch_variant_name(precision), path, precision, TORCH, {"batch_invariant": True}))
    return built


def _gate(cfg: Any, artifact: TextGenerationModel, gate: GatePrompts, built: list[Built], reference: Any, vocab: int,
          steps: Any) -> list[Variant]:
    """Every built variant through the gate: each runs the prompts (its logits to a temporary
    file), is checked for batch invariance and timed; then the sessions are released and the
    reference runs once on every variant's teacher-forced sequences; then each is judged."""
    gate_cfg = dict(DEFAULT_GATE, **(cfg.generation_gate or {}))
    runs: dict[str, CandidateRun] = {}
    invariance: dict[str, Any] = {}
    cores: dict[str, EngineCore] = {}  # kept for the timing (loading one takes seconds)
    options = {b.name: _gate_options(cfg, b.engine) for b in built}
    try:
        for b in built:
            with steps(f"Running {b.name} on {len(gate.prompts)} prompts ({GREEDY_TOKENS} greedy tokens each) and "
                       f"{len(gate.paragraphs)} paragraphs"):
                cores[b.name] = artifact.core_for_file(b.path, options[b.name], kind=b.engine)
                runs[b.name] = candidate_run(cores[b.name], gate, GREEDY_TOKENS, vocab)
            with steps(f"Checking {b.name}'s batch invariance (each prompt alone vs among the others, batched)"):
                invariance[b.name] = check_batch_invariance(cores[b.name], gate, runs[b.name], GREEDY_TOKENS)
        with steps(f"Timing decode of {len(built)} variants at batch 1, past {DECODE_PAST} (interleaved)"):
            latency = _time_decode(cores, max(cfg.timing_seconds, 1.0))
        cores.clear()  # the sessions' memory goes back before the reference loads its weights
        sequences = list(dict.fromkeys(teacher_forced(p, run.tokens[i]) for run in runs.values()
                                       for i, p in enumerate(gate.prompts)))
        with steps(f"Running the reference ({reference.description}) on {len(sequences)} sequences and "
                   f"{len(gate.paragraphs)} paragraphs"), LogitStore(vocab) as store:
            ref = ReferenceRun(store, reference.run(sequences, gate.paragraphs, store), reference.description)
            variants = []
            for b in built:
                device = options[b.name].device
                validation, found, reason = judge(ref, runs[b.name], gate.prompts, gate_cfg[b.precision])
                reason = _refuse_batch_variant(invariance[b.name], validation, found, reason)
                engine = native.variant_matrix_engine(b.details, b.precision, device)
                native.log_amx_refusal(b.details)  # KILN_AMX=1 and the table says VNNI: why
                variants.append(Variant(b.name, b.precision, device, b.path.name, validation.passed,
                                        reason=reason, validation=validation, latency_ms=latency[b.name],
                                        latency_shape=[1, 1], details={**b.details, **found, "decode_past": DECODE_PAST,
                                                                       "matrix_engine": engine},
                                        engine=b.engine))
    finally:
        for run in runs.values():
            run.logits.close()
    return variants


def _gate_options(cfg: Any, engine: str) -> CoreOptions:
    if engine == TORCH:  # on cfg.device, with its CUDA graphs where there are any
        return CoreOptions(threads=cfg.threads, device=cfg.device, keep_logits=True, max_running=GATE_ROWS,
                           kv_budget=GATE_ROWS * GATE_ROW_TOKENS, warm_up=True)
    return CoreOptions(threads=cfg.threads, keep_logits=True)


def _keep(variants: list[Variant], wanted: list[str], folder: Path) -> None:
    """Which passing variants stay: fp32 (torch-fp32) if asked for; the others if faster than it
    (when it was built). Files of the others are removed; a kept variant's note says what the gate saw."""
    base = next((v for v in variants if v.name in ("fp32", torch_variant_name("fp32"))), None)
    for v in variants:
        if v is base and v.precision not in wanted:
            v.kept, v.reason = False, v.reason or "not requested (built as the base of the others)"
        elif v.kept and v is not base and base is not None and base.validation and base.validation.passed \
                and v.latency_ms is not None and base.latency_ms is not None and v.latency_ms >= base.latency_ms:
            v.kept = False
            v.reason = f"not faster than {base.name} ({v.latency_ms:.2f} vs {base.latency_ms:.2f} ms/token)"
    for v in variants:
        if v.kept:  # the table's note: what the gate saw
            d = v.details
            v.reason = (f"ppl {d['perplexity']:.3f} ({d['perplexity_change'] * 100:+.2f}% vs PyTorch), greedy "
                        f"{d['greedy_tokens_equal']} equal, alone = batched, decode ms/token at past {DECODE_PAST}"
                        + "".join(f"; {n}" for n in d.get("notes", [])))
        if v.file and not v.kept:
            remove_variant_file(folder / v.file)
            v.file = None


def _default_variant(variants: list[Variant], device: str) -> str:
    """What serve, generate and Triton run when no variant is named: the fastest kept variant on the
    device the conversion ran on whose perplexity is within DEFAULT_PPL_BUDGET of PyTorch's (the gate
    admits up to 3%: a variant may be chosen by name for its speed, but is not the default at the
    cost of more accuracy than that)."""
    kept = [v for v in variants if v.kept and v.device == device and v.latency_ms is not None]
    close = [v for v in kept if abs(v.details.get("perplexity_change", 1.0)) <= DEFAULT_PPL_BUDGET]

    def latency(v: Variant) -> float:
        assert v.latency_ms is not None  # kept: those with one
        return v.latency_ms

    return min(close or kept, key=latency).name


def _refuse_batch_variant(invariance: Any, validation: Any, details: dict[str, Any], reason: str) -> str:
    """Record the batch check (manifest: ``validation.batch_agreement`` / ``batch_min_cosine``,
    ``details.batch_invariance``); a prompt whose greedy tokens change with the batch refuses the variant."""
    validation.batch_agreement, validation.batch_min_cosine = invariance.agreement, invariance.min_cosine
    details["batch_invariance"] = {"prompts_differing": invariance.differing, "prompts": invariance.prompts,
                                   "max_abs_diff_logits": invariance.max_abs_diff}
    if not invariance.differing:
        return reason
    validation.passed = False
    return "; ".join(r for r in (reason, invariance.reason()) if r)


def _time_decode(cores: dict[str, EngineCore], seconds: float) -> dict[str, float]:
    """ms per decode step at batch 1, past DECODE_PAST to DECODE_PAST + DECODE_STEPS tokens: each
    round runs a prompt on every variant in turn and times its core's steps one by one once it
    decodes (interleaved, so a burst of load elsewhere hits every variant alike)."""
    prompt = list(range(1, DECODE_PAST + 1))
    samples: dict[str, list[float]] = {name: [] for name in cores}
    deadline = time.perf_counter() + seconds
    for round_ in range(TIMING_ROUNDS):
        for name, core in cores.items():
            core.add_request(Request(("timing", round_), prompt, greedy(DECODE_STEPS + 1)))
            core.step()  # the prompt, its first token and the first decode step
            for step in range(DECODE_STEPS - 1):
                started = time.perf_counter()
                core.step()
                if round_ or step >= 2:  # the first steps of the first round warm the session up
                    samples[name].append(time.perf_counter() - started)
            while core.has_work():
                core.step()
        if round_ >= 1 and time.perf_counter() > deadline:
            break
    return {name: round(float(np.median(s)) * 1000, 4) for name, s in samples.items()}


def _graph_io_names(path: Path) -> tuple[list[str], list[str]]:
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    return [i.name for i in graph.input], [o.name for o in graph.output]
