"""``config.pbtxt`` for the four models, built from small dataclasses and rendered as protobuf
text format (Triton's ``ModelConfig`` message; the tests parse it with Triton's own schema)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..generation.speculation import DEFAULT_DRAFT_TOKENS
from ..manifest import Manifest
from ..tasks.tensors import TensorSpec as OipSpec
from ..tasks import make_task

MODEL_BACKENDS = ("onnxruntime", "tensorrt", "python")
KINDS = ("cpu", "gpu")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    data_type: str  # Triton's DataType enum name: TYPE_INT64, TYPE_FP32, TYPE_STRING...
    dims: tuple[int, ...]  # without the batch axis (max_batch_size > 0); -1 = variable
    optional: bool = False
    ragged: bool = False  # allow_ragged_batch: the batcher may join requests of different widths


@dataclass(frozen=True)
class Step:
    """One ensemble step: ``input_map``/``output_map`` are model tensor → ensemble tensor."""

    model_name: str
    input_map: dict[str, str]
    output_map: dict[str, str]


@dataclass
class ModelConfig:
    name: str
    max_batch_size: int
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    platform: str | None = None  # "onnxruntime_onnx", "tensorrt_plan", "ensemble"
    backend: str | None = None  # "python"
    default_model_filename: str | None = None
    preferred_batch_sizes: list[int] | None = None  # None: no dynamic batching
    max_queue_delay_us: int = 0
    instances: int | None = None  # None: no instance_group (ensembles have none)
    kind: str = "cpu"
    parameters: dict[str, str] = field(default_factory=dict)
    steps: list[Step] = field(default_factory=list)
    decoupled: bool = False  # any number of responses per request (streaming generation)

    def to_pbtxt(self) -> str:
        lines = [f'name: "{self.name}"']
        if self.platform:
            lines.append(f'platform: "{self.platform}"')
        if self.backend:
            lines.append(f'backend: "{self.backend}"')
        if self.default_model_filename:
            lines.append(f'default_model_filename: "{self.default_model_filename}"')
        lines.append(f"max_batch_size: {self.max_batch_size}")
        lines += _tensors("input", self.inputs) + _tensors("output", self.outputs)
        if self.preferred_batch_sizes is not None:
            lines += [
                "dynamic_batching {",
                f"  preferred_batch_size: [ {', '.join(map(str, self.preferred_batch_sizes))} ]",
                f"  max_queue_delay_microseconds: {self.max_queue_delay_us}",
                "}",
            ]
        if self.decoupled:
            lines.append("model_transaction_policy { decoupled: true }")
        if self.instances is not None:
            kind = "KIND_GPU" if self.kind == "gpu" else "KIND_CPU"
            lines.append(f"instance_group [ {{ count: {self.instances} kind: {kind} }} ]")
        for key, value in self.parameters.items():
            lines.append(f'parameters {{ key: "{key}" value {{ string_value: "{value}" }} }}')
        if self.steps:
            lines.append("ensemble_scheduling {\n  step [")
            blocks = []
            for step in self.steps:
                block = ["    {", f'      model_name: "{step.model_name}"', "      model_version: -1"]
                block += [f'      input_map {{ key: "{k}" value: "{v}" }}' for k, v in step.input_map.items()]
                block += [f'      output_map {{ key: "{k}" value: "{v}" }}' for k, v in step.output_map.items()]
                blocks.append("\n".join(block) + "\n    }")
            lines.append(",\n".join(blocks))
            lines.append("  ]\n}")
        return "\n".join(lines) + "\n"


def _tensors(kind: str, specs: Sequence[TensorSpec]) -> list[str]:
    if not specs:
        return []
    rendered = []
    for s in specs:
        flags = (" optional: true" if s.optional else "") + (" allow_ragged_batch: true" if s.ragged else "")
        rendered.append(f'  {{ name: "{s.name}" data_type: {s.data_type} dims: [ {", ".join(map(str, s.dims))} ]{flags} }}')
    return [f"{kind} ["] + [",\n".join(rendered)] + ["]"]


# --- the four models ---------------------------------------------------------------------------------
def _option(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class Options:
    """What ``kiln triton`` lets you choose: each field is one of its options (``--model-backend``...),
    with this default and help (triton/command.py derives the options from here)."""

    model_backend: str = _option("onnxruntime", "onnxruntime (platform onnxruntime_onnx) | tensorrt (tensorrt_plan; "
                                 "needs TensorRT here) | python (onnxruntime inside the python backend, for "
                                 "CPU-only Triton builds).")
    max_batch_size: int = _option(32, "Triton max_batch_size of every model (> 0).")
    max_queue_delay_us: int = _option(500, "Dynamic batching: longest wait for a fuller batch, in microseconds.")
    instances: int = _option(1, "Instances of each model (instance_group count).")
    kind: str = _option("cpu", "cpu or gpu: where the model instances run (KIND_CPU / KIND_GPU).")
    threads: int = _option(0, "onnxruntime intra-op threads per instance (0: onnxruntime's default).")
    speculate: str = _option("off", "Text generation: speculative decoding by prompt lookup, answers unchanged: "
                             "ngram or off (as kiln serve's --speculate; draft-model is kiln serve's and kiln "
                             "ray's only: its artifact does not travel in the repository).")
    draft_tokens: int = _option(DEFAULT_DRAFT_TOKENS, "Text generation with --speculate: the most tokens drafted a step.")


# OIP datatype → Triton's config DataType.
_TRITON_TYPES = {"BYTES": "TYPE_STRING", "FP32": "TYPE_FP32", "FP16": "TYPE_FP16", "INT64": "TYPE_INT64",
                 "INT32": "TYPE_INT32", "BOOL": "TYPE_BOOL"}


def _triton_spec(spec: OipSpec) -> TensorSpec:
    """A task's tensor spec (batch axis first) → a config tensor: batch axis dropped, and
    per-example values ([n]) given dims [1], as Triton's batching needs."""
    return TensorSpec(spec.name, _TRITON_TYPES[spec.datatype], tuple(spec.shape[1:]) or (1,), optional=spec.optional)


