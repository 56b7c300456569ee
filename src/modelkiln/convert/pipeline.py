"""``kiln convert``: export, build variants, validate each against PyTorch, write the artifact atomically."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import ContextManager

import numpy as np
from tokenizers import Tokenizer

from ..atomic import atomic_folder, check_output
from ..data import read_squad
from ..timing import measure_interleaved
from ..errors import ConversionError, ValidationFailedError
from ..extras import has_extra, install_hint
from ..machine import cpu_description, cpu_flags, matrix_engine, native_bf16
from ..manifest import Manifest, TokenizerSpec, Variant
from ..runtime.onnx import cuda_available
from ..runtime.engine import Engine
from ..runtime.registry import ONNX, OPENVINO, TORCH, open_encoder
from ..runtime.tokenizer import TextEncoder
from ..samples import SAMPLE_TEXTS
from ..tasks import Task, TextInput, make_task, task_class
from .generation import pipeline as generation
from . import source as src
from . import variants as build
from .artifact import (ONNX_ENGINE, OPENVINO_PRECISIONS, TORCH_ENGINE, default_precisions, remove_variant_file,
                       versions)
from .generation.torch_weights import TORCH_PRECISIONS, save_weights, weights_file
from .generation.torch_weights import variant_name as torch_variant_name
from .export import EXTERNAL_DATA_THRESHOLD, OPSET, TaskModule, export_onnx
from .validate import (DEFAULT_TOLERANCES, Reference, Tolerance, batch_invariance, failure_reason, run_reference,
                       validate)

log = logging.getLogger(__name__)

PRECISIONS = ("fp32", "optimized", "int8", "fp16", "tensorrt", *OPENVINO_PRECISIONS)
# The int8 variant's method, recorded in the manifest (variant details) and shown by `kiln convert`.
INT8_METHOD = "per-row: int8 weights per column, int8 activations per token (batch-invariant)"
# The OpenVINO int8 variant's method (variant details), and how many inputs NNCF calibrates it on
# (its own default subset size).
OPENVINO_INT8_METHOD = "NNCF static: int8 weights per channel, activation scales calibrated once (batch-invariant)"
CALIBRATION_SIZE = 300
LATENCY_SEQ = 128  # variants are timed at batch 1 × this many tokens (or the model's max, if smaller)

Steps = Callable[[str], ContextManager[None]]


def _no_steps(description: str) -> ContextManager[None]:
    return contextlib.nullcontext()


@dataclass
class ConvertConfig:
    model: str
    out: Path
    task: str = "auto"
    precisions: Sequence[str] | None = None  # None: every variant that fits the device
    device: str = "cpu"
    engine: str = ONNX_ENGINE  # "onnx": ONNX Runtime graphs; "torch": weights for the torch engines
    calibration_texts: Sequence[TextInput] | None = None
    tolerances: dict[str, Tolerance] = field(default_factory=lambda: dict(DEFAULT_TOLERANCES))
    threads: int | None = None
    force: bool = False
    name: str | None = None
    external_data_threshold: int = EXTERNAL_DATA_THRESHOLD
    timing_seconds: float = 0.5  # time budget for each variant's latency measurement
    # Text generation (convert/generation/pipeline.py)
    int4_block_size: int = 32
    int4_accuracy_level: int = 4
    native_gguf: bool = True  # a GGUF's blocks as stored (Q4_0..Q8_0, Q2_K..Q6_K), for kiln's native operators (native/)
    kv_cache: str = "f16"  # with native_gguf: KilnAttention's KV cache, f16 or f32 (KV_CACHE_TYPES)
    gate_short: int = 8  # STS-B sentences as plain prompts
    gate_squad: int = 4  # SQuAD question + context chat prompts (and as many perplexity paragraphs)
    generation_gate: dict | None = None  # precision → generation_gate.GateTolerance overrides
    max_model_gb: float | None = None  # fp32 weight size limit; default: a third of the machine's memory


def torch_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def default_texts(task: str) -> list[TextInput]:
    return list(task_class(task).sample_inputs)


# --- the conversion ---------------------------------------------------------------------------


def check_tokenizer_parity(source: src.SourceModel, encoder: TextEncoder, texts: Sequence[TextInput], truncation: str) -> None:
    """The served tokenizer (tokenizers alone) must give transformers' ids, or answers would differ."""
    singles = [t for t in texts if isinstance(t, str)]
    pairs = [t for t in texts if not isinstance(t, str)]
    hf_truncation = {"longest_first": "longest_first", "only_second": "only_second"}[truncation]
    mismatches = 0
    if singles:
        ids = source.tokenizer(singles, truncation=True, max_length=encoder.max_length)["input_ids"]
        mismatches += sum(a != e.ids for a, e in zip(ids, encoder.tokenize(singles)))
    if pairs:
        ids = source.tokenizer([p[0] for p in pairs], [p[1] for p in pairs], truncation=hf_truncation,
                               max_length=encoder.max_length)["input_ids"]
        mismatches += sum(a != e.ids for a, e in zip(ids, encoder.tokenize(pairs)))
    if mismatches:
        raise ConversionError(f"the exported tokenizer.json disagrees with transformers on {mismatches} texts")


