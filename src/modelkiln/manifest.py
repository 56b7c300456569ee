"""The artifact manifest (``kiln.json``): everything needed to run an artifact without torch or
transformers, and the record of how each variant was built, validated and timed."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import ArtifactError, VariantNotFoundError

MANIFEST_NAME = "kiln.json"
FORMAT_VERSION = 1


@dataclass
class Validation:
    """How a variant's outputs compare with the PyTorch reference on the validation texts."""

    max_abs_diff: float
    min_cosine: float  # lowest per-example cosine similarity of the task output
    mean_cosine: float
    agreement: float  # fraction of examples with the same label / span / entity tags
    texts: int
    passed: bool
    tolerance: dict[str, float] = field(default_factory=dict)
    # Batch invariance (convert/validate.py batch_invariance): each text alone vs in a padded batch.
    batch_min_cosine: float | None = None
    batch_agreement: float | None = None


# How much faster (a fraction of the ONNX variant's latency) a variant of another engine must measure to be
# an artifact's default over its fastest ONNX variant (Manifest.fastest_variant)
OTHER_ENGINE_MARGIN = 0.10


@dataclass
class Variant:
    name: str  # "fp32", "optimized", "int8", "fp16", "tensorrt"
    precision: str  # "fp32", "int8", "fp16"
    device: str  # "cpu" or "cuda"
    file: str | None  # relative to the artifact folder; None when not kept
    kept: bool
    reason: str = ""  # why it was not kept (or how it was built)
    validation: Validation | None = None
    latency_ms: float | None = None  # median, batch 1, on the build machine
    latency_shape: list[int] | None = None  # [batch, seq] the latency was measured at
    # mean per text, batch 1, the gate's texts one after another at their own lengths, as a server meets
    # them: an engine that pays for each change of input shape (OpenVINO) shows it here, not at one
    # fixed shape. What `kiln serve` picks its default by; None in artifacts written before it was measured.
    served_ms: float | None = None
    details: dict[str, Any] = field(default_factory=dict)
    # what runs it (generation/engines/registry.py's registry: onnx-serving, onnx-export, torch; runtime's for
    # encoders: onnx, torch, openvino); None in artifacts written before it was recorded (read from the file)
    engine: str | None = None


@dataclass
class Pooling:
    mode: str = "mean"  # "mean", "cls", "max"
    normalize: bool = True


@dataclass
class TokenizerSpec:
    file: str = "tokenizer.json"
    pad_token: str = "[PAD]"
    pad_token_id: int = 0
    truncation: str = "longest_first"  # tokenizers' strategy: longest_first | only_second


@dataclass
class Manifest:
    name: str
    task: str
    input_names: list[str]
    output_names: list[str]
    max_length: int
    tokenizer: TokenizerSpec
    variants: list[Variant]
    labels: list[str] | None = None
    problem_type: str | None = None  # classification: single_label / multi_label / regression
    pooling: Pooling | None = None
    # Text generation: eos_token_ids, chat_template, special_tokens, max_context, defaults (sampling
    # settings), layers / heads / kv_heads / head_dim, graph (serving or export, and why), and
    # default_variant (what runs when none is named). Read by generation/model.py.
    generation: dict[str, Any] | None = None
    source: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    # The CPU the variants were validated and timed on (machine.cpu_description: model, vector extensions,
    # cores): the latencies above mean little without it. Empty in artifacts written before it was recorded.
    machine: dict[str, Any] = field(default_factory=dict)
    opset: int | None = None
    format_version: int = FORMAT_VERSION

    # -- queries ---------------------------------------------------------------------------
    def kept_variants(self) -> list[Variant]:
        return [v for v in self.variants if v.kept]

    def variant(self, name: str) -> Variant:
        for v in self.kept_variants():
            if v.name == name:
                return v
        kept = ", ".join(v.name for v in self.kept_variants()) or "none"
        raise VariantNotFoundError(f"variant '{name}' is not in artifact '{self.name}' (kept: {kept})")

    def fastest_variant(self, device: str = "cpu") -> Variant:
        """The kept variant with the lowest measured latency on ``device``: on texts of mixed lengths
        (``served_ms``) where the conversion measured it, else at its one fixed shape. Another engine
        than onnxruntime's must be faster by OTHER_ENGINE_MARGIN to be chosen over an ONNX variant: a
        near tie is within the timing's noise (two conversions of all-MiniLM-L6-v2 measured OpenVINO's
        int8 at 1.48 vs 1.49 ms and 2.10 vs 1.73), and OpenVINO's server took 1.5x the memory."""
        candidates = [v for v in self.kept_variants() if v.device == device]
        if not candidates:
            raise VariantNotFoundError(f"artifact '{self.name}' has no variant for device '{device}'")
        mixed = all(v.served_ms is not None for v in candidates)

        def latency(v: Variant) -> float:
            measured = v.served_ms if mixed else v.latency_ms
            return measured if measured is not None else float("inf")

        fastest = min(candidates, key=latency)
        onnx = min((v for v in candidates if (v.engine or "onnx") == "onnx"), key=latency, default=None)
        if onnx is not None and latency(onnx) * (1 - OTHER_ENGINE_MARGIN) <= latency(fastest):
            return onnx  # itself where it is the fastest; else a near tie goes to onnxruntime
        return fastest

    # -- (de)serialisation -----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def save(self, folder: Path) -> Path:
        path = Path(folder) / MANIFEST_NAME
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        data = dict(data)
        if data.get("format_version") != FORMAT_VERSION:
            raise ArtifactError(
                f"manifest format {data.get('format_version')} is not supported (expected {FORMAT_VERSION})"
            )
        variants = []
        for v in data.pop("variants"):
            v = dict(v)
            val = v.pop("validation", None)
            variants.append(Variant(**v, validation=Validation(**val) if val else None))
        pooling = data.pop("pooling", None)
        return cls(
            **{k: v for k, v in data.items() if k != "tokenizer"},
            tokenizer=TokenizerSpec(**data["tokenizer"]),
            variants=variants,
            pooling=Pooling(**pooling) if pooling else None,
        )

    @classmethod
    def load(cls, folder: Path | str) -> Manifest:
        path = Path(folder) / MANIFEST_NAME
        if not Path(folder).exists():  # a mistyped path: say so, not that a manifest is missing
            raise ArtifactError(f"{folder}: no such file or folder")
        if not path.is_file():
            raise ArtifactError(f"{folder} is not a modelkiln artifact (no {MANIFEST_NAME})")
        try:
            data = json.loads(path.read_text())
            return cls.from_dict(data)
        except (json.JSONDecodeError, TypeError, KeyError) as exc:
            raise ArtifactError(f"{path} is corrupt: {exc}") from exc


def is_artifact(path: Path | str) -> bool:
    return (Path(path) / MANIFEST_NAME).is_file()


def weights_file(graph: Path) -> Path:
    """Where an ONNX graph's external weights are (``FILE.data`` beside it): what kiln convert writes,
    and the name the graph records for them."""
    return graph.parent / (graph.name + ".data")


def variant_files(folder: Path, file: str) -> list[Path]:
    """A variant's file and the weights beside it that exist: an ONNX file's external data
    (``FILE.data``), an OpenVINO IR's ``.bin``."""
    path = Path(folder) / file
    companions = [weights_file(path), path.with_suffix(".bin") if path.suffix == ".xml" else None]
    return [path, *(c for c in companions if c is not None and c.is_file())]
