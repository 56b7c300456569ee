"""kiln's native operators over GGUF blocks (src/modelkiln/native/gguf_ops.c and its kernels), through
onnxruntime as a served graph runs them: the K-quants and the types with a scale per 32 weights."""
import ctypes
import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from generation_helpers import random_gguf_blocks
from helpers import SRC
from modelkiln.convert.gguf.blocks import FP16_FIELDS
from modelkiln.convert.gguf.tiles import tiles
from modelkiln import native
from modelkiln.machine import cpu_flags
from modelkiln.native import (AMX_REFUSALS, DOMAIN, GGML_TYPES, amx_on, amx_refusal, library_path,
                              variant_matrix_engine)

pytestmark = pytest.mark.skipif(library_path() is None, reason="the native library is not built on this machine")


KINDS = list(GGML_TYPES)
PER_32 = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]


def random_blocks(kind: str, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """Valid random blocks (generation_helpers.random_gguf_blocks) whose fp16 scales (and
    minimums) differ from block to block, so that a kernel reading another block's shows."""
    rng = np.random.default_rng(seed)
    size = 32 if kind in PER_32 else 256
    raw = random_gguf_blocks(kind, rows, k, rng).reshape(rows, k // size, -1)
    for at in FP16_FIELDS[kind]:
        values = rng.random((rows, k // size, 1)) * 0.02 + 0.001
        if at == 2 and kind in ("Q4_1", "Q5_1"):  # the minimum: negative, as a block's usually is
            values = -values * 8
        raw[..., at:at + 2] = values.astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def session(nodes, inputs, outputs, initializers):
    import onnxruntime as ort
    from onnx import helper

    from modelkiln.runtime.onnx import session_options

    graph = helper.make_graph(nodes, "g", inputs, outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)])
    return ort.InferenceSession(model.SerializeToString(), session_options(2))


def matmul_session(kind: str, raw: np.ndarray, k: int):
    from onnx import TensorProto, helper, numpy_helper

    n = raw.shape[0]
    return session([helper.make_node("GgufMatMul", ["x", "w"], ["y"], domain=DOMAIN, ggml_type=GGML_TYPES[kind], K=k, N=n)],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", k])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "s", n])],
                   [numpy_helper.from_array(tiles(kind, raw), "w")])


@pytest.mark.parametrize("kind", KINDS)
def test_the_gather_is_gguf_pys_dequantization_bit_for_bit(kind):
    from gguf import GGMLQuantizationType, dequantize
    from onnx import TensorProto, helper, numpy_helper

    raw = random_blocks(kind, 70, 512)  # the last tile of 16 rows is short: 6 rows and 10 of zeros
    s = session([helper.make_node("GgufGather", ["w", "ids"], ["rows"], domain=DOMAIN, ggml_type=GGML_TYPES[kind], K=512, N=70)],
                [helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", "s"])],
                [helper.make_tensor_value_info("rows", TensorProto.FLOAT, ["b", "s", 512])],
                [numpy_helper.from_array(tiles(kind, raw), "w")])
    ids = np.array([[5, 0, 63], [7, 69, 17]], np.int64)
    [rows] = s.run(None, {"ids": ids})
    expected = dequantize(raw, GGMLQuantizationType[kind]).reshape(70, 512)[ids]
    assert rows.dtype == np.float32 and np.array_equal(rows.view(np.uint32), expected.view(np.uint32))
    [every] = s.run(None, {"ids": np.arange(70, dtype=np.int64)[None]})
    assert np.array_equal(every[0], dequantize(raw, GGMLQuantizationType[kind]).reshape(70, 512))


@pytest.mark.parametrize("kind", KINDS)
def test_tiles_move_the_files_bytes_and_keep_their_count(kind):
    """A tile of 16 rows takes the bytes of its 16 rows: the same values, moved (the gather above
    reads them back bit for bit)."""
    raw = random_blocks(kind, 32, 768, seed=7)
    tiled = tiles(kind, raw)
    assert tiled.shape == (2, 16 * raw.shape[1]) and tiled.dtype == np.uint8
    assert not np.array_equal(tiled.reshape(raw.shape), raw)  # moved, not copied
    assert tiles(kind, raw[:17]).shape == (2, 16 * raw.shape[1])  # a short last tile is filled


@pytest.mark.parametrize("kind", KINDS)
def test_the_matmul_is_the_dequantized_product_to_int8_activation_rounding(kind):
    from gguf import GGMLQuantizationType, dequantize

    k, n = 768, 40
    raw = random_blocks(kind, n, k, seed=1)
    w = dequantize(raw, GGMLQuantizationType[kind]).reshape(n, k)
    x = np.random.default_rng(2).standard_normal((2, 3, k)).astype(np.float32)
    [y] = matmul_session(kind, raw, k).run(None, {"x": x})
    expected = x @ w.T
    assert y.shape == (2, 3, n)
    # activations are quantized to int8 per 256 (K-quants) or 32 inputs, as llama.cpp does: about 1% of the scale
    assert np.abs(y - expected).max() < 0.02 * np.abs(expected).max()
    assert np.corrcoef(y.ravel(), expected.ravel())[0, 1] > 0.999


@pytest.mark.parametrize("kind", KINDS)
def test_a_row_gets_the_same_bits_alone_and_in_any_batch(kind):
    """Rows are multiplied one to four at a time, against one tile or (four rows, types with a scale
    per 32) two: the same integer sums and float operations for each, so an answer does not depend
    on its batch. 70 columns: two pairs of tiles and a short one alone."""
    k, n = 512 if kind not in PER_32 else 576, 70  # 576 = 18 blocks of 32 (SmolLM2's width), not of 256
    raw = random_blocks(kind, n, k, seed=3)
    x = np.random.default_rng(4).standard_normal((1, 11, k)).astype(np.float32)
    s = matmul_session(kind, raw, k)
    [together] = s.run(None, {"x": x})
    for i in range(11):
        [alone] = s.run(None, {"x": x[:, i:i + 1]})
        assert np.array_equal(alone[0, 0], together[0, i]), i
    [some] = s.run(None, {"x": x[:, 3:9]})
    assert np.array_equal(some, together[:, 3:9])


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_K", "Q6_K"])
def test_split_outputs_are_the_single_outputs_columns_bit_for_bit(kind):
    """split1 and split2 cut Y's columns into three outputs (a fused q/k/v without a Split node):
    each is its columns of the one output, bit for bit, at rows that take one tile or two a pass
    (1, 4, 11) and at parts whose boundary falls between the two tiles of a pass (16 | 48 | 6)."""
    from onnx import TensorProto, helper, numpy_helper

    k = 576 if kind in PER_32 else 512
    widths = [16, 48, 6]
    n = sum(widths)
    raw = random_blocks(kind, n, k, seed=9)
    whole = matmul_session(kind, raw, k)
    parts = session([helper.make_node("GgufMatMul", ["x", "w"], ["y0", "y1", "y2"], domain=DOMAIN, ggml_type=GGML_TYPES[kind],
                                      K=k, N=n, split1=16, split2=64)],
                    [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", k])],
                    [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, ["b", "s", w]) for i, w in enumerate(widths)],
                    [numpy_helper.from_array(tiles(kind, raw), "w")])
    for rows in (1, 4, 11):
        x = np.random.default_rng(rows).standard_normal((1, rows, k)).astype(np.float32)
        [y] = whole.run(None, {"x": x})
        y0, y1, y2 = parts.run(None, {"x": x})
        assert [a.shape[-1] for a in (y0, y1, y2)] == widths
        assert np.array_equal(np.concatenate([y0, y1, y2], axis=-1), y), rows


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_K"])
def test_a_third_input_multiplies_x_as_a_mul_node_would(kind):
    """GgufMatMul(X, W, T) is GgufMatMul(Mul(X, T), W) bit for bit (the MLP's silu(gate) · up without a
    Mul node): 576 inputs, not a multiple of 256, for the type with a scale per 32."""
    from onnx import TensorProto, helper, numpy_helper

    k, n = (576, 40) if kind in PER_32 else (512, 40)
    raw = random_blocks(kind, n, k, seed=11)
    w = numpy_helper.from_array(tiles(kind, raw), "w")
    xs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["b", "s", k]) for name in ("x", "t")]
    y = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "s", n])]
    attributes = {"domain": DOMAIN, "ggml_type": GGML_TYPES[kind], "K": k, "N": n}
    fused = session([helper.make_node("GgufMatMul", ["x", "w", "t"], ["y"], **attributes)], xs, y, [w])
    apart = session([helper.make_node("Mul", ["x", "t"], ["xt"]), helper.make_node("GgufMatMul", ["xt", "w"], ["y"], **attributes)],
                    xs, y, [w])
    for rows in (1, 5):
        rng = np.random.default_rng(rows)
        feeds = {name: rng.standard_normal((1, rows, k)).astype(np.float32) for name in ("x", "t")}
        assert np.array_equal(fused.run(None, feeds)[0], apart.run(None, feeds)[0]), rows


