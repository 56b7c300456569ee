"""Native onnxruntime operators over a GGUF file's blocks (``gguf_ops.c``, ``gguf_k_low.c``, ``gguf_q32.c``, on AMX
``gguf_amx.c``), and kiln's attention (``attention.c``).

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
import importlib.machinery
from functools import lru_cache
from pathlib import Path

from ..errors import ArtifactError

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


def _cpu_supported() -> bool:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return all(flag in flags for flag in _CPU_FLAGS)


def amx_on() -> bool:
    """Whether GgufMatMul runs rows on AMX's tiles in this process (``KILN_AMX=1`` where the CPU has
    AMX-INT8 and the kernels' check passed, set when a session registers the operators: gguf_amx.c)."""
    path = library_path()
    return bool(path and ctypes.CDLL(path).kiln_gguf_amx_on())


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
