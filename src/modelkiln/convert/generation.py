"""``kiln convert MODEL --task text-generation``: a causal LM (Hugging Face folder, hub id or GGUF
file) to an artifact the generation engine runs: one decoder graph with its KV cache per variant
(fp32, int8, int4; fp16 with a GPU), each through the gate on real text (``generation_gate.py``)
and kept only if it passes and decodes faster than fp32; the tokenizer, chat template, special
and end-of-sequence ids and generation defaults in ``kiln.json``'s ``generation`` section.

The graph is the serving graph (``serving_graph.py``: GroupQueryAttention, in-place cache, fused
projections) for the Llama family; other architectures (GPT-2, GPT-NeoX, ...) get the torch
export (``decoder_export.py``), and the manifest says which and why (``generation.graph``)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..atomic import atomic_folder
from ..errors import ConversionError, ModelLoadError, ModelTooLargeError, UnsupportedArchitectureError, ValidationFailedError
from ..generation.core import EngineCore, Request, greedy
from ..generation.engine import ONNX_EXPORT, ONNX_SERVING, TORCH
from ..generation.model import CoreOptions, TextGenerationModel
from ..machine import cpu_description
from ..manifest import Manifest, TokenizerSpec, Variant
from . import source as src
from . import variants as build
from .artifact import TORCH_ENGINE, default_precisions, remove_variant_file, versions
from .decoder_export import DECODER_OPSET, DecoderShape, export_decoder
from .gguf_blocks import has_packable_blocks, pack_gguf_blocks
from .generation_gate import DEFAULT_GATE, GatePrompts, check_batch_invariance, judge, onnx_run, torch_run
from .linear_weights import Fp32Weights, GgufWeights
from .serving_graph import SERVING_GRAPH_OPSET, DecoderSpec, build_serving_graph
from .torch_weights import TORCH_PRECISIONS, save_weights, weights_file
from .torch_weights import variant_name as torch_variant_name

log = logging.getLogger(__name__)

TASK = "text-generation"
PRECISIONS = ("fp32", "int8", "int4", "fp16")
GREEDY_TOKENS = 32  # greedy tokens compared per gate prompt
PARAGRAPH_TOKENS = 256  # perplexity paragraphs are cut to this many tokens
INT8_BLOCK = 32  # weights per int8 scale: SmolLM2 perplexity +0.7% (docs/generation.md)
DECODE_PAST = 64  # variants are timed decoding one token at batch 1 after this many
DECODE_STEPS = 32  # steps timed per round and variant
DEFAULT_PPL_BUDGET = 0.01  # the default variant's perplexity is at most 1% above PyTorch's
TIMING_ROUNDS = 20  # at most; fewer when the time budget (--timing-seconds) runs out
GATE_ROWS = 16  # the torch engine's rows during the gate (its cache is allocated up front on CUDA)
GATE_ROW_TOKENS = 4096  # and tokens per row: gate prompts are cut to 4096 - GREEDY_TOKENS
EXPORT_MEMORY_FACTOR = 3  # export holds the weights ~3 times: PyTorch's, the traced program's, the ONNX file's


# --- source ----------------------------------------------------------------------------------------


def check_size(source: src.SourceModel, max_model_gb: float | None) -> int:
    """Parameters counted on the meta device (no weights read); too large for the limit → a typed error."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            params = sum(p.numel() for p in AutoModelForCausalLM.from_config(source.config).parameters())
    except ValueError as exc:
        raise UnsupportedArchitectureError(f"{source.ref}: {source.model_type} is not a causal LM transformers "
                                           f"can build: {str(exc).splitlines()[0]}") from exc
    limit = max_model_gb if max_model_gb is not None else _memory_gb() / EXPORT_MEMORY_FACTOR
    size_gb = params * 4 / 1e9
    if size_gb > limit:
        raise ModelTooLargeError(f"{source.ref}: {params / 1e6:.0f}M parameters are {size_gb:.2f} GB in fp32; the "
                                 f"limit is {limit:.2f} GB (--max-model-gb; export needs ~{EXPORT_MEMORY_FACTOR}× that in memory)")
    return params


def _memory_gb() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9