# X's rows as the kernels quantize them: per 32 inputs (q8_32) for the types with a scale per 32,
# per 256 (q8_block, 64-byte aligned) for the K-quants.
Q8_32 = np.dtype([("qs", "i1", 32), ("d", "<f4"), ("sum", "<i4")])
Q8_BLOCK = np.dtype({"names": ["qs", "bsums", "bsums32", "d"], "formats": [("i1", 256), ("<i2", 16), ("<i2", 8), "<f4"],
                     "offsets": [0, 256, 288, 304], "itemsize": 320})


def reference_quantization(x: np.ndarray, size: int):
    """llama.cpp's int8 activations in numpy: amax ignoring NaN, codes rint(x · (127 / amax)) (float32
    operations, ties to even), their scale amax / 127; a block of zeros is all zeros."""
    blocks = x.reshape(-1, size)
    amax = np.fmax.reduce(np.abs(blocks), axis=1, initial=np.float32(0))
    scale = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0)
    codes = np.rint(blocks * scale[:, None]).astype(np.int8)
    return codes, np.where(amax > 0, amax / np.float32(127), np.float32(0)).astype(np.float32)


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_K"])
def test_activations_are_quantized_as_llama_cpp_rounds_them(kind):
    lib = ctypes.CDLL(library_path())
    lib.kiln_gguf_activation_bytes.restype = ctypes.c_size_t
    size, dtype = (32, Q8_32) if kind in PER_32 else (256, Q8_BLOCK)
    assert lib.kiln_gguf_activation_bytes(GGML_TYPES[kind]) == dtype.itemsize
    rng = np.random.default_rng(8)
    rows, k = 6, 512
    x = rng.standard_normal((rows, k)).astype(np.float32)
    x[1] = (rng.integers(-126, 126, k) + 0.5).astype(np.float32) / 2  # amax 63.5: scale 2, and x · 2 a tie
    x[1, ::32] = 63.5
    x[2] *= np.float32(1e-30)  # tiny and huge: the scale is a float division, not a reciprocal times
    x[3] *= np.float32(1e30)
    x[4, :256] = 0.0  # blocks of zeros
    x[4, 256:] = -0.0
    out = np.zeros(rows * k // size, dtype)
    lib.kiln_gguf_quantize(GGML_TYPES[kind], x.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(rows), ctypes.c_int64(k),
                           out.ctypes.data_as(ctypes.c_void_p))
    codes, scales = reference_quantization(x, size)
    assert np.array_equal(out["qs"], codes)
    assert np.array_equal(out["d"].view(np.uint32), scales.view(np.uint32))
    ties = np.abs(x[1] * (np.float32(127) / np.float32(63.5)) % 1) == 0.5
    assert ties.sum() > 100 and np.array_equal(out["qs"][k // size:2 * k // size].ravel()[ties] % 2, np.zeros(ties.sum()))
    if kind in PER_32:
        assert np.array_equal(out["sum"], codes.sum(axis=1, dtype=np.int32))
    else:
        assert np.array_equal(out["bsums"], codes.reshape(-1, 16, 16).sum(axis=2, dtype=np.int16))
        assert np.array_equal(out["bsums32"], codes.reshape(-1, 8, 32).sum(axis=2, dtype=np.int16))


def test_the_avx2_and_avx512_forms_agree_bit_for_bit():
    lib = ctypes.CDLL(library_path())
    k, n, rows = 512, 33, 6
    for kind in GGML_TYPES:
        tiled = tiles(kind, random_blocks(kind, n, k, seed=5))
        x = np.random.default_rng(6).standard_normal((rows, k)).astype(np.float32)
        outs = []
        for avx512 in (0, 1):
            lib.kiln_gguf_use_avx512(avx512)
            y = np.zeros((rows, n), np.float32)
            lib.kiln_gguf_matmul(GGML_TYPES[kind], x.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(rows), ctypes.c_int64(k),
                                 tiled.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(n), y.ctypes.data_as(ctypes.c_void_p))
            outs.append(y)
        lib.kiln_gguf_use_avx512(1)
        assert np.array_equal(outs[0], outs[1]), kind


def _matmul(lib, kind, x, tiled, n, k):
    y = np.zeros((x.shape[0], n), np.float32)
    lib.kiln_gguf_matmul(GGML_TYPES[kind], x.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(x.shape[0]), ctypes.c_int64(k),
                         tiled.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(n), y.ctypes.data_as(ctypes.c_void_p))
    return y


def _amx_agrees(mode: int) -> None:
    """37 rows (two AMX tiles of sixteen, then five for the VNNI kernel) against the AVX-512 kernel
    alone, and each row against itself alone (one row: never AMX), bit for bit, every type; blocks a row
    one, an odd and an even count (the kernels alternate tile sets from block to block)."""
    lib = ctypes.CDLL(library_path())
    lib.kiln_gguf_use_avx512(1)
    n = 33
    try:
        for kind, k in [(kind, k) for kind in KINDS for k in ((32, 96, 576) if kind in PER_32 else (256, 768, 512))]:
            tiled = tiles(kind, random_blocks(kind, n, k, seed=7))
            x = np.random.default_rng(8).standard_normal((37, k)).astype(np.float32)
            assert lib.kiln_gguf_use_amx(0)
            plain = _matmul(lib, kind, x, tiled, n, k)
            assert lib.kiln_gguf_use_amx(mode), "the kernel's own check against the AVX-512 kernel failed"
            assert amx_on() and amx_refusal() is None
            # what kiln convert's matrix engine column, kiln bench's rows and kiln serve's log name
            assert variant_matrix_engine({"native_ops": 2}, "int4", "cpu").startswith("AMX (8+ rows), ")
            tiled_rows = _matmul(lib, kind, x, tiled, n, k)  # the tile's B unpacked once for two groups of sixteen
            assert np.array_equal(tiled_rows, plain), (kind, k)
            assert np.array_equal(_matmul(lib, kind, x[:20], tiled, n, k), plain[:20]), (kind, k)  # one group: block by block
            for row in (0, 15, 16, 31, 36):
                assert np.array_equal(_matmul(lib, kind, x[row:row + 1], tiled, n, k)[0], tiled_rows[row]), (kind, k, row)
    finally:
        lib.kiln_gguf_use_amx(0)
    assert not amx_on() and not variant_matrix_engine({"native_ops": 2}, "int4", "cpu").startswith("AMX")


@pytest.mark.skipif(not {"avx512bw", "avx512_vnni"} <= cpu_flags(), reason="the AMX kernel's float step is AVX-512's: this CPU has no AVX-512 VNNI")
def test_the_amx_kernel_on_a_model_of_its_tiles_gives_the_avx512_kernels_bits():
    """The AMX kernel compiled over a plain C model of its tiles (the instructions as Intel's
    manual defines them): its data layout and arithmetic, tested on any CPU with AVX-512."""
    _amx_agrees(2)


def test_amx_is_refused_where_the_cpu_lacks_it_and_tested_where_asked():
    lib = ctypes.CDLL(library_path())
    if "amx_int8" not in cpu_flags():
        assert lib.kiln_gguf_use_amx(1) == 0  # never turned on without the unit
        assert amx_refusal() == AMX_REFUSALS[4]  # and says why (kiln bench's note, kiln serve's log)
        lib.kiln_gguf_use_amx(0)
        assert amx_refusal() is None  # not asked
        pytest.skip("this CPU has no AMX-INT8: the kernel on the unit itself is not run here")
    if os.environ.get("KILN_AMX") != "1":
        pytest.skip("AMX is opt-in (KILN_AMX=1) until measured on an AMX CPU; set it to run this test")
    _amx_agrees(1)


_MLAS_AND_KILN = """
import sys
import numpy as np
from modelkiln.runtime.onnx import session_options
import onnxruntime as ort
from modelkiln.native import amx_on
folder = sys.argv[1]
data = np.load(folder + "/inputs.npz")
session = ort.InferenceSession(folder + "/model.onnx", session_options(1))  # one thread: every node on this one
assert amx_on(), "KILN_AMX=1 was refused"
for i in range(3):  # MLAS's GEMM, kiln's, then MLAS's again after kiln's, in the same thread
    integer, floats = session.run(["integer", "floats"], {"a": data["a"], "x": data["x"]})
    np.savez(folder + f"/run{i}.npz", integer=integer, floats=floats)
"""


@pytest.mark.skipif("amx_int8" not in cpu_flags(), reason="this CPU has no AMX-INT8: onnxruntime's AMX GEMM and kiln's "
                                                          "cannot meet here")
def test_kilns_amx_kernels_leave_onnxruntimes_own_amx_gemm_working_in_the_same_thread(tmp_path):
    """onnxruntime's int8 GEMM (MLAS) runs on AMX's tiles too, configures a pool thread's tiles once and counts on
    them staying so; kiln's kernels run in the same threads. A graph with both, on one thread, three times: every
    product exact (MLAS's against numpy's integers, kiln's against its AVX-512 kernel), and the process alive."""
    if os.environ.get("KILN_AMX") != "1":
        pytest.skip("AMX is opt-in (KILN_AMX=1) until measured on an AMX CPU; set it to run this test")
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(9)
    kind, k, n = "Q4_K", 512, 33
    raw = random_blocks(kind, n, k, seed=7)
    x = rng.standard_normal((37, k)).astype(np.float32)  # two AMX groups of sixteen, five rows for VNNI
    a = rng.integers(0, 256, (64, 256), dtype=np.uint8)
    b = rng.integers(-128, 128, (256, 64), dtype=np.int8)
    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["a", "b"], ["integer"]),
         helper.make_node("GgufMatMul", ["x", "w"], ["floats"], domain=DOMAIN, ggml_type=GGML_TYPES[kind], K=k, N=n)],
        "mlas_and_kiln",
        [helper.make_tensor_value_info("a", TensorProto.UINT8, [64, 256]),
         helper.make_tensor_value_info("x", TensorProto.FLOAT, [37, k])],
        [helper.make_tensor_value_info("integer", TensorProto.INT32, [64, 64]),
         helper.make_tensor_value_info("floats", TensorProto.FLOAT, [37, n])],
        [numpy_helper.from_array(b, "b"), numpy_helper.from_array(tiles(kind, raw), "w")])
    (tmp_path / "model.onnx").write_bytes(helper.make_model(graph, opset_imports=[
        helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)]).SerializeToString())
    np.savez(tmp_path / "inputs.npz", a=a, x=x)
    run = subprocess.run([sys.executable, "-c", _MLAS_AND_KILN, str(tmp_path)], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "KILN_AMX": "1", "PYTHONPATH": str(SRC)})
    assert run.returncode == 0, f"exit {run.returncode}: {run.stderr[-2000:]}"
    lib = ctypes.CDLL(library_path())
    lib.kiln_gguf_use_avx512(1)
    lib.kiln_gguf_use_amx(0)
    try:
        kiln_avx512 = _matmul(lib, kind, x, tiles(kind, raw), n, k)
    finally:
        lib.kiln_gguf_use_amx(1)  # as this process had it (KILN_AMX=1)
    for i in range(3):
        got = np.load(tmp_path / f"run{i}.npz")
        assert np.array_equal(got["integer"], a.astype(np.int32) @ b.astype(np.int32)), i
        assert np.array_equal(got["floats"], kiln_avx512), i


