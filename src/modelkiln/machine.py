"""The CPU a command runs on: its model name and the vector extensions that decide how fast the
kernels of ONNX Runtime, PyTorch and llama.cpp run on it. The same command gives different figures on
an AVX2-only AMD EPYC and on an AVX-512/AMX Intel Xeon, so `kiln bench` prints this description in
its table header and `kiln convert` records it in the manifest. Read from ``/proc/cpuinfo`` (Linux);
elsewhere the model comes from ``platform`` and the extensions are left empty."""

from __future__ import annotations

import contextlib
import platform
from collections.abc import Mapping
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
    ("BF16", ("avx512_bf16",)),  # AVX-512 BF16: bf16 dot products (OpenVINO's bf16 uses them where there is no AMX)
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
    """e.g. "AVX2 FMA AVX-512 VNNI BF16 AMX" (an Intel Xeon with AMX), "AVX2 FMA AVX-512 VNNI BF16" (an AMD
    EPYC Zen 4/5) or "AVX2 FMA" (an AMD EPYC without AVX-512)."""
    return " ".join(name for name, any_of in VECTOR_EXTENSIONS if flags.intersection(any_of))


def native_bf16(flags: set[str]) -> str | None:
    """The unit that multiplies bf16 matrices natively on this CPU: "AMX" (Sapphire Rapids and later
    Xeons: ``amx_bf16``), "AVX-512 BF16" (Zen 4/5 EPYCs, Cooper Lake: ``avx512_bf16``), or None,
    where bf16 is only emulated in fp32 (slower than fp32 itself, so no bf16 variant is offered)."""
    if "amx_bf16" in flags:
        return "AMX"
    if "avx512_bf16" in flags:
        return "AVX-512 BF16"
    return None


def matrix_engine(precision: str, device: str, flags: set[str], engine: str = "onnx") -> str:
    """The unit a variant's matrix products run on here, named in `kiln bench`'s rows and `kiln
    convert`'s table: bf16 on AMX or AVX-512 BF16 (``native_bf16``); int8 on AMX's tiles where
    OpenVINO runs it (``engine`` "openvino": its int8 kernels use AMX-INT8), else on VNNI's int8 dot
    products (kiln's per-row int8 in onnxruntime is not AMX: onnxruntime's AMX kernel takes uint8
    activations, kiln's are int8); fp32 (and the rest) on the widest vector unit."""
    if device != "cpu":
        return "GPU"
    if precision == "bf16":
        return native_bf16(flags) or "emulated (no bf16 unit)"
    if precision == "int8" and engine == "openvino" and "amx_int8" in flags:
        return "AMX"
    if precision == "int8" and flags.intersection(("avx512_vnni", "avx_vnni")):
        return "VNNI"
    if "avx512f" in flags:
        return "AVX-512"
    if "avx2" in flags:
        return "AVX2"
    return "NEON" if "asimd" in flags else "scalar"


def cpu_description() -> dict[str, Any]:
    """The one description of this machine's CPU that bench headers and manifests carry; ``cores``
    is what this process may use (``cpus.available_cpus``: a pinned or quota-limited process runs
    on fewer cores than the host has, and its figures are those of its share)."""
    return {"cpu": cpu_model(), "isa": vector_extensions(cpu_flags()), "cores": available_cpus().count}


def timed_elsewhere(recorded: Mapping[str, Any], here: Mapping[str, Any]) -> str | None:
    """The CPU an artifact's variants were timed on (its manifest's ``machine``), where it is not ``here``
    (``cpu_description()``: another model or other vector extensions, and which variant is fastest may
    differ); else None."""
    if not recorded or (recorded.get("cpu"), recorded.get("isa")) == (here["cpu"], here["isa"]):
        return None
    return f"{recorded.get('cpu')} ({recorded.get('isa')})"
