"""Which engine runs an encoder variant: a registry keyed by the variant's ``engine`` (kiln.json;
``onnx`` when absent), with the capability flags the server sizes its batches by, as
text-embeddings-inference picks a backend and asks it ``is_padded``. ``onnx``: an ONNX Runtime
session (runtime/onnx.py); ``torch``: the torch engine (runtime/torch_encoder.py); ``openvino``:
OpenVINO's CPU plugin on the exported ONNX (runtime/openvino.py). The last two are imported only
when asked, so serving ONNX variants needs neither torch nor openvino."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import ArtifactError
from ..manifest import Manifest, Variant
from .engine import Engine

ONNX, TORCH, OPENVINO = "onnx", "torch", "openvino"
# On a CPU a padded token costs as much as a real one: a batch pads at most 15% of its real tokens
# (docs/design.md, "Batching on CPU avoids padding"); on a GPU batching gains far more than padding costs.
CPU_MAX_PADDING = 0.15
GPU_MAX_PADDING = 1.0
TORCH_GPU_MAX_BATCH = 256  # the torch engine's largest CUDA-graph bucket


@dataclass(frozen=True)
class EncoderCapabilities:
    """What the server may count on. ``padding_cheap``: a padded token costs little next to a real
    one; ``max_batch``: inputs per run at most (None: any); ``own_threads``: each instance has its
    own thread pool (onnxruntime sessions), so instances run side by side (torch's pool is the
    process's: one instance takes every thread)."""

    device: str
    padding_cheap: bool
    max_batch: int | None
    own_threads: bool

    @property
    def max_padding(self) -> float:
        """The padding a batch may carry by default, per real token."""
        return GPU_MAX_PADDING if self.padding_cheap else CPU_MAX_PADDING


def _open_onnx(folder: Path, manifest: Manifest, variant: Variant, threads: int | None, memory_arena: bool,
               keep_hidden: bool) -> Engine:
    from .onnx import OnnxEngine

    assert variant.file is not None
    return OnnxEngine(folder / variant.file, device=variant.device, threads=threads, label=variant.name,
                      memory_arena=memory_arena)


def _open_torch(folder: Path, manifest: Manifest, variant: Variant, threads: int | None, memory_arena: bool,
                keep_hidden: bool) -> Engine:
    from .torch_encoder import TorchEncoderEngine  # noqa: PLC0415 - torch only for this engine

    assert variant.file is not None
    return TorchEncoderEngine(folder, manifest, folder / variant.file, device=variant.device, threads=threads,
                              label=variant.name, keep_hidden=keep_hidden)


def _open_openvino(folder: Path, manifest: Manifest, variant: Variant, threads: int | None, memory_arena: bool,
                   keep_hidden: bool) -> Engine:
    from .openvino import OpenVinoEngine  # noqa: PLC0415 - openvino only for this engine

    assert variant.file is not None
    return OpenVinoEngine(folder / variant.file, variant.precision, threads=threads, label=variant.name,
                          pad_id=manifest.tokenizer.pad_token_id, max_length=manifest.max_length)


ENCODER_ENGINES: dict[str, Callable[..., Engine]] = {ONNX: _open_onnx, TORCH: _open_torch, OPENVINO: _open_openvino}

# What `kiln bench` calls each engine's rows ("onnxruntime int8", "openvino openvino-bf16").
BACKEND_LABELS = {ONNX: "onnxruntime", TORCH: "torch", OPENVINO: "openvino"}


def engine_kind(variant: Variant) -> str:
    kind = variant.engine or ONNX
    if kind not in ENCODER_ENGINES:
        raise ArtifactError(f"unknown engine '{kind}' for variant {variant.name} in kiln.json "
                            f"(known: {', '.join(ENCODER_ENGINES)})")
    return kind


def capabilities(variant: Variant) -> EncoderCapabilities:
    """A variant's engine's flags, known before it is loaded."""
    gpu = variant.device != "cpu"
    if engine_kind(variant) == TORCH:
        return EncoderCapabilities(variant.device, padding_cheap=gpu, max_batch=TORCH_GPU_MAX_BATCH if gpu else None,
                                   own_threads=False)
    # onnxruntime sessions and OpenVINO compiled models each have their own threads
    return EncoderCapabilities(variant.device, padding_cheap=gpu, max_batch=None, own_threads=True)


def open_encoder(folder: Path | str, manifest: Manifest, variant: Variant, threads: int | None = None,
                 memory_arena: bool = True, keep_hidden: bool = False) -> Engine:
    """The engine of ``variant`` on its file. ``keep_hidden``: an engine that pools on its device
    returns the hidden states too (the gate compares them)."""
    if variant.file is None:
        raise ArtifactError(f"variant {variant.name} has no file (it was not kept)")
    return ENCODER_ENGINES[engine_kind(variant)](Path(folder), manifest, variant, threads, memory_arena, keep_hidden)