def test_the_amx_refusals_named_are_the_kernels_states():
    """native.AMX_REFUSALS reads gguf_amx_tiles.h's amx_state by number: the two lists must agree."""
    header = (Path(__file__).parents[2] / "src" / "modelkiln" / "native" / "gguf_amx_tiles.h").read_text()
    states = [name.strip() for name in header.split("enum amx_state {", 1)[1].split("}", 1)[0].split(",")]
    assert states[:3] == ["AMX_OFF", "AMX_ON", "AMX_MODEL"]
    assert {i: name for i, name in enumerate(states) if i >= 3} == {
        3: "AMX_NOT_BUILT", 4: "AMX_NO_UNIT", 5: "AMX_NOT_GRANTED", 6: "AMX_DISAGREES", 7: "AMX_CRASHED"}
    assert set(AMX_REFUSALS) == {3, 4, 5, 6, 7}


def test_a_check_that_faults_is_a_refusal_not_the_end_of_the_process():
    """The AMX kernels' checks run in a child process first: on a unit they never ran on, a tile
    instruction or configuration the CPU rejects faults there, and this process goes on with AMX off and
    says why. Mode 3 is a check that faults as such an instruction would (ud2: SIGILL)."""
    lib = ctypes.CDLL(library_path())
    lib.kiln_gguf_use_avx512(1)
    try:
        assert lib.kiln_gguf_use_amx(3) == 0
        assert not amx_on() and lib.kiln_gguf_amx_state() == 7 and lib.kiln_gguf_amx_detail() == signal.SIGILL
        assert amx_refusal() == AMX_REFUSALS[7].format(signal="SIGILL")
        assert lib.kiln_gguf_use_amx(3) == 0 and amx_refusal() == AMX_REFUSALS[7].format(signal="SIGILL")  # remembered
    finally:
        lib.kiln_gguf_use_amx(0)
    assert amx_refusal() is None and not amx_on()