def timing_feeds(encoder: TextEncoder, task: str, seq: int) -> dict[str, np.ndarray]:
    """Batch 1 × ``seq`` real tokens: a long sample text (a QA context), truncated to length."""
    long_text = " ".join(SAMPLE_TEXTS[18:21] * 4)
    item: TextInput = task_class(task).input_around(long_text)
    enc = encoder.tokenize([item])[0]
    feeds = encoder.collate([enc])
    return {k: np.ascontiguousarray(v[:, :seq]) for k, v in feeds.items()}


class _Builder:
    """The state of one conversion: where files go and what has been learned so far."""

    def __init__(self, cfg: ConvertConfig, folder: Path, manifest: Manifest, task: Task, encoder: TextEncoder,
                 reference: Reference, config: object, steps: Steps):
        self.cfg, self.folder, self.manifest, self.task, self.encoder = cfg, folder, manifest, task, encoder
        self.reference, self.config, self.steps = reference, config, steps
        self.feeds = timing_feeds(encoder, task.name, min(LATENCY_SEQ, encoder.max_length))
        self.variants: list[Variant] = []
        self.latency: dict[str, float] = {}

    def tolerance(self, precision: str) -> Tolerance:
        return self.cfg.tolerances[precision]

    def check(self, name: str, precision: str, device: str, path: Path, engine: str = ONNX, **details: object) -> Variant:
        """Validate one built file: close to PyTorch, and each text's answer the same alone as inside
        a padded batch of mixed lengths. Returns a Variant record, kept if it passed (timing comes later)."""
        variant = Variant(name=name, precision=precision, device=device, file=path.name, kept=False, engine=engine)
        runner = open_encoder(self.folder, self.manifest, variant, self.cfg.threads, keep_hidden=True)
        validation = validate(self.task, self.reference, runner, self.tolerance(precision))
        texts = self.reference.inputs
        invariance = batch_invariance(self.task, self.encoder, runner, texts)
        validation.batch_min_cosine, validation.batch_agreement = invariance.min_cosine, invariance.agreement
        validation.passed = validation.passed and invariance.passed
        variant.kept, variant.reason, variant.validation = validation.passed, failure_reason(validation), validation
        variant.details = {**details, "matrix_engine": matrix_engine(precision, device, cpu_flags(), engine)}
        return variant

    def time_all(self, variants: list[Variant]) -> None:
        """Latency of every validated variant at batch 1, measured interleaved (see measure_interleaved):
        at one fixed shape (``latency_ms``), and over the gate's texts one after another at their own
        lengths (``served_ms``, per text)."""
        engines = {id(v): open_encoder(self.folder, self.manifest, v, self.cfg.threads) for v in variants}
        stats = measure_interleaved({k: partial(e.run, self.feeds) for k, e in engines.items()},
                                    rounds=5, seconds_per_round=self.cfg.timing_seconds / 5)
        alone = [self.encoder.encode([text])[0] for text in self.reference.inputs]
        served = measure_interleaved({k: partial(_run_each, e, alone) for k, e in engines.items()},
                                     rounds=5, seconds_per_round=self.cfg.timing_seconds / 5)
        for v in variants:
            v.latency_ms = round(stats[id(v)].median, 4)
            v.latency_shape = list(self.feeds["input_ids"].shape)
            v.served_ms = round(served[id(v)].median / len(alone), 4)

    def skip(self, name: str, precision: str, device: str, reason: str) -> None:
        self.variants.append(Variant(name=name, precision=precision, device=device, file=None, kept=False, reason=reason))


def _run_each(engine: Engine, feeds: list[dict[str, np.ndarray]]) -> None:
    for f in feeds:
        engine.run(f)


