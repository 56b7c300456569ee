"""Where a text-generation conversion gets its weights, its graphs and its reference.

- ``GgufSource``: a GGUF file of the serving graph's architectures (llama, mistral, qwen2), read
  by tensor name (``gguf/decoder.py``) and never held whole in fp32: the packed variant ``gguf``
  is the file's own blocks; fp32 is written a tensor at a time; the reference runs layer by layer.
- ``TransformersSource``: anything else (a Hugging Face folder or hub id, or a GGUF file of
  another architecture): transformers loads the model in fp32; the serving graph is written from
  it, or torch exports it; the reference is the whole model; a GGUF's packed variant is found by
  value in the export (``gguf/export_packing.py``).

Each says, before any graph is written, whether the variants asked for fit this machine's
memory, and refuses in one line with what they need and what there is."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from ...errors import ConversionError, ModelLoadError, ModelTooLargeError, UnsupportedArchitectureError
from .. import source as src
from .decoder_export import DECODER_OPSET, export_decoder
from .reference import LayerReference, Reference, WholeModelReference
from .serving_graph import SERVING_GRAPH_OPSET, SUPPORTED_MODEL_TYPES, DecoderSpec, GraphSummary, TorchDecoderWeights, build_serving_graph

log = logging.getLogger(__name__)

FP32_VARIANTS = ("fp32", "int8", "int4")  # built from an fp32 graph
EXPORT_MEMORY_FACTOR = 3  # fp32 variants hold the weights ~3 times (PyTorch's or the graph's, a session's, a quantizer's)
# The packed variant's conversion peaks while the gate's session runs: onnxruntime's packed
# copy of the weights (Q5_0 and Q6_K take 8 bits, a scale per 16 or 32 weights), the scales it
# keeps mapped, the logits of one prompt. Measured peak RSS (shared AMD EPYC, Q4_K_M files):
# Qwen2.5-0.5B 2.28 GB for 0.40 GB, Llama-3.2-1B 3.05 GB for 0.80 GB, Llama-3.1-8B 10.4 GB for 4.9 GB.
GGUF_MEMORY_FACTOR = 2.0
GGUF_MEMORY_CONSTANT_GB = 1.5


def memory_gb() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9


def check_fp32_memory(ref: str, params: int, wanted: list[str], max_model_gb: float | None, packed_gb: float | None) -> None:
    """fp32 and the variants quantized from it hold the fp32 weights in memory: refuse them, in one
    line, when they are larger than ``--max-model-gb`` (default: a third of the machine's memory)."""
    asked = [p for p in wanted if p in FP32_VARIANTS]
    if not asked:
        return
    size_gb = params * 4 / 1e9
    limit = max_model_gb if max_model_gb is not None else memory_gb() / EXPORT_MEMORY_FACTOR
    if size_gb > limit:
        hint = f"; the GGUF's own blocks need ~{packed_gb:.1f} GB: --precision gguf" if packed_gb is not None else ""
        raise ModelTooLargeError(
            f"{ref}: {', '.join(asked)} need the {params / 1e6:.0f}M parameters in fp32, {size_gb:.2f} GB held "
            f"~{EXPORT_MEMORY_FACTOR}× ({size_gb * EXPORT_MEMORY_FACTOR:.1f} GB); the limit is {limit:.2f} GB of fp32 "
            f"weights (--max-model-gb; this machine has {memory_gb():.1f} GB){hint}")


class GgufSource:
    """A GGUF file of the serving graph's architectures, read by tensor name."""

    graph = {"kind": "serving", "opset": SERVING_GRAPH_OPSET}

    def __init__(self, source: src.SourceModel, path: Path):
        from ..gguf.decoder import GgufDecoder

        self.source, self.path = source, path
        self.decoder = GgufDecoder(path, source.config)
        self.config = source.config

    @staticmethod
    def covers(source: src.SourceModel) -> bool:
        return source.gguf_path is not None and source.model_type in SUPPORTED_MODEL_TYPES

    @property
    def generation_config(self) -> Any:
        from transformers import GenerationConfig

        return GenerationConfig.from_model_config(self.config)

    def packed_memory_gb(self) -> float:
        return GGUF_MEMORY_FACTOR * self.decoder.file_bytes / 1e9 + GGUF_MEMORY_CONSTANT_GB

    def check_memory(self, wanted: list[str], max_model_gb: float | None) -> None:
        if "gguf" in wanted and self.packed_memory_gb() > memory_gb():
            raise ModelTooLargeError(
                f"{self.source.ref}: converting this {self.decoder.file_bytes / 1e9:.1f} GB GGUF needs ~"
                f"{self.packed_memory_gb():.1f} GB of memory ({GGUF_MEMORY_FACTOR}× the file + "
                f"{GGUF_MEMORY_CONSTANT_GB:g} GB); this machine has {memory_gb():.1f} GB")
        check_fp32_memory(self.source.ref, self.decoder.parameters, wanted, max_model_gb, self.packed_memory_gb())

    def write_fp32(self, path: Path) -> GraphSummary:
        try:
            return build_serving_graph(self.decoder, path)
        finally:
            self.decoder.release_pages()

    def write_packed(self, path: Path, fp32_path: Path | None, accuracy_level: int, native: bool = False,
                     kv_halves: bool = False) -> dict[str, Any]:
        try:
            # kiln's native attention comes with its native matmuls: a graph that needs the library for
            # one needs it for the other, and older artifacts keep GroupQueryAttention
            return build_serving_graph(self.decoder, path, pack=True, accuracy_level=accuracy_level, native=native,
                                       kiln_attention=native, kv_halves=kv_halves).gguf_types
        finally:
            self.decoder.release_pages()

    def unpackable_notes(self) -> list[str]:
        return [f"{kind}: {n} tensors dequantized to fp32 (no exact MatMulNBits form)"
                for kind, n in sorted(self.decoder.unpackable_types().items())]

    def reference(self) -> Reference:
        return LayerReference(self.decoder)


class TransformersSource:
    """Any other source: the model loaded by transformers in fp32."""

    def __init__(self, source: src.SourceModel, wanted: list[str], max_model_gb: float | None, steps: Any,
                 torch_engine: bool = False):
        self.source = source
        params = count_parameters(source)
        check_fp32_memory(source.ref, params, [*wanted, "fp32"], max_model_gb, None)  # fp32 is always the base here
        with steps("Loading the PyTorch weights (fp32)"):
            self.model = load_causal_lm(source)
        self.config = self.model.config
        self.generation_config = getattr(self.model, "generation_config", None)
        self.graph: dict[str, Any]
        if torch_engine:  # the weights for the torch engine: a family its forward covers, or a typed error
            from ...generation.engines.torch.decoder import DecoderConfig

            DecoderConfig.of(self.config)
            self.graph = {"kind": "torch", "opset": None}
            return
        try:
            DecoderSpec.of(self.model)
            self.graph = {"kind": "serving", "opset": SERVING_GRAPH_OPSET}
        except UnsupportedArchitectureError as exc:  # covered by the torch export instead: say why
            self.graph = {"kind": "export", "opset": DECODER_OPSET, "why": str(exc)}
            log.info("decoder graph: the torch export (%s)", exc)

    def write_fp32(self, path: Path) -> GraphSummary | None:
        if self.graph["kind"] == "serving":
            return build_serving_graph(TorchDecoderWeights(self.model), path)
        export_decoder(self.model, path)
        return None

    def write_packed(self, path: Path, fp32_path: Path | None, accuracy_level: int, native: bool = False,
                     kv_halves: bool = False) -> dict[str, Any]:
        """``native`` and ``kv_halves`` are for the serving graph only: an exported graph's weights go
        into MatMulNBits, and its cache is the export's."""
        from ..gguf.export_packing import pack_gguf_blocks

        if self.source.gguf_path is None:
            raise ConversionError(f"{self.source.ref} is not a GGUF file: the gguf variant packs a GGUF file's own blocks")
        assert fp32_path is not None
        return pack_gguf_blocks(fp32_path, path, self.source.gguf_path, accuracy_level)

    def unpackable_notes(self) -> list[str]:
        return []

    def reference(self) -> Reference:
        return WholeModelReference(self.model)


def count_parameters(source: src.SourceModel) -> int:
    """Parameters counted on the meta device (no weights read)."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return sum(p.numel() for p in AutoModelForCausalLM.from_config(source.config).parameters())
    except ValueError as exc:
        raise UnsupportedArchitectureError(f"{source.ref}: {source.model_type} is not a causal LM transformers "
                                           f"can build: {str(exc).splitlines()[0]}") from exc


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


def open_source(source: src.SourceModel, wanted: list[str], max_model_gb: float | None, steps: Any,
                torch_engine: bool = False) -> GgufSource | TransformersSource:
    """The source for ``source``, its memory checked for ``wanted`` before any graph is written
    (the torch engine's variants are the transformers model's weights, whatever the file)."""
    if torch_engine:
        return TransformersSource(source, wanted, max_model_gb, steps, torch_engine=True)
    if GgufSource.covers(source):
        assert source.gguf_path is not None
        try:
            gguf = GgufSource(source, source.gguf_path)
        except UnsupportedArchitectureError as exc:  # e.g. a head size GroupQueryAttention cannot take
            log.info("GGUF by tensor name: %s; loading it with transformers", exc)
        else:
            gguf.check_memory(wanted, max_model_gb)
            return gguf
    if "gguf" in wanted and source.gguf_path is None:
        raise ConversionError(f"{source.ref} is not a GGUF file: the gguf variant packs a GGUF file's own blocks")
    return TransformersSource(source, wanted, max_model_gb, steps)
