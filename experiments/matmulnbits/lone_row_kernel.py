"""Does onnxruntime's int4 MatMulNBits give a row the same output whatever rows share its call?

One MatMul of SmolLM2's MLP shape (K 576, N 1536) is quantized to MatMulNBits (4 bits, block 32,
accuracy level 4: int8 compute, as `kiln convert` builds the int4 variant), next to the fp32 MatMul.
A fixed row x is multiplied with a neighbour (M = 2, the reference), alone (M = 1), and at several
positions among M - 1 random rows for M = 2 ... 1,200; every result is compared bit for bit with the
reference. Why it matters: the generation engine batches the decode steps of concurrent requests,
so M is the number of running sequences, and a greedy answer must not depend on it
(docs/batch-invariance.md#generation).

    python experiments/matmulnbits/lone_row_kernel.py --threads 2 --out benchmarks/results/lone-row-kernel.txt
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

K, N = 576, 1536
SIZES = [1, *range(2, 80), *range(80, 1201, 7), 129, 257, 385, 513, 1025]


def matmul_model(folder: Path) -> tuple[Path, Path]:
    weight = np.random.default_rng(0).standard_normal((K, N)).astype(np.float32) * 0.05
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "matmul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", N])],
        [numpy_helper.from_array(weight, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    fp32, int4 = folder / "fp32.onnx", folder / "int4.onnx"
    onnx.save(model, fp32)
    quantizer = MatMulNBitsQuantizer(onnx.load(fp32), block_size=32, is_symmetric=False, accuracy_level=4)
    quantizer.process()
    quantizer.model.save_model_to_file(str(int4))
    return fp32, int4


def scan(path: Path, threads: int) -> list[tuple[int, int, float]]:
    """(M, position, max |diff|) for every call whose row differs from the row computed with one neighbour."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    x = rng.standard_normal(K).astype(np.float32)
    reference = session.run(None, {"x": np.stack([x, rng.standard_normal(K).astype(np.float32)])})[0][0]
    differing = []
    for m in sorted(set(SIZES)):
        for position in sorted({0, m // 3, m // 2, m - 2, m - 1} - {-1}):
            rows = rng.standard_normal((m, K)).astype(np.float32)
            rows[position] = x
            row = session.run(None, {"x": rows})[0][position]
            if not np.array_equal(row, reference):
                differing.append((m, position, float(np.abs(row - reference).max())))
    return differing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    lines = [f"onnxruntime {ort.__version__}; MatMul K {K} x N {N}; a row against the same row computed with one "
             f"neighbour (M = 2), bit for bit; M in 1..1200 ({len(set(SIZES))} sizes), up to 5 positions each"]
    with tempfile.TemporaryDirectory() as tmp:
        fp32, int4 = matmul_model(Path(tmp))
        for threads in (int(t) for t in args.threads.split(",")):
            for name, path in (("fp32 MatMul", fp32), ("int4 MatMulNBits (accuracy level 4)", int4)):
                differing = scan(path, threads)
                shown = ", ".join(f"M={m} row {p} (max |diff| {d:.2g})" for m, p, d in differing[:8])
                lines.append(f"{threads} thread(s), {name}: {len(differing)} calls differ" + (f": {shown}" if shown else ""))
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
