"""KilnSkipNorm (src/modelkiln/native/norm.c) against onnxruntime's own SkipSimplifiedLayerNormalization,
which it replaces in the serving graph: the same two outputs, bit for bit."""
import numpy as np
import pytest

from modelkiln.native import DOMAIN, library_path

pytestmark = pytest.mark.skipif(library_path() is None, reason="the native library is not built on this machine")


def _session(op: str, domain: str, hidden: int, outputs: list[str], gamma: np.ndarray, epsilon: float):
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from modelkiln.runtime.onnx import session_options

    node = helper.make_node(op, ["x", "skip", "gamma"], outputs, domain=domain, epsilon=epsilon)
    named = [o for o in outputs if o]
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["b", "s", hidden])
                                            for n in ("x", "skip")],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["b", "s", hidden]) for n in named],
                              [numpy_helper.from_array(gamma, "gamma")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(domain, 1)])
    return ort.InferenceSession(model.SerializeToString(), session_options(2))


@pytest.mark.parametrize("hidden", [576, 2048, 37])
def test_kiln_skip_norm_gives_onnxruntimes_bits(hidden):
    """Rows 1 to 100 (one lane of eight used up to all of several tasks), values from 1e-3 to 1e3
    within a row (where a product rounded on its own and one fused into an add differ), a hidden size
    that is no multiple of eight."""
    rng = np.random.default_rng(hidden)
    gamma = (rng.standard_normal(hidden) * 0.5 + 1).astype(np.float32)
    epsilon = 1e-5
    theirs = _session("SkipSimplifiedLayerNormalization", "com.microsoft", hidden, ["out", "", "", "sum"], gamma, epsilon)
    ours = _session("KilnSkipNorm", DOMAIN, hidden, ["out", "sum"], gamma, epsilon)
    for rows in (1, 7, 8, 9, 64, 100):
        scale = np.float32(10.0) ** rng.uniform(-3, 3, (1, rows, hidden)).astype(np.float32)
        x = (rng.standard_normal((1, rows, hidden)) * scale).astype(np.float32)
        skip = (rng.standard_normal((1, rows, hidden)) * scale).astype(np.float32)
        expected = theirs.run(None, {"x": x, "skip": skip})
        got = ours.run(None, {"x": x, "skip": skip})
        for e, g in zip(expected, got):
            assert np.array_equal(e.view(np.uint32), g.view(np.uint32)), rows


def test_a_row_gets_the_same_bits_alone_and_among_others():
    rng = np.random.default_rng(1)
    hidden = 576
    ours = _session("KilnSkipNorm", DOMAIN, hidden, ["out", "sum"], rng.standard_normal(hidden).astype(np.float32), 1e-6)
    x, skip = (rng.standard_normal((1, 19, hidden)).astype(np.float32) for _ in range(2))
    together = ours.run(None, {"x": x, "skip": skip})
    for i in (0, 8, 18):
        alone = ours.run(None, {"x": x[:, i:i + 1], "skip": skip[:, i:i + 1]})
        for a, t in zip(alone, together):
            assert np.array_equal(a[0, 0], t[0, i]), i
