"""Experiment: a copy of a decoder graph whose Attention nodes compute in float64 (Q, K, V and a float
mask cast to double, the output cast back to float). It removes the summation-order noise of the
attention reductions over a padded past; onnxruntime's double Attention kernel is slow, so this is a
measurement, not a variant.

    python benchmarks/invariance_experiments/attention_f64.py ART/model.int4.onnx ART/model.int4f64.onnx
"""
import sys, onnx
from onnx import helper, TensorProto
src, dst = sys.argv[1], sys.argv[2]
m = onnx.load(src, load_external_data=False)
g = m.graph
types = {vi.name: vi.type.tensor_type.elem_type for vi in list(g.value_info) + list(g.input) + list(g.output)}
new = []
for n in g.node:
    if n.op_type != "Attention":
        new.append(n); continue
    ins = []
    for j, i in enumerate(n.input):
        if j == 3 and types.get(i) == TensorProto.BOOL:
            ins.append(i); continue
        c = f"{i}__f64_{n.name}"
        new.append(helper.make_node("Cast", [i], [c], to=TensorProto.DOUBLE, name=c)); ins.append(c)
    out = n.output[0]
    n.input[:] = ins; n.output[0] = out + "__f64"
    new.append(n)
    new.append(helper.make_node("Cast", [out + "__f64"], [out], to=TensorProto.FLOAT, name=out + "__f32"))
print("mask type", types.get([n for n in g.node if n.op_type=="Attention"][0].input[3]))
del g.node[:]; g.node.extend(new)
# drop value_info for changed outputs (shape inference will redo)
onnx.save(m, dst)