def load_causal_lm(source: src.SourceModel) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    try:  # the config given: from_pretrained would read (for a GGUF file: parse) it again
        with src.one_gguf_parse():
            model = AutoModelForCausalLM.from_pretrained(source.load_ref, config=source.config, dtype=torch.float32,
                                                         **source.load_kwargs)
    except ValueError as exc:
        raise UnsupportedArchitectureError(f"{source.ref}: {str(exc).splitlines()[0]}") from exc
    except Exception as exc:  # OSError, safetensors', gguf's and torch's errors: all mean unreadable weights
        raise ModelLoadError(f"cannot load the weights of {source.ref}: {str(exc).splitlines()[0]}") from exc
    return model.eval()


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


def generation_settings(source: src.SourceModel, model: Any, shape: DecoderShape) -> dict[str, Any]:
    """The manifest's ``generation`` section (read by generation/model.py)."""
    tok, cfg = source.tokenizer, model.config
    gen_cfg = getattr(model, "generation_config", None)
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
    from ..data import read_squad, sts_sentences

    prompts, kinds = [], []
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


def convert_generation(cfg: Any, source: src.SourceModel, steps: Any) -> Manifest:
    """``cfg`` is convert.pipeline.ConvertConfig; ``source`` is loaded already. ``cfg.engine``:
    "onnx" (the decoder graphs) or "torch" (the weights for the torch engine, on ``cfg.device``)."""
    torch_engine = cfg.engine == TORCH_ENGINE
    known = TORCH_PRECISIONS if torch_engine else PRECISIONS
    wanted = list(cfg.precisions or default_precisions(TASK, cfg.device, cfg.engine))
    unknown = [p for p in wanted if p not in known]
    if unknown:
        raise ConversionError(f"unknown precision {unknown} for text generation with --engine {cfg.engine} "
                              f"(choose from {', '.join(known)})")
    if not getattr(source.tokenizer, "is_fast", False):
        raise ModelLoadError(f"{source.ref} has no fast tokenizer (tokenizer.json); the engine needs one")
    check_size(source, cfg.max_model_gb)
    with steps("Loading the PyTorch weights (fp32)"):
        model = load_causal_lm(source)
    shape = DecoderShape.of(model.config)
    settings = generation_settings(source, model, shape)
    if torch_engine:
        from ..generation.torch_decoder import DecoderConfig

        DecoderConfig.of(model.config)  # a family the torch engine's forward covers, or a typed error
        settings["graph"] = {"kind": "torch", "opset": None}
    else:
        try:
            DecoderSpec.of(model)
            settings["graph"] = {"kind": "serving", "opset": SERVING_GRAPH_OPSET}
        except UnsupportedArchitectureError as exc:  # covered by the torch export instead: say why
            settings["graph"] = {"kind": "export", "opset": DECODER_OPSET, "why": str(exc)}
            log.info("decoder graph: the torch export (%s)", exc)
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
    gate_cfg = dict(DEFAULT_GATE, **(cfg.generation_gate or {}))
    with atomic_folder(Path(cfg.out), cfg.force) as folder:
        tok.backend_tokenizer.save(str(folder / manifest.tokenizer.file))
        model.config.to_json_file(str(folder / "config.json"))
        manifest.save(folder)  # provisional: the gate reads prompts through the artifact's own code
        if not torch_engine:
            _write_fp32_graph(model, settings, folder / "model.onnx", steps)
            manifest.input_names, manifest.output_names = _graph_io_names(folder / "model.onnx")
            manifest.save(folder)
        artifact = TextGenerationModel(folder)
        limit = min(settings["max_context"] or 4096, 4096) - GREEDY_TOKENS
        texts = [t if isinstance(t, str) else " ".join(t) for t in cfg.calibration_texts or []]
        gate = gate_prompts(artifact, source, texts, cfg.gate_short, cfg.gate_squad, limit)
        with steps(f"Running PyTorch on {len(gate.prompts)} prompts and {len(gate.paragraphs)} paragraphs"):
            reference = torch_run(model, gate, GREEDY_TOKENS)

        variants: list[Variant] = []
        cores: dict[str, EngineCore] = {}  # the gate's engines, timed afterwards (loading one takes seconds)

        def check(name: str, precision: str, path: Path, engine: str, options: CoreOptions, **details: Any) -> Variant:
            with steps(f"Validating {name} ({len(gate.prompts)} prompts, {GREEDY_TOKENS} greedy tokens each)"):
                core = artifact.core_for_file(path, options, kind=engine)
                run = onnx_run(core, gate, GREEDY_TOKENS)
            validation, found, reason = judge(reference, run, gate_cfg[precision])
            with steps(f"Checking {name}'s batch invariance (each prompt alone vs among the others, batched)"):
                reason = _refuse_batch_variant(check_batch_invariance(core, gate, run, GREEDY_TOKENS),
                                               validation, found, reason)
            if validation.passed:
                cores[name] = core
            variant = Variant(name, precision, options.device, path.name, validation.passed, reason=reason,
                              validation=validation, details={**details, **found}, engine=engine)
            variants.append(variant)
            return variant

        if torch_engine:
            base = _torch_variants(cfg, model, folder, wanted, check, steps)
        else:
            base = _onnx_variants(cfg, model, source, settings, folder, wanted, check, variants, steps)
        passed = [v for v in variants if v.file and v.validation and v.validation.passed]
        with steps(f"Timing decode of {len(passed)} variants at batch 1, past {DECODE_PAST} (interleaved)"):
            _time_decode(cores, passed, max(cfg.timing_seconds, 1.0))
        cores.clear()
        for v in passed:
            if (base is not None and v is not base and base.latency_ms is not None and v.latency_ms is not None
                    and v.latency_ms >= base.latency_ms):
                v.kept = False
                v.reason = f"not faster than {base.name} ({v.latency_ms:.2f} vs {base.latency_ms:.2f} ms/token)"
        for v in variants:
            if v.kept:  # the table's note: what the gate saw
                d = v.details
                v.reason = (f"ppl {d['perplexity']:.3f} ({d['perplexity_change'] * 100:+.2f}% vs PyTorch), greedy "
                            f"{d['greedy_tokens_equal']} equal, alone = batched, decode ms/token at past {DECODE_PAST}")
            if v.file and not v.kept:
                remove_variant_file(folder / v.file)
                v.file = None
        if not any(v.kept for v in variants):
            summary = "; ".join(f"{v.name}: {v.reason}" for v in variants)
            raise ValidationFailedError(f"no variant passed validation ({summary})")
        settings["default_variant"] = _default_variant(variants, cfg.device)
        manifest.variants = variants
        manifest.save(folder)
        folder.chmod(0o755)
    return manifest