def convert(cfg: ConvertConfig, steps: Steps = _no_steps) -> Manifest:
    """Run a whole conversion. Raises a KilnError subclass with a one-line message on failure."""
    device = cfg.device
    if cfg.engine not in (ONNX_ENGINE, TORCH_ENGINE):
        raise ConversionError(f"unknown engine {cfg.engine!r} (choose from {ONNX_ENGINE}, {TORCH_ENGINE})")
    if device not in ("cpu", "cuda"):
        raise ConversionError(f"unknown device {device!r} (choose from cpu, cuda)")
    if device == "cuda" and cfg.engine == TORCH_ENGINE and not torch_cuda_available():
        raise ConversionError("--device cuda: torch sees no CUDA device here")
    if device == "cuda" and cfg.engine == ONNX_ENGINE and not cuda_available():
        raise ConversionError("--device cuda: onnxruntime has no CUDAExecutionProvider here (install onnxruntime-gpu)")
    wanted = list(cfg.precisions or default_precisions(cfg.task, device, cfg.engine))
    known = TORCH_PRECISIONS if cfg.engine == TORCH_ENGINE else PRECISIONS + generation.PRECISIONS
    unknown = [p for p in wanted if p not in known]
    if unknown:
        raise ConversionError(f"unknown precision {unknown} for --engine {cfg.engine} (choose from {', '.join(known)})")
    if cfg.kv_cache not in generation.KV_CACHE_TYPES:
        raise ConversionError(f"unknown KV cache type {cfg.kv_cache!r} (choose from {', '.join(generation.KV_CACHE_TYPES)})")
    if cfg.task not in ("auto", generation.TASK):
        task_class(cfg.task)  # fail fast on a typo, before loading anything
    check_output(Path(cfg.out), cfg.force)

    with steps("Loading model and tokenizer"):
        source = src.load_source(cfg.model)
        task_name = src.detect_task(source) if cfg.task == "auto" else cfg.task
    if task_name == generation.TASK:  # a causal LM: a decoder with a KV cache, not a tasks/ Task
        return generation.convert_generation(cfg, source, steps)
    encoder_precisions = TORCH_PRECISIONS if cfg.engine == TORCH_ENGINE else PRECISIONS
    unknown = [p for p in wanted if p not in encoder_precisions]
    if unknown:
        raise ConversionError(f"unknown precision {unknown} (choose from {', '.join(encoder_precisions)}, or all)")
    with steps("Loading the PyTorch model"):
        src.check_task_fits(source, task_name)
        model = src.load_torch_model(source, task_name)
        names = src.input_names(source, model)
    info = task_class(task_name).info
    tok = source.tokenizer
    manifest = Manifest(
        name=cfg.name or Path(cfg.out).name,
        task=task_name,
        input_names=names,
        output_names=list(info.output_names),
        max_length=src.max_length(source),
        tokenizer=TokenizerSpec(pad_token=str(tok.pad_token), pad_token_id=int(tok.pad_token_id or 0),
                                truncation=info.truncation),
        variants=[],
        labels=src.labels_of(source, task_name),
        problem_type=getattr(source.config, "problem_type", None),
        pooling=src.read_pooling(source) if info.pooled else None,
        source={"model": cfg.model, "model_type": source.model_type, "architecture": source.architecture,
                "max_positions": src.max_positions(source)},
        versions=versions(),
        machine=cpu_description(),
        opset=OPSET if cfg.engine == ONNX_ENGINE else None,
    )
    task = make_task(manifest)
    texts = list(cfg.calibration_texts) if cfg.calibration_texts else default_texts(task_name)

    with atomic_folder(Path(cfg.out), cfg.force) as folder:
        tok.backend_tokenizer.save(str(folder / manifest.tokenizer.file))
        source.config.to_json_file(str(folder / "config.json"))
        encoder = TextEncoder(Tokenizer.from_file(str(folder / manifest.tokenizer.file)), manifest.tokenizer,
                              names, manifest.max_length)
        prepared = task.prepare(texts)
        check_tokenizer_parity(source, encoder, prepared, info.truncation)

        module = TaskModule(model, names, info.output_names)
        fp32_path = folder / "model.onnx"
        if cfg.engine == ONNX_ENGINE:
            with steps("Exporting to ONNX (fp32)"):
                sample_feeds, _ = encoder.encode(prepared[:2])
                export_onnx(module, sample_feeds, names, info.output_names, info.per_token, fp32_path,
                            cfg.external_data_threshold)
        with steps(f"Running the PyTorch reference on {len(prepared)} texts"):
            from ..runtime.torch_engine import TorchEngine

            reference = run_reference(TorchEngine(module, names, info.output_names, cfg.threads), encoder, task, prepared)

        b = _Builder(cfg, folder, manifest, task, encoder, reference, source.config, steps)
        if cfg.engine == TORCH_ENGINE:
            _build_torch_variants(b, wanted, model, device)
        else:
            _build_variants(b, wanted, fp32_path, device)

        # OpenVINO's variants run model.onnx itself: a file goes only when no kept variant reads it
        kept_files = {v.file for v in b.variants if v.kept}
        for v in b.variants:
            if v.file and v.file not in kept_files:
                remove_variant_file(folder / v.file)
        if not any(v.kept for v in b.variants):
            summary = "; ".join(f"{v.name}: {v.reason}" for v in b.variants)
            raise ValidationFailedError(f"no variant passed validation ({summary})")
        for v in b.variants:
            if not v.kept:
                v.file = None
        manifest.variants = b.variants
        manifest.save(folder)
    return manifest


