"""Native onnxruntime operators over a GGUF file's blocks (``gguf_ops.c``; kernels ``gguf_k456.c``, ``gguf_k_low.c``,
``gguf_q32.c``, on AMX ``gguf_k_amx.c`` and ``gguf_amx.c``), and kiln's attention (``attention.c``).

``GgufMatMul`` multiplies by Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K and Q6_K weights stored as the
file stores them (Q4_K 4.5 and Q6_K 6.56 bits a weight, where MatMulNBits needs 6 and 10 for the same values
exactly; Q5_0 5.5 against 9; Q3_K 3.4 against 6); ``GgufGather``
dequantizes embedding rows bit for bit as gguf-py does; ``KilnAttention`` attends packed tokens of
any number of sequences over a KV cache, each position reduced as a decode step reduces it
(``KilnAttentionF16`` over a cache of halves). The library is built at install time
(setup.py) and registered with every onnxruntime session (``runtime/onnx.session_options``); a
graph holds these operators only when the library was there when it was converted."""

from __future__ import annotations

import ctypes
import errno
import importlib.machinery
import logging
import signal
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

from ..errors import ArtifactError
from ..machine import cpu_flags, matrix_engine

log = logging.getLogger(__name__)

DOMAIN = "kiln.gguf"
# the GGUF types these operators read (ggml's type numbers)
GGML_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13,
              "Q6_K": 14}
# How GgufMatMul's weights are laid out, recorded in a variant's details ("native_ops"): 2 is tiles
# of 16 rows (convert/gguf/tiles.py); graphs of the first layout (the file's rows, recorded as
# ``true``) cannot run on these kernels.
LAYOUT = 2
_CPU_FLAGS = ("avx2", "fma", "f16c")  # what the library is compiled for