def _write_fp32_graph(model: Any, settings: dict[str, Any], path: Path, steps: Any) -> None:
    if settings["graph"]["kind"] == "serving":
        with steps("Writing the serving graph (GroupQueryAttention, fused projections)"):
            build_serving_graph(model, Fp32Weights(), path)
    else:
        with steps(f"Exporting to ONNX with a KV cache (torch.export; {settings['graph']['why']})"):
            export_decoder(model, path)


def _onnx_variants(cfg: Any, model: Any, source: src.SourceModel, settings: dict[str, Any], folder: Path,
                   wanted: list[str], check: Any, variants: list[Variant], steps: Any) -> Variant:
    """fp32, int8 and int4 decoder graphs, each through ``check`` (which records it in ``variants``);
    returns fp32 (the others' base)."""
    serving = settings["graph"]["kind"] == "serving"
    engine = ONNX_SERVING if serving else ONNX_EXPORT
    options = CoreOptions(threads=cfg.threads, keep_logits=True)
    gguf_path = source.folder / source.gguf_file if source.folder and source.gguf_file else None
    fp32_path = folder / "model.onnx"
    fp32 = check("fp32", "fp32", fp32_path, engine, options)
    if "fp32" not in wanted:
        fp32.kept, fp32.reason = False, fp32.reason or "not requested (built as the base of the others)"
    if "int8" in wanted:
        path = folder / "model.int8.onnx"
        # Weight-only MatMulNBits: dynamic int8's per-tensor activation scale is broken by Llama-family
        # outlier channels, and shared across the step's sequences.
        with steps(f"Quantizing to int8 (weight-only MatMulNBits, block {INT8_BLOCK}, accuracy level {cfg.int4_accuracy_level})"):
            build.quantize_int8_weights(fp32_path, path, INT8_BLOCK, cfg.int4_accuracy_level)
        check("int8", "int8", path, engine, options, weight_only=True, block_size=INT8_BLOCK,
              accuracy_level=cfg.int4_accuracy_level)
    if "int4" in wanted:
        path = folder / "model.int4.onnx"
        if gguf_path is not None and has_packable_blocks(gguf_path):
            # The GGUF's own 4-bit blocks (gguf_blocks.py): re-quantizing its dequantized weights
            # on a second grid cost SmolLM2 +28% perplexity; packing them costs nothing.
            with steps(f"Packing the GGUF's own quantized blocks into MatMulNBits (block 32, accuracy level {cfg.int4_accuracy_level})"):
                if serving:
                    packed = build_serving_graph(model, GgufWeights(gguf_path, cfg.int4_accuracy_level), path)
                else:
                    packed = pack_gguf_blocks(fp32_path, path, gguf_path, cfg.int4_accuracy_level)
            check("int4", "int4", path, engine, options, block_size=32, accuracy_level=cfg.int4_accuracy_level,
                  from_gguf_blocks=packed)
        else:
            with steps(f"Quantizing to int4 (MatMulNBits, block {cfg.int4_block_size}, accuracy level {cfg.int4_accuracy_level})"):
                build.quantize_int4(fp32_path, path, cfg.int4_block_size, cfg.int4_accuracy_level)
            check("int4", "int4", path, engine, options, block_size=cfg.int4_block_size,
                  accuracy_level=cfg.int4_accuracy_level)
    if "fp16" in wanted:
        variants.append(Variant("fp16", "fp16", "cuda", None, False,
                                reason="needs a CUDA device (onnxruntime CUDAExecutionProvider); fp16 is slow on CPU"))
    return fp32


