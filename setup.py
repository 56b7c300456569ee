"""The one native part: onnxruntime operators over GGUF K-quant blocks (src/modelkiln/native/).
Everything else is declared in pyproject.toml. The library is optional: where it does not build
(no gcc, not x86-64) the package installs without it, and GGUF weights go into MatMulNBits."""
import platform

from setuptools import Extension, setup

X86 = platform.machine().lower() in ("x86_64", "amd64")
ext_modules = [
    Extension(
        "modelkiln.native._gguf_ops",
        ["src/modelkiln/native/gguf_ops.c"],
        depends=["src/modelkiln/native/ort_abi.h"],
        # AVX2/FMA/F16C: every CPU the kernels are used on (checked again before loading);
        # no FMA contraction, so the gather rounds as gguf-py's numpy operations do
        extra_compile_args=["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fvisibility=hidden"],
        optional=True,
    )
] if X86 else []

setup(ext_modules=ext_modules)
