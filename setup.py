"""The native parts (src/modelkiln/native/): onnxruntime operators over GGUF K-quant blocks, and the
sampler's exact arithmetic. Everything else is declared in pyproject.toml. Both libraries are
optional: where one does not build (no gcc, not x86-64) the package installs without it; GGUF
weights then go into MatMulNBits, and the sampler computes the same values in numpy."""
import platform

from setuptools import Extension, setup

X86 = platform.machine().lower() in ("x86_64", "amd64")
ext_modules = [
    Extension(
        "modelkiln.native._gguf_ops",
        ["src/modelkiln/native/gguf_ops.c", "src/modelkiln/native/gguf_k456.c", "src/modelkiln/native/gguf_k_low.c", "src/modelkiln/native/gguf_q32.c",
         "src/modelkiln/native/gguf_amx.c", "src/modelkiln/native/gguf_k_amx.c",
         "src/modelkiln/native/attention.c", "src/modelkiln/native/norm.c"],
        depends=["src/modelkiln/native/ort_abi.h", "src/modelkiln/native/gguf_q32.h", "src/modelkiln/native/gguf_q32_blocks.h", "src/modelkiln/native/gguf_amx_tiles.h",
                 "src/modelkiln/native/gguf_tiles.h", "src/modelkiln/native/gguf_k.h",
                 "src/modelkiln/native/attention_kernel.h", "src/modelkiln/native/attention_caches.h"],
        # AVX2/FMA/F16C: every CPU the kernels are used on (checked again before loading);
        # no FMA contraction, so the gather rounds as gguf-py's numpy operations do, and attention's
        # AVX2 and AVX-512 forms round alike (their FMAs are written out)
        extra_compile_args=["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fvisibility=hidden"],
        optional=True,
    )
] if X86 else []
# The sampler's exact arithmetic (numpy's order of float64 sums, Philox draws): plain C for any CPU,
# every + and * rounded as numpy rounds it (no contraction into FMA, no fast-math); beside it the
# bounded draw, whose own exponentials need not round as numpy's (sampling_bounded.c says why).
ext_modules.append(Extension(
    "modelkiln.native._sampling",
    ["src/modelkiln/native/sampling.c", "src/modelkiln/native/sampling_bounded.c"],
    depends=["src/modelkiln/native/sampling.h"],
    extra_compile_args=["-O3", "-ffp-contract=off", "-fno-fast-math", "-fvisibility=hidden"],
    optional=True,
))

setup(ext_modules=ext_modules)
