"""Write the Triton model repository for an artifact, atomically (temp folder, then rename):

    OUT/
      README.md                 how to launch it + the version record
      <name>/config.pbtxt       ensemble: texts in, answers out
      <name>_tokenize/          python: texts → model inputs
      <name>_model/             onnxruntime_onnx | tensorrt_plan | python (kiln's engine for the variant inside)
      <name>_postprocess/       python: model outputs → answers

Each python model's version folder holds model.py, the artifact files it needs (kiln.json,
tokenizer.json, the variant's files) and a snapshot of the modelkiln modules it imports
(``snapshot.py``). An OpenVINO variant runs in the python backend only: Triton's onnxruntime backend
would run model.onnx in onnxruntime's fp32, not the variant."""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

from ..atomic import atomic_folder  # the same atomic write `kiln convert` uses
from ..errors import ArtifactError, ErrorKind, KilnError
from ..manifest import Manifest, Variant, variant_files
from ..runtime.registry import ONNX, OPENVINO, engine_kind
from ..tasks.text_generation import is_generation
from . import config as cfg
from .config import ModelConfig, Options, TensorSpec
from .generation import write_generation_repository
from .snapshot import ENCODER_FILES, MODELS_DIR, copy_snapshot

_ONNX_TYPES = {
    "tensor(int64)": "TYPE_INT64",
    "tensor(int32)": "TYPE_INT32",
    "tensor(float)": "TYPE_FP32",
    "tensor(float16)": "TYPE_FP16",
}

class TritonOptionError(KilnError):
    kind = ErrorKind.INVALID_INPUT


@dataclass(frozen=True)
class ModelIO:
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]


def model_name(manifest: Manifest) -> str:
    """Triton model names: letters, digits, '-' and '_' are safe everywhere (paths, URLs)."""
    return re.sub(r"[^A-Za-z0-9_-]+", "_", manifest.name).strip("_") or "model"