def _build_variants(b: _Builder, wanted: list[str], fp32_path: Path, device: str) -> None:
    with b.steps("Validating fp32"):
        fp32 = b.check("fp32", "fp32", device, fp32_path)
    fp32.kept = fp32.kept and "fp32" in wanted
    if "fp32" not in wanted:
        fp32.reason = fp32.reason or "not requested (built as the base of the others)"
    b.variants.append(fp32)

    # The fused graph is also a base for int8 and fp16, so build it whenever they are wanted, even
    # if the fp32 fused variant itself is not kept.
    base_path = fp32_path
    if {"optimized", "int8", "fp16"} & set(wanted):
        opt_path = b.folder / "model.optimized.onnx"
        with b.steps("Applying ONNX Runtime transformer fusions"):
            try:
                fused = build.optimize(fp32_path, opt_path, b.config)
            except Exception as exc:  # the optimizer fails in many ways on graphs it does not know
                b.skip("optimized", "fp32", device, f"fusions failed: {str(exc).splitlines()[0]}")
                fused = None
        if fused is not None:
            with b.steps("Validating optimized"):
                opt = b.check("optimized", "fp32", device, opt_path, fused_ops=fused)
            if opt.validation and opt.validation.passed:
                base_path = opt_path
            if "optimized" not in wanted:
                opt.kept = False
                opt.reason = opt.reason or "not requested (built as the base of int8/fp16)"
            b.variants.append(opt)

    if "int8" in wanted:
        _build_int8(b, fp32_path, base_path)
    if "fp16" in wanted:
        if device != "cuda":
            b.skip("fp16", "fp16", "cuda", "needs a CUDA device (onnxruntime CUDAExecutionProvider); fp16 is slow on CPU")
        else:
            path = b.folder / "model.fp16.onnx"
            with b.steps("Building and validating fp16"):
                build.to_fp16(base_path, path)
                b.variants.append(b.check("fp16", "fp16", "cuda", path))
    if "tensorrt" in wanted:
        _build_tensorrt(b, device)
    for name in OPENVINO_PRECISIONS:
        if name in wanted:
            _build_openvino(b, name, fp32_path, device)

    validated = [v for v in b.variants if v.file and v.validation and v.validation.passed and v.device == device]
    with b.steps(f"Timing {len(validated)} variants at batch 1 (interleaved)"):
        b.time_all(validated)
    # Fusions are kept only where they are measured faster on this device.
    kept_fused = next((v for v in b.variants if v.name == "optimized" and v.kept), None)
    if (kept_fused and fp32.latency_ms is not None and kept_fused.latency_ms is not None
            and kept_fused.latency_ms >= fp32.latency_ms):
        kept_fused.kept = False
        kept_fused.reason = (f"not faster than fp32 on {device} "
                             f"({kept_fused.latency_ms:.3f} ms vs {fp32.latency_ms:.3f} ms)")


def _build_torch_variants(b: _Builder, wanted: list[str], model: object, device: str) -> None:
    """The weights for the torch engine in each wanted precision, validated and timed on ``device``
    like any variant; a half-precision one is kept only where it is faster than torch-fp32."""
    for precision in wanted:
        name, path = torch_variant_name(precision), b.folder / weights_file(precision)
        with b.steps(f"Writing and validating {name} (the torch engine, {device})"):
            save_weights(model, path, precision)
            b.variants.append(b.check(name, precision, device, path, engine=TORCH))
    validated = [v for v in b.variants if v.file and v.validation and v.validation.passed]
    with b.steps(f"Timing {len(validated)} variants at batch 1 (interleaved)"):
        b.time_all(validated)
    base = next((v for v in validated if v.precision == "fp32"), None)
    for v in validated:
        if base is not None and v is not base and v.latency_ms is not None and base.latency_ms is not None \
                and v.latency_ms >= base.latency_ms:
            v.kept = False
            v.reason = f"not faster than {base.name} on {device} ({v.latency_ms:.3f} ms vs {base.latency_ms:.3f} ms)"