def _torch_variants(cfg: Any, model: Any, folder: Path, wanted: list[str], check: Any, steps: Any) -> Variant | None:
    """The weights in each wanted precision, each through ``check`` on the torch engine (``cfg.device``,
    with its CUDA graphs where there are any); returns torch-fp32 where built (the others' base)."""
    options = CoreOptions(threads=cfg.threads, device=cfg.device, keep_logits=True, max_running=GATE_ROWS,
                          kv_budget=GATE_ROWS * GATE_ROW_TOKENS, warm_up=True)
    base = None
    for precision in wanted:
        path = folder / weights_file(precision)
        with steps(f"Writing the {precision} weights for the torch engine"):
            save_weights(model, path, precision)
        variant = check(torch_variant_name(precision), precision, path, TORCH, options, batch_invariant=True)
        if precision == "fp32":
            base = variant
    return base


def _default_variant(variants: list[Variant], device: str) -> str:
    """What serve, generate and Triton run when no variant is named: the fastest kept variant on the
    device the conversion ran on whose perplexity is within DEFAULT_PPL_BUDGET of PyTorch's (the gate
    admits up to 3%: a variant may be chosen by name for its speed, but is not the default at the
    cost of more accuracy than that)."""
    kept = [v for v in variants if v.kept and v.device == device and v.latency_ms is not None]
    close = [v for v in kept if abs(v.details.get("perplexity_change", 1.0)) <= DEFAULT_PPL_BUDGET]
    return min(close or kept, key=lambda v: v.latency_ms).name  # type: ignore[arg-type,return-value]


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


def _time_decode(cores: dict[str, EngineCore], variants: list[Variant], seconds: float) -> None:
    """ms per decode step at batch 1, past DECODE_PAST to DECODE_PAST + DECODE_STEPS tokens: each
    round runs a prompt on every variant in turn and times its core's steps one by one once it
    decodes (interleaved, so a burst of load elsewhere hits every variant alike)."""
    prompt = list(range(1, DECODE_PAST + 1))
    samples: dict[str, list[float]] = {v.name: [] for v in variants}
    deadline = time.perf_counter() + seconds
    for round_ in range(TIMING_ROUNDS):
        for v in variants:
            core = cores[v.name]
            core.add_request(Request(("timing", round_), prompt, greedy(DECODE_STEPS + 1)))
            core.step()  # the prompt, its first token and the first decode step
            for step in range(DECODE_STEPS - 1):
                started = time.perf_counter()
                core.step()
                if round_ or step >= 2:  # the first steps of the first round warm the session up
                    samples[v.name].append(time.perf_counter() - started)
            while core.has_work():
                core.step()
        if round_ >= 1 and time.perf_counter() > deadline:
            break
    for v in variants:
        v.latency_ms = round(float(np.median(samples[v.name])) * 1000, 4)
        v.latency_shape = [1, 1]
        v.details["decode_past"] = DECODE_PAST


def _graph_io_names(path: Path) -> tuple[list[str], list[str]]:
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    return [i.name for i in graph.input], [o.name for o in graph.output]