def onnx_io(path: Path) -> ModelIO:
    """Input/output names, types and dims (batch axis dropped) as the ONNX file declares them."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])

    def specs(args: list) -> list[TensorSpec]:
        out = []
        for a in args:
            if a.type not in _ONNX_TYPES:
                raise ArtifactError(f"{path.name}: tensor '{a.name}' has type {a.type}, which Triton configs here do not map")
            dims = tuple(d if isinstance(d, int) and d > 0 else -1 for d in a.shape[1:])
            out.append(TensorSpec(a.name, _ONNX_TYPES[a.type], dims))
        return out

    return ModelIO(specs(session.get_inputs()), specs(session.get_outputs()))


_OPENVINO_TYPES = {"i64": "TYPE_INT64", "i32": "TYPE_INT32", "f32": "TYPE_FP32", "f16": "TYPE_FP16"}


def openvino_io(path: Path) -> ModelIO:
    """The same for a file OpenVINO reads (an IR such as NNCF's int8, or an ONNX file)."""
    import openvino

    model = openvino.Core().read_model(str(path))

    def specs(ports: list) -> list[TensorSpec]:
        out = []
        for port in ports:
            kind = port.get_element_type().get_type_name()
            if kind not in _OPENVINO_TYPES:
                raise ArtifactError(f"{path.name}: tensor '{port.get_any_name()}' has type {kind}, which Triton configs "
                                    "here do not map")
            dims = tuple(d.get_length() if d.is_static else -1 for d in port.get_partial_shape())[1:]
            out.append(TensorSpec(port.get_any_name(), _OPENVINO_TYPES[kind], dims))
        return out

    return ModelIO(specs(model.inputs), specs(model.outputs))


def check_options(opts: Options) -> None:
    if opts.model_backend not in cfg.MODEL_BACKENDS:
        raise TritonOptionError(f"--model-backend must be one of {', '.join(cfg.MODEL_BACKENDS)}, got '{opts.model_backend}'")
    if opts.kind not in cfg.KINDS:
        raise TritonOptionError(f"--kind must be cpu or gpu, got '{opts.kind}'")
    if opts.max_batch_size < 1:
        raise TritonOptionError("--max-batch-size must be at least 1 (Triton batching needs max_batch_size > 0)")
    if opts.instances < 1:
        raise TritonOptionError("--instances must be at least 1")
    if opts.max_queue_delay_us < 0 or opts.threads < 0:
        raise TritonOptionError("--max-queue-delay-us and --threads cannot be negative")
    if opts.model_backend == "tensorrt" and opts.kind != "gpu":
        raise TritonOptionError("--model-backend tensorrt runs on GPUs only: add --kind gpu")


def choose_variant(manifest: Manifest, opts: Options, name: str | None) -> Variant:
    """The named variant, else the fastest the chosen Triton backend runs as kiln does: ONNX
    variants in every backend, OpenVINO's in the python backend only."""
    if name:
        chosen = manifest.variant(name)
        if engine_kind(chosen) == OPENVINO and opts.model_backend != "python":
            raise TritonOptionError(f"variant '{name}' runs on OpenVINO, which Triton runs in the python backend: "
                                    "add --model-backend python")
        return chosen
    if opts.model_backend != "python":
        kept = [v for v in manifest.kept_variants() if engine_kind(v) == ONNX]
        manifest = replace(manifest, variants=kept)
    if opts.kind == "gpu":
        cuda = [v for v in manifest.kept_variants() if v.device == "cuda" and v.file and v.file.endswith(".onnx")]
        if cuda:
            return manifest.fastest_variant("cuda")
        # int8 (dynamic quantization) is a CPU format; on a GPU the fp32 graph is the safe choice.
        for fallback in ("optimized", "fp32"):
            if any(v.name == fallback for v in manifest.kept_variants()):
                return manifest.variant(fallback)
    return manifest.fastest_variant("cpu")


def write_repository(artifact: Path | str, out: Path | str, opts: Options, variant: str | None = None,
                     force: bool = False) -> Path:
    from . import readme

    artifact, out = Path(artifact), Path(out)
    check_options(opts)
    manifest = Manifest.load(artifact)
    if is_generation(manifest):
        if opts.model_backend != "python" and opts.model_backend != "onnxruntime":
            raise TritonOptionError("text generation runs in the python backend (modelkiln's engine): "
                                    "--model-backend tensorrt does not apply")
        return write_generation_repository(artifact, out, opts, model_name(manifest), variant, force)
    chosen = choose_variant(manifest, opts, variant)
    if not chosen.file:
        raise ArtifactError(f"variant '{chosen.name}' has no file")
    io = openvino_io(artifact / chosen.file) if engine_kind(chosen) == OPENVINO else onnx_io(artifact / chosen.file)
    missing = [n for n in manifest.input_names if n not in {t.name for t in io.inputs}]
    if missing:
        raise ArtifactError(f"{chosen.file} lacks the inputs {missing} that kiln.json lists")
    engine_version = None
    if opts.model_backend == "tensorrt":
        from . import tensorrt

        engine_version = tensorrt.require()  # a one-line error here, before anything is written

    name = model_name(manifest)
    manifest.name = name  # the generated models read their own names from the copied kiln.json
    tokenize = cfg.tokenize_config(manifest, opts, io.inputs)
    model = cfg.model_config(manifest, opts, io.inputs, io.outputs)
    if opts.model_backend == "python":
        model.parameters["variant"] = chosen.name  # which of kiln.json's variants encoder_model.py runs
    post = cfg.postprocess_config(manifest, opts, io.outputs)
    ensemble = cfg.ensemble_config(manifest, opts, tokenize, model, post)

    with atomic_folder(out, force) as tmp:
        _python_model(tmp, tokenize, "tokenize_model.py", artifact, manifest)
        _python_model(tmp, post, "postprocess_model.py", artifact, manifest)
        version_dir = _model_folder(tmp, model)
        if opts.model_backend == "python":
            _python_model(tmp, model, "encoder_model.py", artifact, manifest)
            for path in variant_files(artifact, chosen.file):  # under their own names: kiln.json names them
                shutil.copy2(path, version_dir / path.name)
        elif opts.model_backend == "tensorrt":
            from . import tensorrt

            tensorrt.build_plan(artifact / chosen.file, version_dir / "model.plan", manifest, opts)
        else:  # the graph under Triton's default name, its weights under the name the graph gives them
            graph, *weights = variant_files(artifact, chosen.file)
            shutil.copy2(graph, version_dir / "model.onnx")
            for path in weights:
                shutil.copy2(path, version_dir / path.name)
        _model_folder(tmp, ensemble)
        (tmp / "README.md").write_text(readme.render(manifest, chosen, opts, [tokenize, model, post, ensemble], engine_version))
    return out


def _model_folder(root: Path, config: ModelConfig) -> Path:
    folder = root / config.name
    (folder / "1").mkdir(parents=True, exist_ok=True)  # ensembles need an (empty) version folder too
    (folder / "config.pbtxt").write_text(config.to_pbtxt())
    return folder / "1"


def _python_model(root: Path, config: ModelConfig, template: str, artifact: Path, manifest: Manifest) -> None:
    version_dir = _model_folder(root, config)
    shutil.copy2(MODELS_DIR / template, version_dir / "model.py")
    manifest.save(version_dir)
    shutil.copy2(artifact / manifest.tokenizer.file, version_dir / manifest.tokenizer.file)
    copy_snapshot(version_dir / "modelkiln", ENCODER_FILES)
