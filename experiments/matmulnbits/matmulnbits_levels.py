"""One MatMulNBits node (K 576, N 1536: a SmolLM2 MLP shape), block 32, symmetric, at M rows (M = 1: a
decode step of one sequence; M = 16: a step of 16): speed of 8- and 4-bit weights at accuracy levels 0/1 (fp32
compute) and 4 (int8 activations) vs a plain fp32 MatMul, 5 interleaved rounds of 0.3 s.
Run: python experiments/matmulnbits/matmulnbits_levels.py [--rows 1,16]"""
import argparse, time, numpy as np, onnx, onnxruntime as ort
from onnx import helper, TensorProto
from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer, DefaultWeightOnlyQuantConfig
rng = np.random.default_rng(0)
K, N = 576, 1536
W = rng.standard_normal((K, N)).astype(np.float32) * 0.05
g = helper.make_graph([helper.make_node("MatMul", ["A", "W"], ["Y"])], "g",
    [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", K])],
    [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", N])],
    [onnx.numpy_helper.from_array(W, "W")])
m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
so = ort.SessionOptions(); so.intra_op_num_threads = 2
sess = {"fp32": ort.InferenceSession(m.SerializeToString(), so)}
for bits, level in ((8, 0), (8, 1), (8, 4), (4, 0), (4, 4)):
    cfg = DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=True, accuracy_level=level, bits=bits)
    q = MatMulNBitsQuantizer(onnx.ModelProto.FromString(m.SerializeToString()), algo_config=cfg); q.process()
    sess[f"b{bits} l{level}"] = ort.InferenceSession(q.model.model.SerializeToString(), so)
parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--rows", default="1", help="comma-separated M values")
for M in (int(x) for x in parser.parse_args().rows.split(",")):
    A = rng.standard_normal((M, K)).astype(np.float32)
    res = {k: [] for k in sess}
    for r in range(5):
        for k, s in sess.items():
            t = time.perf_counter(); n = 0
            while time.perf_counter() - t < 0.3:
                s.run(None, {"A": A}); n += 1
            res[k].append((time.perf_counter() - t) / n * 1e6)
    for k, v in res.items():
        print(f"M={M} {k}: median {np.median(v):.1f} us per call ({np.median(res['fp32'])/np.median(v):.2f}x fp32's speed)")
