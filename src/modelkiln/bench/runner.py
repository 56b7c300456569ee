"""``kiln bench``: time every backend over a grid of batch sizes × sequence lengths.

The artifact's own variants are timed in this process; the PyTorch reference rows each in a child
process (bench/isolation.py), so that one that crashes, hangs or is missing becomes a ``skipped:`` line
instead of the end of the command. Both run the same loop, ``measure_engine``."""

from __future__ import annotations

import contextlib
import platform
from importlib import metadata
from functools import partial
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ContextManager

import numpy as np
from tokenizers import Tokenizer

from ..cpus import available_cpus
from ..errors import KilnError
from ..machine import cpu_description, cpu_flags, matrix_engine
from ..manifest import Manifest
from ..runtime.engine import Engine, Runner
from ..runtime.onnx import cuda_available
from ..runtime.pipeline import load_variant
from ..runtime.registry import BACKEND_LABELS, TORCH, engine_kind
from .isolation import DEFAULT_TIMEOUT_S, ChildFailed, run_in_child
from ..timing import Stats, measure

Steps = Callable[[str], ContextManager[None]]


@dataclass
class BenchConfig:
    batches: list[int] = field(default_factory=lambda: [1, 8, 32])
    seqs: list[int] = field(default_factory=lambda: [16, 128, 384])
    threads: int | None = None
    variants: list[str] | None = None
    reference: bool = True
    warmup: int = 3
    min_iters: int = 10
    min_seconds: float = 1.0
    peer_timeout: float = DEFAULT_TIMEOUT_S  # seconds one PyTorch row may run


@dataclass
class Cell:
    backend: str  # "pytorch fp32", "onnxruntime int8", ...
    device: str
    batch: int
    seq: int
    stats: Stats
    speedup: float | None = None  # PyTorch fp32 median / this median, same batch and seq
    matrix_engine: str = ""  # the unit its matrix products ran on (machine.matrix_engine): "AMX", "VNNI"...

    @property
    def sequences_per_s(self) -> float:
        return self.batch / (self.stats.median / 1000.0)

    @property
    def tokens_per_s(self) -> float:
        return self.batch * self.seq / (self.stats.median / 1000.0)


@dataclass
class BenchResult:
    model: str
    task: str
    cells: list[Cell]
    skipped: list[str]  # "backend @ batch×seq: why"
    machine: dict[str, Any]
    config: BenchConfig


def machine_info(threads: int | None) -> dict[str, Any]:
    """The CPU (model, vector extensions, cores) and the runtime a bench ran with."""
    import onnxruntime

    info = {**cpu_description(), "threads": threads or available_cpus().count, "onnxruntime": onnxruntime.__version__,
            "python": platform.python_version()}
    with contextlib.suppress(metadata.PackageNotFoundError):  # the openvino extra
        info["openvino"] = metadata.version("openvino")
    return info


def machine_title(machine: dict[str, Any]) -> str:
    """The machine part of a bench table's title: "Intel(R) Xeon(R) … (AVX2 FMA AVX-512 VNNI BF16 AMX), 2 threads, …"."""
    isa = f" ({machine['isa']})" if machine.get("isa") else ""
    openvino = f", openvino {machine['openvino']}" if machine.get("openvino") else ""
    return f"{machine['cpu']}{isa}, {machine['threads']} threads, onnxruntime {machine['onnxruntime']}{openvino}"


def real_token_ids(folder: Path, manifest: Manifest, length: int) -> list[int]:
    """``length`` token ids of real text: SQuAD paragraphs (or the built-in samples if the shared
    data is absent), tokenized without truncation, ending with the model's closing special token."""
    from ..data import read_squad
    from ..samples import SAMPLE_TEXTS

    try:
        paragraphs, _ = read_squad()
    except KilnError:
        paragraphs = list(SAMPLE_TEXTS)
    tokenizer = Tokenizer.from_file(str(folder / manifest.tokenizer.file))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    ids: list[int] = []
    for paragraph in paragraphs:
        enc = tokenizer.encode(paragraph)
        ids = enc.ids if not ids else ids[:-1] + enc.ids[1:]  # join, keeping one opening/closing special
        if len(ids) >= length:
            break
    if len(ids) < length:
        raise KilnError(f"not enough text to build {length}-token inputs")
    return ids[: length - 1] + [ids[-1]]


def make_feeds(folder: Path, manifest: Manifest, batch: int, seq: int) -> dict[str, np.ndarray]:
    ids = np.array(real_token_ids(folder, manifest, seq), dtype=np.int64)
    feeds = {"input_ids": np.tile(ids, (batch, 1))}
    if "attention_mask" in manifest.input_names:
        feeds["attention_mask"] = np.ones((batch, seq), dtype=np.int64)
    if "token_type_ids" in manifest.input_names:
        feeds["token_type_ids"] = np.zeros((batch, seq), dtype=np.int64)
    return feeds