@lru_cache(maxsize=1)
def library_path() -> str | None:
    """The built library, or None where it was not built or this CPU cannot run it."""
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / f"_gguf_ops{suffix}"
        if path.exists() and _cpu_supported():
            return str(path)
    return None


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The library loaded once; the cache holds it for the life of the process. onnxruntime unloads a
    custom-operator library with the last session options that registered it, and loaded again it would
    have forgotten what registering found (AMX on or refused: ``amx_on``, ``amx_refusal``), which
    ``kiln convert`` reads after its sessions end: ``runtime/onnx.register_native_ops`` loads it here first."""
    path = library_path()
    return ctypes.CDLL(path) if path else None


def _cpu_supported() -> bool:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return all(flag in flags for flag in _CPU_FLAGS)


def amx_on() -> bool:
    """Whether GgufMatMul runs rows on AMX's tiles in this process (``KILN_AMX=1`` where the CPU has
    AMX-INT8 and the kernels' check passed, set when a session registers the operators: gguf_ops.c's kiln_gguf_use_amx)."""
    lib = library()
    return bool(lib and lib.kiln_gguf_amx_on())


# Why ``KILN_AMX=1`` left AMX off (gguf_amx_tiles.h's amx_state, from the third on)
AMX_REFUSALS = {
    3: "this kiln was compiled without AMX's instructions (GCC older than 11 or clang older than 12)",
    4: "this CPU has no AMX-INT8",
    5: "Linux did not grant this process the tile state (arch_prctl ARCH_REQ_XCOMP_PERM: {errno})",
    6: "the AMX kernels' check products differed from the AVX-512 kernels' bits",
    7: "the AMX kernels' check products crashed the child process they ran in ({signal})",
}
_ERRNO_MEANING = {  # what arch_prctl(ARCH_REQ_XCOMP_PERM)'s errors mean (the kernel's fpu/xstate.c)
    errno.ENOSPC: "a thread's signal stack (sigaltstack) is too small for the tile state",
    errno.EOPNOTSUPP: "the kernel does not offer the tile state to processes",
    errno.EINVAL: "the kernel does not know the request (Linux before 5.16)",
}


def amx_refusal() -> str | None:
    """Why ``KILN_AMX=1`` did not turn AMX on in this process, or None (on, or not asked). Set when a
    session registers the operators (gguf_ops.c's RegisterCustomOps runs the checks, in a child process
    first: a fault on the unit is a refusal, with the signal that ended the child)."""
    lib = library()
    if not lib:
        return None
    reason = AMX_REFUSALS.get(lib.kiln_gguf_amx_state())
    detail = lib.kiln_gguf_amx_detail()
    if reason and "{signal}" in reason:
        try:
            reason = reason.format(signal=signal.Signals(detail).name)
        except ValueError:
            reason = reason.format(signal=f"signal {detail}")
    elif reason and "{errno}" in reason:
        name = errno.errorcode.get(detail, f"errno {detail}")
        reason = reason.format(errno=f"{name}, {_ERRNO_MEANING[detail]}" if detail in _ERRNO_MEANING else name)
    return reason


def variant_amx_refusal(details: Mapping[str, Any]) -> str | None:
    """Why ``KILN_AMX=1`` left AMX off for a variant, where it runs on these operators (encoders never do:
    their refusal is not theirs to say), else None. Ask after a session of it exists."""
    return amx_refusal() if "native_ops" in details else None


def log_amx_refusal(details: Mapping[str, Any]) -> None:
    """Says once a process why ``KILN_AMX=1`` left AMX off, for a variant on these operators (a session
    of it exists: registering the operators ran the check)."""
    refusal = variant_amx_refusal(details)
    if refusal and refusal not in _refusals_said:
        _refusals_said.add(refusal)
        log.warning("KILN_AMX=1 asked for AMX, refused: %s; kiln's GGUF operators run on their AVX-512 or AVX2 "
                    "kernels (the same bits)", refusal)


_refusals_said: set[str] = set()


def variant_matrix_engine(details: Mapping[str, Any], precision: str, device: str) -> str:
    """The unit a text-generation variant's matrix products run on in this process (``kiln convert``'s
    table, ``kiln bench``'s rows, ``kiln serve``'s log): int8 dot products where its activations are
    quantized to int8 (these operators; MatMulNBits at accuracy level 4), else the unit of its float
    precision (``machine.matrix_engine``); these operators with AMX on run eight rows and more on its
    tiles. Ask after a session of the variant exists: AMX is turned on, or refused, when one registers
    the operators."""
    native = "native_ops" in details
    int8 = native or details.get("accuracy_level") == 4
    unit = matrix_engine("int8" if int8 else precision, device, cpu_flags())
    return f"AMX (8+ rows), {unit}" if native and device == "cpu" and amx_on() else unit


def check_layout(details: dict, variant: str) -> None:
    """Refuses a variant whose GGUF weights were written for another layout of these operators."""
    stored = details.get("native_ops")
    if stored is not None and stored != LAYOUT:  # true, the first layout, is not 2 either
        raise ArtifactError(f"variant '{variant}' holds GGUF blocks in a layout this kiln's native operators no "
                            f"longer read (written by an older kiln): convert the model again")


@lru_cache(maxsize=1)
def sampling_library() -> ctypes.CDLL | None:
    """The sampler's exact arithmetic (``sampling.c``: plain C, any CPU) and its bounded draw
    (``sampling_bounded.c``), or None where they were not
    built; the sampler then computes the same values in numpy, more slowly."""
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / f"_sampling{suffix}"
        if path.exists():
            try:
                library = ctypes.CDLL(str(path))
            except OSError:
                return None
            return _declare_sampling(library)
    return None


def _declare_sampling(library: ctypes.CDLL) -> ctypes.CDLL:
    u64, i64, f64 = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_double)
    library.kiln_uniforms.argtypes = [u64, u64, ctypes.c_int64, f64]
    library.kiln_uniforms.restype = None
    library.kiln_sparse_sum.argtypes = [i64, f64, ctypes.c_int64, ctypes.c_int64]
    library.kiln_sparse_sum.restype = ctypes.c_double
    library.kiln_cumulative_pick.argtypes = [f64, ctypes.c_int64, ctypes.c_double, f64]
    library.kiln_cumulative_pick.restype = ctypes.c_int64
    library.kiln_top_k.argtypes = [f64, ctypes.c_int64, ctypes.c_int64, f64, i64]
    library.kiln_top_k.restype = ctypes.c_int64
    library.kiln_top_p.argtypes = [f64, ctypes.c_int64, ctypes.c_double, ctypes.POINTER(ctypes.c_uint8), u64]
    library.kiln_top_p.restype = ctypes.c_int64
    library.kiln_pick.argtypes = [i64, f64, ctypes.c_int64, ctypes.c_int64, ctypes.c_double, ctypes.c_double,
                                  ctypes.c_double, f64, ctypes.c_double, i64, f64, u64, ctypes.POINTER(ctypes.c_uint8)]
    library.kiln_pick.restype = ctypes.c_int64
    library.kiln_scale.argtypes = [ctypes.POINTER(ctypes.c_float), ctypes.c_int64, ctypes.c_double, ctypes.c_double, f64]
    library.kiln_scale.restype = None
    library.kiln_bounded_draw.argtypes = [ctypes.POINTER(ctypes.c_float), ctypes.c_int64, ctypes.c_double,
                                          ctypes.c_int64, ctypes.c_double, ctypes.c_double, ctypes.c_double, f64, f64,
                                          i64, f64, ctypes.POINTER(ctypes.c_uint8), u64]
    library.kiln_bounded_draw.restype = ctypes.c_int64
    library.kiln_bounded_draws.argtypes = [u64, ctypes.c_int64, ctypes.c_int64, f64, i64, f64, f64, f64, i64, f64, f64,
                                           i64, f64, ctypes.POINTER(ctypes.c_uint8), u64]
    library.kiln_bounded_draws.restype = None
    library.kiln_bounded_exp.argtypes = [f64, ctypes.c_int64, f64]
    library.kiln_bounded_exp.restype = None
    library.kiln_bounded_exp32.argtypes = [ctypes.POINTER(ctypes.c_float), ctypes.c_int64, ctypes.POINTER(ctypes.c_float)]
    library.kiln_bounded_exp32.restype = None
    return library
