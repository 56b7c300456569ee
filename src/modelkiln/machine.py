"""The CPU a command runs on: its model name and the vector extensions that decide how fast the
kernels of ONNX Runtime, PyTorch and llama.cpp run on it. The same command gives different figures on
an AVX2-only AMD EPYC and on an AVX-512/AMX Intel Xeon, so `kiln bench` prints this description in
its table header and `kiln convert` records it in the manifest. Read from ``/proc/cpuinfo`` (Linux);
elsewhere the model comes from ``platform`` and the extensions are left empty."""

from __future__ import annotations

import contextlib
import platform
from pathlib import Path
from typing import Any

from .cpus import available_cpus

CPUINFO = Path("/proc/cpuinfo")

# (name shown, any of these /proc/cpuinfo flags), in the order a reader compares machines by.
VECTOR_EXTENSIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("AVX2", ("avx2",)),
    ("FMA", ("fma",)),
    ("AVX-512", ("avx512f",)),
    ("VNNI", ("avx512_vnni", "avx_vnni")),  # int8 dot products (onnxruntime's int8 kernels use them)
    ("AMX", ("amx_tile",)),
    ("NEON", ("asimd",)),  # aarch64
    ("SVE", ("sve",)),
)


def _cpuinfo_field(names: tuple[str, ...]) -> str | None:
    """The first value of any of ``names`` in /proc/cpuinfo (its first processor's block)."""
    with contextlib.suppress(OSError):
        for line in CPUINFO.read_text().splitlines():
            key, sep, value = line.partition(":")
            if sep and key.strip() in names:
                return value.strip()
    return None


def cpu_flags() -> set[str]:
    """The CPU's feature flags (x86 ``flags``, aarch64 ``Features``); empty where they cannot be read."""
    return set((_cpuinfo_field(("flags", "Features")) or "").split())


def cpu_model() -> str:
    return _cpuinfo_field(("model name",)) or platform.processor() or platform.machine() or "unknown CPU"


def vector_extensions(flags: set[str]) -> str:
    """e.g. "AVX2 FMA AVX-512 VNNI AMX" (an Intel Xeon with AMX) or "AVX2 FMA" (an AMD EPYC without VNNI)."""
    return " ".join(name for name, any_of in VECTOR_EXTENSIONS if flags.intersection(any_of))


def cpu_description() -> dict[str, Any]:
    """The one description of this machine's CPU that bench headers and manifests carry; ``cores``
    is what this process may use (``cpus.available_cpus``: a pinned or quota-limited process runs
    on fewer cores than the host has, and its figures are those of its share)."""
    return {"cpu": cpu_model(), "isa": vector_extensions(cpu_flags()), "cores": available_cpus().count}