def _reference_rows(cfg: BenchConfig) -> Iterator[tuple[str, str, bool]]:
    """(label, device, half) of every PyTorch row to run (fp32 on the CPU, fp16 on CUDA)."""
    if cfg.reference:
        yield "pytorch fp32", "cpu", False
        if _torch_cuda():
            yield "pytorch fp16", "cuda", True


def _own_engines(folder: Path, manifest: Manifest, cfg: BenchConfig,
                 skipped: list[str]) -> Iterator[tuple[str, str, str, Callable[[], Engine]]]:
    """(backend label, device, matrix engine, engine factory) for every variant of the artifact to run."""
    flags = cpu_flags()
    for v in manifest.kept_variants():
        if cfg.variants and v.name not in cfg.variants:
            continue
        kind = engine_kind(v)
        label = BACKEND_LABELS[kind]
        if v.device == "cuda" and not (_torch_cuda() if kind == TORCH else cuda_available()):
            skipped.append(f"{label} {v.name}: no CUDA device")
            continue
        assert v.file is not None
        yield (f"{label} {v.name}", v.device, matrix_engine(v.precision, v.device, flags, kind),
               partial(load_variant, folder, manifest, v, cfg.threads))


def measure_engine(engine: Runner, label: str, feeds: dict[tuple[int, int], dict[str, np.ndarray]], cfg: BenchConfig,
                   steps: Steps = lambda d: contextlib.nullcontext()) -> dict[tuple[int, int], Stats]:
    """Every (batch, seq) cell of one engine."""
    stats = {}
    for (b, s), f in feeds.items():
        with steps(f"{label}: batch {b} × seq {s}"):
            stats[(b, s)] = measure(partial(engine.run, f), cfg.warmup, cfg.min_iters, cfg.min_seconds)
    return stats


def measure_reference(argument: dict[str, Any]) -> list[dict[str, Any]]:
    """One PyTorch row, in the child process the bench starts: the same feeds (rebuilt from the same
    text), the same loop; its cells as JSON."""
    from ..convert.reference import reference_engine

    folder, cfg = Path(argument["folder"]), BenchConfig(**argument["config"])
    manifest = Manifest.load(folder)
    engine = reference_engine(manifest, cfg.threads, device=argument["device"], half=argument["half"])
    feeds = {(b, s): make_feeds(folder, manifest, b, s) for b, s in argument["shapes"]}
    return [{"batch": b, "seq": s, "stats": asdict(stats)}
            for (b, s), stats in measure_engine(engine, argument["label"], feeds, cfg).items()]


def _run_reference(label: str, device: str, half: bool, folder: Path, shapes: list[tuple[int, int]], cfg: BenchConfig,
                   steps: Steps, skipped: list[str]) -> list[Cell]:
    argument = {"label": label, "device": device, "half": half, "folder": str(folder), "shapes": shapes,
                "config": asdict(cfg)}
    try:
        with steps(f"{label}: {len(shapes)} cells (in a child process)"):
            rows = run_in_child(measure_reference, argument, cfg.peer_timeout, log_name=label)
    except ChildFailed as exc:
        skipped.append(f"{label}: {exc}")
        return []
    return [Cell(label, device, r["batch"], r["seq"], Stats(**r["stats"])) for r in rows]


def _torch_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def run_bench(target: str, cfg: BenchConfig, steps: Steps) -> BenchResult:
    """``target``: an artifact folder (kiln bench turns a model into its cached artifact first: model_arg.py)."""
    if cfg.variants is not None and not cfg.variants:
        raise KilnError("--variants is empty")
    folder = Path(target)
    manifest = Manifest.load(folder)
    for name in cfg.variants or []:
        manifest.variant(name)  # an unknown name fails here, listing the kept ones
    max_positions = manifest.source.get("max_positions") or manifest.max_length
    skipped: list[str] = []
    cells: list[Cell] = []
    feeds = {(b, s): make_feeds(folder, manifest, b, s) for b in cfg.batches for s in cfg.seqs if s <= max_positions}
    skipped += [f"seq {s}: longer than the model's {max_positions} positions" for s in cfg.seqs if s > max_positions]
    flags = cpu_flags()
    for label, device, half in _reference_rows(cfg):
        for cell in _run_reference(label, device, half, folder, list(feeds), cfg, steps, skipped):
            cell.matrix_engine = matrix_engine("fp16" if half else "fp32", device, flags)
            cells.append(cell)
    for label, device, unit, factory in _own_engines(folder, manifest, cfg, skipped):
        with steps(f"Loading {label}"):
            engine = factory()
        cells += [Cell(label, device, b, s, stats, matrix_engine=unit)
                  for (b, s), stats in measure_engine(engine, label, feeds, cfg, steps).items()]
        del engine  # free it before the next backend loads
    baseline = {(c.batch, c.seq): c.stats.median for c in cells if c.backend == "pytorch fp32"}
    for c in cells:
        if (c.batch, c.seq) in baseline:
            c.speedup = baseline[(c.batch, c.seq)] / c.stats.median
    return BenchResult(manifest.name, manifest.task, cells, skipped, machine_info(cfg.threads), cfg)
