"""Which Triton releases match the runtime a model was built with.

Triton releases are named YY.MM (container tag ``nvcr.io/nvidia/tritonserver:YY.MM-py3``) and
versioned 2.N (24.10 is 2.51, one minor version per month). The onnxruntime and TensorRT
versions inside each container are NVIDIA's published pairing (release notes / Frameworks
Support Matrix); only the rows marked below were checked against Triton's build.py here, so
check the support matrix before deploying and correct these tables when they are wrong."""

from __future__ import annotations

# release → onnxruntime in its onnxruntime backend. Checked: 23.12, 25.03 (server/build.py).
ONNXRUNTIME = {
    "23.12": "1.16.3", "24.01": "1.16.3", "24.04": "1.17.3", "24.05": "1.18.0", "24.07": "1.18.1",
    "24.09": "1.19.2", "24.10": "1.19.2", "24.12": "1.20.1", "25.01": "1.20.1", "25.03": "1.20.1",
}
# release → TensorRT. A plan loads only on the TensorRT version that built it.
TENSORRT = {
    "23.12": "8.6.1", "24.01": "8.6.1", "24.04": "8.6.3", "24.05": "10.0.1", "24.07": "10.2.0",
    "24.09": "10.4.0", "24.10": "10.5.0", "24.12": "10.7.0", "25.01": "10.8.0", "25.03": "10.9.0",
}
PYTRITON_RELEASE = "24.10"  # the tritonserver 2.51 bundled in nvidia-pytriton 0.7 (python backend only)


def server_version(release: str) -> str:
    """'24.10' → '2.51.0'."""
    year, month = (int(p) for p in release.split("."))
    return f"2.{51 + (year - 24) * 12 + (month - 10)}.0"


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def matching(table: dict[str, str], version: str) -> list[str]:
    """Releases whose runtime has the same major.minor version."""
    return [release for release, v in table.items() if _minor(v) == _minor(version)]


def onnxruntime_note(version: str, opset: int | None) -> str:
    found = matching(ONNXRUNTIME, version)
    if found:
        return f"onnxruntime {version}: matches Triton {', '.join(found)} (same onnxruntime minor version)."
    newest = max(ONNXRUNTIME, key=lambda r: tuple(int(p) for p in r.split(".")))
    return (
        f"onnxruntime {version}: NO known Triton release ships this onnxruntime version (newest in the table: "
        f"{newest} with {ONNXRUNTIME[newest]}). The model was validated only with {version}; an older onnxruntime "
        f"loads it if it supports opset {opset} and every operator in the graph (fused/quantized contrib ops may be "
        f"missing). Re-validate on the target release."
    )


def tensorrt_note(version: str) -> str:
    found = matching(TENSORRT, version)
    if found:
        return f"TensorRT {version}: the plan loads on Triton {', '.join(found)} only (same TensorRT version), on the GPU model it was built on."
    return f"TensorRT {version}: NO known Triton release ships this TensorRT version: the plan will NOT load on the releases in the table."