def text_inputs(manifest: Manifest) -> list[TensorSpec]:
    return [_triton_spec(s) for s in make_task(manifest).input_specs()]


def answer_outputs(manifest: Manifest, model_outputs: Sequence[TensorSpec]) -> list[TensorSpec]:
    """The task's answer tensors; ``model_outputs`` (the ONNX model's, batch axis dropped) give
    the sizes only the model knows."""
    shapes = {t.name: (-1, *t.dims) for t in model_outputs}
    return [_triton_spec(s) for s in make_task(manifest).output_specs(shapes)]


def preferred_sizes(max_batch_size: int) -> list[int]:
    """Half and full batch: lets the batcher send early under moderate load, full under heavy."""
    return sorted({max(1, max_batch_size // 2), max_batch_size})


def ragged(opts: Options) -> bool:
    """Only the python-backend model can take a batch of requests with different widths (it pads
    them itself, as `kiln serve` pads a batch to its longest text). The onnxruntime and TensorRT
    backends need equal shapes, so for them the tokenize model pads to power-of-two buckets."""
    return opts.model_backend == "python"


def tokenize_config(manifest: Manifest, opts: Options, model_inputs: Sequence[TensorSpec]) -> ModelConfig:
    # No dynamic batching: tokenizing is per request and cheap; batching happens at the model.
    return ModelConfig(f"{manifest.name}_tokenize", opts.max_batch_size, text_inputs(manifest), list(model_inputs),
                       backend="python", instances=opts.instances, kind="cpu",
                       parameters={"pad_to_buckets": "false" if ragged(opts) else "true"})


def model_config(manifest: Manifest, opts: Options, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]) -> ModelConfig:
    if ragged(opts):
        inputs = [replace(t, ragged=True) for t in inputs]
    cfg = ModelConfig(f"{manifest.name}_model", opts.max_batch_size, list(inputs), list(outputs),
                      preferred_batch_sizes=preferred_sizes(opts.max_batch_size), max_queue_delay_us=opts.max_queue_delay_us,
                      instances=opts.instances, kind=opts.kind)
    if opts.model_backend == "onnxruntime":
        cfg.platform, cfg.default_model_filename = "onnxruntime_onnx", "model.onnx"
    elif opts.model_backend == "tensorrt":
        cfg.platform, cfg.default_model_filename = "tensorrt_plan", "model.plan"
    else:
        cfg.backend = "python"
    if opts.threads and opts.model_backend != "tensorrt":
        # The onnxruntime backend's own parameter name; the python model reads the same key.
        cfg.parameters["intra_op_thread_count"] = str(opts.threads)
    return cfg


def postprocess_config(manifest: Manifest, opts: Options, model_outputs: Sequence[TensorSpec]) -> ModelConfig:
    return ModelConfig(f"{manifest.name}_postprocess", opts.max_batch_size, text_inputs(manifest) + list(model_outputs),
                       answer_outputs(manifest, model_outputs), backend="python", instances=opts.instances, kind="cpu")


def ensemble_config(manifest: Manifest, opts: Options, tokenize: ModelConfig, model: ModelConfig,
                    postprocess: ModelConfig) -> ModelConfig:
    texts = {t.name: t.name for t in text_inputs(manifest)}
    model_inputs = {t.name: t.name for t in model.inputs}
    model_outputs = {t.name: t.name for t in model.outputs}
    answers = {t.name: t.name for t in postprocess.outputs}
    steps = [
        Step(tokenize.name, texts, model_inputs),
        Step(model.name, model_inputs, model_outputs),
        Step(postprocess.name, {**texts, **model_outputs}, answers),
    ]
    return ModelConfig(manifest.name, opts.max_batch_size, text_inputs(manifest), list(postprocess.outputs),
                       platform="ensemble", steps=steps)