def _build_int8(b: _Builder, fp32_path: Path, fused_path: Path) -> None:
    """Per-row int8 (convert/row_int8.py), first from the unfused fp32 graph so that Attention's Q, K
    and V projections are quantized too (the faster one); if that fails validation, from the fused
    graph, whose Attention keeps its QKV weights in float (closer to PyTorch). ONNX Runtime's dynamic
    int8 is not built: its one activation scale per batch tensor makes answers depend on batch
    neighbours (benchmarks/encoders/batch_invariance.py)."""
    path = b.folder / "model.int8.onnx"
    tried = []
    for base in dict.fromkeys([fp32_path, fused_path]):  # the fused graph may be the fp32 one
        with b.steps(f"Quantizing {base.name} to int8 (per-row activation scales) and validating"):
            count = build.quantize_int8_per_row(base, path)
            variant = b.check("int8", "int8", "cpu", path, method=INT8_METHOD, quantized_matmuls=count, base=base.name)
        if variant.kept:
            break
        tried.append(f"from {base.name}: {variant.reason}")
    if tried and variant.kept:
        variant.details["refused_bases"] = tried
    b.variants.append(variant)


def _build_openvino(b: _Builder, name: str, fp32_path: Path, device: str) -> None:
    """OpenVINO's CPU plugin at ``name``'s precision, gated like any variant against its precision's
    tolerance: fp32 and bf16 on the exported model.onnx (no file of their own), int8 on NNCF's IR."""
    precision = OPENVINO_PRECISIONS[name]
    if device != "cpu":
        b.skip(name, precision, "cpu", "OpenVINO variants run on the CPU (--device cpu)")
    elif not has_extra("openvino"):
        b.skip(name, precision, "cpu", f"openvino is not installed: {install_hint('openvino')}")
    elif precision == "bf16" and native_bf16(cpu_flags()) is None:
        b.skip(name, precision, "cpu", "needs a CPU that computes bf16 natively (AMX or AVX-512 BF16); "
                                       "this one would emulate it, slower than fp32")
    elif precision == "int8" and not has_extra("nncf"):
        b.skip(name, precision, "cpu", f"nncf (OpenVINO's quantizer) is not installed: {install_hint('nncf')}")
    elif precision == "int8":
        inputs = calibration_inputs(type(b.task), b.reference.inputs if b.cfg.calibration_texts else None)
        path = b.folder / "model.openvino-int8.xml"
        with b.steps(f"Quantizing {fp32_path.name} for OpenVINO (NNCF int8, {len(inputs)} calibration inputs) "
                     "and validating"):
            try:
                build.quantize_openvino_int8(fp32_path, path, [b.encoder.encode([x])[0] for x in inputs])
            except Exception as exc:  # NNCF fails in many ways on graphs it does not know
                remove_variant_file(path)
                b.skip(name, precision, "cpu", f"NNCF failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
                return
            source = "--calibration-texts" if b.cfg.calibration_texts else "SQuAD questions and contexts (the package's)"
            b.variants.append(b.check(name, precision, "cpu", path, engine=OPENVINO, method=OPENVINO_INT8_METHOD,
                                      calibration=f"{len(inputs)} inputs: {source}"))
    else:
        with b.steps(f"Validating {name} (OpenVINO on {fp32_path.name})"):
            b.variants.append(b.check(name, precision, "cpu", fp32_path, engine=OPENVINO))


def calibration_inputs(task: type[Task], given: list[TextInput] | None) -> list[TextInput]:
    """What NNCF measures activation ranges on: the user's --calibration-texts (``given``, which the
    gate checks too), else real text the package ships that the gate does not use: the first question
    of each SQuAD context, in the task's form (``Task.calibration_inputs``), up to CALIBRATION_SIZE."""
    if given:
        return given
    _, questions = read_squad()
    first: dict[str, str] = {}
    for q in questions:
        first.setdefault(q.context, q.question)
    return task.calibration_inputs([(question, context) for context, question in first.items()])[:CALIBRATION_SIZE]


def _build_tensorrt(b: _Builder, device: str) -> None:
    trt = build.tensorrt_version()
    if trt is None:
        b.skip("tensorrt", "fp16", "cuda", "tensorrt is not installed")
    elif device != "cuda":
        b.skip("tensorrt", "fp16", "cuda", "needs --device cuda and a GPU")
    else:  # pragma: no cover - needs a GPU with TensorRT
        b.skip("tensorrt", "fp16", "cuda", f"tensorrt {trt} found; engine building is not implemented yet")
