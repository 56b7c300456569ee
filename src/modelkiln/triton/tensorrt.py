"""TensorRT plans for ``--model-backend tensorrt``. A plan only runs on the TensorRT version (and
GPU architecture) that built it, so it is built here only when ``tensorrt`` is importable, and
its version is recorded in the repository README next to the Triton releases that ship it."""

from __future__ import annotations

from pathlib import Path

from ..errors import ErrorKind, KilnError
from ..manifest import Manifest
from .config import Options


class TensorRTUnavailableError(KilnError):
    kind = ErrorKind.INVALID_INPUT


def require() -> str:
    """The importable TensorRT's version, or a one-line error saying what to do instead."""
    try:
        import tensorrt
    except ImportError:
        raise TensorRTUnavailableError(
            "--model-backend tensorrt needs the TensorRT Python package (`import tensorrt` failed): build the plan "
            "on a GPU machine with the TensorRT version of the target Triton release, or use --model-backend onnxruntime"
        ) from None
    return str(tensorrt.__version__)


def build_plan(onnx_path: Path, plan_path: Path, manifest: Manifest, opts: Options) -> None:  # pragma: no cover - needs a GPU
    """ONNX → serialized engine with one optimization profile: batch 1..max_batch_size, tokens
    1..max_length (the tokenize model pads to power-of-two buckets within that range)."""
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # TensorRT ≥ 10: explicit batch is the only mode
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise KilnError(f"TensorRT cannot parse {onnx_path.name}: {errors}")
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    mid = (max(1, opts.max_batch_size // 2), min(128, manifest.max_length))
    for i in range(network.num_inputs):
        name = network.get_input(i).name
        profile.set_shape(name, (1, 1), mid, (opts.max_batch_size, manifest.max_length))
    config.add_optimization_profile(profile)
    if builder.platform_has_fast_fp16:
        config.set_flag(trt.BuilderFlag.FP16)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise KilnError(f"TensorRT could not build an engine from {onnx_path.name}")
    plan_path.write_bytes(bytes(plan))
