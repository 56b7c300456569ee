"""The modelkiln code a generated Triton repository carries: each python model's version folder
gets its ``model.py`` (from ``models/``) and a snapshot of the modelkiln modules it imports,
copied from the installed package at generation time, so the repository runs the exact code that
generated it. Triton's python backend can be assumed to have numpy and tokenizers only, plus
onnxruntime (and jinja2 for generation) where a model runs a graph itself."""

from __future__ import annotations

import shutil
from pathlib import Path

MODELS_DIR = Path(__file__).parent / "models"
_GENERATION = Path(__file__).parent.parent / "generation"

# The package, its errors and manifest, and the tasks (what every model here imports, with what
# those import).
_TASKS = (
    "__init__.py", "errors.py", "manifest.py", "samples.py",
    "tasks/__init__.py", "tasks/base.py", "tasks/classification.py", "tasks/embeddings.py",
    "tasks/question_answering.py", "tasks/token_classification.py", "tasks/tensors.py",
)

# kiln's native libraries: the onnxruntime operators over GGUF K-quant blocks, which runtime/onnx.py
# registers with every session, and the sampler's exact arithmetic; the finder (with machine.py, which
# names the unit a variant runs on) and, where they were built, the libraries themselves.
_NATIVE = ("native/__init__.py", "machine.py", *sorted(f"native/{p.name}" for p in (Path(__file__).parent.parent / "native").glob("_*")
                                         if p.suffix in (".so", ".pyd")))

# The encoder models (tokenize, postprocess, the python-backend model); the engines (the registry,
# onnxruntime's and OpenVINO's, cpus.py for OpenVINO's threads) are loaded by the python-backend
# model only, and each imports its runtime when asked.
ENCODER_FILES = (
    *_TASKS, "runtime/__init__.py", "runtime/engine.py", "runtime/onnx.py", "runtime/openvino.py",
    "runtime/registry.py", "runtime/tokenizer.py", "cpus.py", *_NATIVE, "triton/__init__.py", "triton/batching.py",
)

# The generation model: the generation package (the engines, the engine core,
# sampling, text), tasks/text_generation.py (which tells a generation artifact) and cpus.py (the
# engine's threads when none are given).
GENERATION_FILES = (
    *_TASKS, "tasks/text_generation.py", "runtime/__init__.py", "runtime/onnx.py", *_NATIVE, "cpus.py",
    *sorted(f"generation/{p.relative_to(_GENERATION).as_posix()}" for p in _GENERATION.rglob("*.py")),
)


def copy_snapshot(dest: Path, files: tuple[str, ...]) -> None:
    """``files`` (paths inside the modelkiln package) copied under ``dest``."""
    import modelkiln

    package = Path(modelkiln.__file__).parent
    for rel in files:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(package / rel, dest / rel)
