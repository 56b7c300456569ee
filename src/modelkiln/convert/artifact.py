"""What both conversions (encoders: ``pipeline.py``; text generation: ``generation.py``) decide
and write alike: the variants built when ``--precision`` is not given, the package versions a
manifest records, and how a variant that is not kept leaves the artifact folder."""

from __future__ import annotations

import contextlib
from importlib import metadata
from pathlib import Path

from ..extras import has_extra
from ..machine import cpu_flags, native_bf16
from ..manifest import variant_files
from ..tasks import text_generation


ONNX_ENGINE, TORCH_ENGINE = "onnx", "torch"  # kiln convert --engine
# OpenVINO's variants of an encoder (runtime/openvino.py, on the exported model.onnx) → their precision
OPENVINO_PRECISIONS = {"openvino-fp32": "fp32", "openvino-bf16": "bf16", "openvino-int8": "int8"}


def openvino_offered(installed: bool, flags: set[str], quantizer: bool = False) -> tuple[str, ...]:
    """OpenVINO's variants worth building on a CPU with these flags: none without the package;
    bf16 only where the CPU multiplies bf16 natively (AMX or AVX-512 BF16: ``machine.native_bf16``),
    since elsewhere OpenVINO emulates it in fp32, slower than fp32 itself; int8 where NNCF, its
    quantizer (the ``nncf`` extra, needed to convert only), is installed too."""
    if not installed:
        return ()
    bf16 = ("openvino-bf16",) if native_bf16(flags) else ()
    int8 = ("openvino-int8",) if quantizer else ()
    return ("openvino-fp32", *bf16, *int8)


def default_precisions(task: str, device: str, engine: str = ONNX_ENGINE, gguf: bool = False) -> tuple[str, ...]:
    """Every variant that fits the device: a text-generation model gets the low-bit decoders
    (``int4`` = MatMulNBits), or from a GGUF file its own blocks only (``gguf``: exactly the file's
    weights, and no fp32 copy of the model needed); an encoder the fused graph, on the CPU OpenVINO's
    variants where it is installed (``openvino_offered``), and on CUDA TensorRT; the torch engine
    fp32, and bf16 too on CUDA (where it is fast: on the CPU it is slower than fp32)."""
    if engine == TORCH_ENGINE:
        return ("fp32",) if device == "cpu" else ("fp32", "bf16")
    if task == text_generation.NAME and gguf:
        return ("gguf",)
    if task == text_generation.NAME:
        return ("fp32", "int8", "int4") if device == "cpu" else ("fp32", "int8", "int4", "fp16")
    if device == "cpu":
        return ("fp32", "optimized", "int8") + openvino_offered(has_extra("openvino"), cpu_flags(), has_extra("nncf"))
    return ("fp32", "optimized", "fp16", "tensorrt")


def versions() -> dict[str, str]:
    """The versions of the packages a conversion's result depends on (``kiln.json``'s record)."""
    found = {}
    for pkg in ("modelkiln", "torch", "transformers", "onnx", "onnxruntime", "openvino", "tokenizers"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            found[pkg] = metadata.version(pkg)
    return found


def remove_variant_file(path: Path) -> None:
    """A variant's file (ONNX, OpenVINO IR or safetensors) and the weights beside it (``variant_files``)."""
    for file in variant_files(path.parent, path.name):
        file.unlink(missing_ok=True)
