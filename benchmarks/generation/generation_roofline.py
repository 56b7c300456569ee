"""How many tokens/s can this machine's onnxruntime kernels give SmolLM2-135M at all?

A decode step multiplies every weight once per sequence in the batch: 2 x 134.5M FLOPs per token
(lm_head included, attention left out, which only lowers the ceiling further). So a batch's output
tokens/s can never exceed the matrix kernels' throughput / 0.269 GFLOP. This measures that
throughput with SmolLM2's own matrix shapes (the seven per layer, 30 layers, and lm_head, each with
its own random weights, in one graph run by one session) for the kernels `kiln convert` builds: fp32 MatMul and MatMulNBits at 4 and
8 bits (accuracy level 4: int8 compute on AVX2), at M = 1 (one stream: bound by reading weights)
and M = 16 / 64 / 256 (many streams: bound by arithmetic), 2 threads, best of 15 calls.

    python benchmarks/generation/generation_roofline.py --rows 1,16,64,256,512 --out benchmarks/results/generation-roofline.txt
    python benchmarks/generation/generation_roofline.py --prefill --rows 128,512 --out benchmarks/results/generation-roofline-prefill.txt
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

HIDDEN, INTER, KV, LAYERS, VOCAB = 576, 1536, 192, 30, 49152
# (K, N, how many per token): q, k, v, o, gate, up, down per layer; lm_head once.
SHAPES = [(HIDDEN, HIDDEN, 2 * LAYERS), (HIDDEN, KV, 2 * LAYERS), (HIDDEN, INTER, 2 * LAYERS),
          (INTER, HIDDEN, LAYERS), (HIDDEN, VOCAB, 1)]
MACS_PER_TOKEN = sum(k * n * count for k, n, count in SHAPES)
LM_HEAD_MACS = HIDDEN * VOCAB


def model(folder: Path, kind: str, prefill: bool = False) -> Path:
    """One graph holding every matrix of a token's decode step, each with its own weights (so they
    stream from memory as the real model's do) and one session (one thread pool). ``prefill``: lm_head
    takes one row only (input ``x_last``), as a prefill needs the last prompt token's logits only."""
    rng = np.random.default_rng(0)
    nodes, weights, outputs = [], [], []
    for k, n, count in SHAPES:
        for i in range(count):
            name = f"w{k}x{n}_{i}"
            weights.append(numpy_helper.from_array((rng.standard_normal((k, n)) * 0.05).astype(np.float32), name))
            source = "x_last" if prefill and n == VOCAB else f"x{k}"
            nodes.append(helper.make_node("MatMul", [source, name], [f"y_{name}"]))
            outputs.append(helper.make_tensor_value_info(f"y_{name}", TensorProto.FLOAT, ["M", n]))
    inputs = [helper.make_tensor_value_info(f"x{k}", TensorProto.FLOAT, ["M", k]) for k in (HIDDEN, INTER)]
    if prefill:
        inputs.append(helper.make_tensor_value_info("x_last", TensorProto.FLOAT, [1, HIDDEN]))
    proto = helper.make_model(helper.make_graph(nodes, "decode_step_matrices", inputs, outputs, weights),
                              opset_imports=[helper.make_opsetid("", 17)])
    proto.ir_version = 9
    path = folder / f"{kind}{'-prefill' if prefill else ''}.onnx"
    if kind != "fp32":
        quantizer = MatMulNBitsQuantizer(proto, block_size=32, is_symmetric=False, accuracy_level=4,
                                         bits=8 if kind == "int8" else 4)
        quantizer.process()
        proto = quantizer.model.model
    onnx.save(proto, path, save_as_external_data=True, location=path.name + ".data")
    return path


def seconds_per_step(session: ort.InferenceSession, m: int, rounds: int, runs: int = 5) -> float:
    """Best time of one call (every matrix of a decode step, M rows each) over ``rounds`` × ``runs``."""
    rng = np.random.default_rng(m)
    feeds = {f"x{k}": rng.standard_normal((m, k)).astype(np.float32) for k in (HIDDEN, INTER)}
    if "x_last" in {i.name for i in session.get_inputs()}:
        feeds["x_last"] = rng.standard_normal((1, HIDDEN)).astype(np.float32)
    session.run(None, feeds)
    best = float("inf")
    for _ in range(rounds * runs):
        start = time.perf_counter()
        session.run(None, feeds)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,16,64,256")
    parser.add_argument("--kinds", default="fp32,int4,int8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prefill", action="store_true",
                        help="M prompt tokens: lm_head for the last one only (tokens/s = prompt tokens per second)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    what = ("prefill: M prompt tokens through every layer, lm_head for the last one" if args.prefill else
            "decode step: M sequences, one token each")
    lines = [f"onnxruntime {ort.__version__}, {args.threads} threads; SmolLM2-135M matrix work per token: "
             f"{MACS_PER_TOKEN / 1e6:.1f}M multiply-adds ({2 * MACS_PER_TOKEN / 1e9:.3f} GFLOP); {what}",
             "kind  rows(M)  step ms  GFLOP/s  ceiling tokens/s (= M / step time)"]
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.kinds.split(","):
            session = ort.InferenceSession(str(model(Path(tmp), kind, args.prefill)), options,
                                           providers=["CPUExecutionProvider"])
            for m in (int(r) for r in args.rows.split(",")):
                step = seconds_per_step(session, m, args.rounds)
                macs = (MACS_PER_TOKEN - LM_HEAD_MACS) * m + LM_HEAD_MACS if args.prefill else MACS_PER_TOKEN * m
                lines.append(f"{kind:5s} {m:7d} {step * 1000:8.1f} {2 * macs / step / 1e9:8.1f} "
                             f"{m / step:10.1f}")
                print(lines[-1], flush=True)
    print("\n".join(lines[:2]))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