def test_a_refusal_by_linux_names_its_errno(monkeypatch):
    """Linux refuses the tile state (arch_prctl) for reasons a user can act on: the refusal says which."""
    class Refused:
        def __init__(self, state: int, detail: int):
            self.kiln_gguf_amx_state = lambda: state
            self.kiln_gguf_amx_detail = lambda: detail

    monkeypatch.setattr(native, "library", lambda: Refused(5, errno.ENOSPC))
    assert amx_refusal() == ("Linux did not grant this process the tile state (arch_prctl ARCH_REQ_XCOMP_PERM: "
                             "ENOSPC, a thread's signal stack (sigaltstack) is too small for the tile state)")
    monkeypatch.setattr(native, "library", lambda: Refused(5, errno.EPERM))
    assert amx_refusal().endswith("(arch_prctl ARCH_REQ_XCOMP_PERM: EPERM)")
    monkeypatch.setattr(native, "library", lambda: Refused(7, 99))  # no such signal: its number
    assert amx_refusal() == AMX_REFUSALS[7].format(signal="signal 99")


def test_what_turning_amx_on_found_outlives_the_sessions():
    """kiln convert names the unit after its sessions end, and onnxruntime unloads the library with the last
    session options that registered it: loaded again, the library would say AMX was never asked for. A
    fresh process, KILN_AMX=1, one session's options made and dropped: the state is still there."""
    code = ("import gc; from modelkiln import native; from modelkiln.runtime.onnx import session_options; "
            "session_options(1); gc.collect(); print(native.amx_on(), native.amx_refusal())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "KILN_AMX": "1", "PYTHONPATH": str(SRC)})
    assert done.returncode == 0, done.stderr[-2000:]
    expected = "True None" if "amx_int8" in cpu_flags() else f"False {AMX_REFUSALS[4]}"
    assert done.stdout.strip() == expected, done.stderr[-2000:]
