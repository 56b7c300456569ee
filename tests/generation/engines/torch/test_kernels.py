"""The torch decoder's kernels (generation/engines/torch/kernels/): each Triton kernel, run by triton's
interpreter on CPU tensors (and on CUDA where there is one), gives what its PyTorch form gives, and a
token's bits, from the Triton kernel and from the PyTorch form alike, are the same alone and among
other tokens, in a decode step and inside prompt chunks of several lengths.

The interpreter's checks run in a child process of their own (``test_the_triton_kernels_under_the_interpreter``
runs this file's "interpreter" tests there): triton reads TRITON_INTERPRET when it is imported (its
own library functions, ``tl.sum``..., are compiled or interpreted then), and the variable must reach
no other test. Shapes are small: the interpreter runs a program in numpy. bf16 is checked on CUDA
only: the interpreter keeps bf16 as raw 16-bit integers, which its casts truncate and its ``tl.dot``
multiplies as integers."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from modelkiln.generation.engines.torch import kernels
from modelkiln.generation.engines.torch.kernels import reference

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # in the child process
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
SLOTS, LENGTH = 3, 96  # three key blocks of 32 positions per slot


def test_the_triton_kernels_under_the_interpreter():
    if INTERPRETED:
        pytest.skip("this is the child process")
    pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be run")
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "interpreter", __file__],
                           env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-2000:]
    assert " passed" in child.stdout and " failed" not in child.stdout


@pytest.fixture(scope="module", params=["interpreter"] if INTERPRETED else ["cuda"])
def backend(request):
    """(Triton kernels, device, dtypes, exact): exact says whether elementwise kernels must give the
    PyTorch form's bits (the interpreter computes as the CPU does; a GPU compiler may fuse a product
    and a sum into one rounding)."""
    if not INTERPRETED and not torch.cuda.is_available():
        pytest.skip("no CUDA device: the Triton kernels are checked by the interpreter (in a child process)")
    pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be run")
    from modelkiln.generation.engines.torch.kernels import triton_kernels

    if INTERPRETED:
        return triton_kernels, torch.device("cpu"), (torch.float32, torch.float16), True
    return triton_kernels, torch.device("cuda"), (torch.float32, torch.bfloat16), False


def randn(*shape, dtype=torch.float32, device="cpu", seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


def assert_close(got, expected, dtype):
    tolerance = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)


def assert_equal_or_close(got, expected, exact, dtype):
    if exact:
        assert torch.equal(got, expected)
    else:
        assert_close(got, expected, dtype)


def test_the_kernels_are_operators_of_the_kiln_namespace():
    for name in ("rms_norm", "add_rms_norm", "rotary_kv_write", "silu_mul", "attention"):
        assert hasattr(torch.ops.kiln, name), name
    x = randn(3, 48)
    assert torch.equal(kernels.rms_norm(x, x[0], 1e-5), reference.rms_norm(x, x[0], 1e-5))


# --- RMSNorm -----------------------------------------------------------------------------------------------


def test_norms_equal_their_pytorch_form_and_keep_a_rows_bits(backend):
    """The residual sum is exact; the norm's sum of squares is a reduction, whose order the interpreter
    (numpy) and PyTorch choose each their own way: close, and a row's bits are its own in both."""
    triton_kernels, device, dtypes, exact = backend
    for dtype in dtypes:
        x, residual = randn(9, 48, dtype=dtype, device=device, seed=1), randn(9, 48, dtype=dtype, device=device, seed=2)
        weight = randn(48, dtype=dtype, device=device, seed=3)
        summed, normed = triton_kernels.add_rms_norm(x, residual, weight, 1e-5)
        expected_summed, expected_normed = reference.add_rms_norm(x, residual, weight, 1e-5)
        assert_equal_or_close(summed, expected_summed, exact, dtype)
        assert_close(normed, expected_normed, dtype)
        assert_close(triton_kernels.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5), dtype)
        for norm in (triton_kernels.rms_norm, reference.rms_norm):
            together = norm(x, weight, 1e-5)
            for row in (0, 4, 8):
                assert torch.equal(norm(x[row:row + 1], weight, 1e-5)[0], together[row])
        for add_norm in (triton_kernels.add_rms_norm, reference.add_rms_norm):
            together = add_norm(x, residual, weight, 1e-5)[1]
            assert torch.equal(add_norm(x[4:5], residual[4:5], weight, 1e-5)[1][0], together[4])


# --- elementwise ---------------------------------------------------------------------------------------------


def test_silu_mul_equals_its_pytorch_form(backend):
    """Bitwise in fp16; in fp32 the exponential's last bit is the library's own (numpy's, PyTorch's, CUDA's)."""
    triton_kernels, device, dtypes, exact = backend
    for dtype in dtypes:
        gate_up = randn(5, 2 * 96, dtype=dtype, device=device, seed=4)
        got, expected = triton_kernels.silu_mul(gate_up), reference.silu_mul(gate_up)
        assert_equal_or_close(got, expected, exact and dtype == torch.float16, dtype)
        assert torch.equal(triton_kernels.silu_mul(gate_up[2:3])[0], got[2])


def caches(dtype, device):
    return (randn(SLOTS, KV_HEADS, LENGTH, HEAD_DIM, dtype=dtype, device=device, seed=5),
            randn(SLOTS, KV_HEADS, LENGTH, HEAD_DIM, dtype=dtype, device=device, seed=6))


def test_rotary_and_the_cache_write_equal_their_pytorch_form(backend):
    """Queries rotated, keys rotated and written with the values at (slot, position); a padding token
    (slot -1) writes nothing."""
    triton_kernels, device, dtypes, exact = backend
    for dtype in dtypes:
        qkv = randn(6, (HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=dtype, device=device, seed=7)
        cos = randn(LENGTH, HEAD_DIM, dtype=dtype, device=device, seed=8)
        sin = randn(LENGTH, HEAD_DIM, dtype=dtype, device=device, seed=9)
        positions = torch.tensor([0, 5, 70, 3, 6, 7], device=device)
        slots = torch.tensor([0, 1, 2, -1, 1, 1], device=device)
        keys, values = caches(dtype, device)
        expected_keys, expected_values = keys.clone(), values.clone()
        q = triton_kernels.rotary_kv_write(qkv, cos, sin, positions, slots, keys, values)
        expected = reference.rotary_kv_write(qkv, cos, sin, positions, slots, expected_keys, expected_values)
        assert_equal_or_close(q, expected, exact, dtype)
        assert_equal_or_close(keys, expected_keys, exact, dtype)
        assert torch.equal(values, expected_values)


# --- attention -----------------------------------------------------------------------------------------------


def step(tokens: list[tuple[int, int]], q_all: torch.Tensor, device):
    """A step's (slot, position) tokens, each with its query from q_all [SLOTS, LENGTH, heads, dim]."""
    slots = torch.tensor([s for s, _ in tokens], device=device)
    positions = torch.tensor([p for _, p in tokens], device=device)
    q = torch.stack([q_all[max(s, 0), p] for s, p in tokens])
    return q, positions, slots


def test_attention_equals_its_pytorch_form(backend):
    """Decode rows and chunk tokens of three slots, a padding token, with and without a window that
    starts inside a key block, grouped-query (2 query heads a kv head) and not."""
    triton_kernels, device, dtypes, _ = backend
    tokens = [(0, 0), (1, 40), (2, 95), (-1, 0), (1, 31), (1, 32), (1, 33), (2, 64)]
    for dtype in dtypes:
        keys, values = caches(dtype, device)
        for heads in (HEADS, KV_HEADS):
            q_all = randn(SLOTS, LENGTH, heads, HEAD_DIM, dtype=dtype, device=device, seed=10)
            q, positions, slots = step(tokens, q_all, device)
            for window in (None, 7, 40):
                got = triton_kernels.attention(q, keys, values, positions, slots, window)
                expected = reference.attention(q, keys, values, positions, slots, window)
                assert_close(got, expected, dtype)
                assert not got[3].any()  # the padding token's


@pytest.mark.parametrize("form", ["triton", "pytorch"])
def test_a_tokens_attention_is_the_same_alone_among_others_and_in_any_chunk(backend, form):
    """Slot 1's token at position 45 as a decode row alone, among other slots' decode rows, and inside
    prompt chunks of 1, 3, 8 and 46 tokens (itself first, in the middle, last): the same bits."""
    triton_kernels, device, dtypes, _ = backend
    attention = triton_kernels.attention if form == "triton" else reference.attention
    for dtype in dtypes[:1] if form == "pytorch" else dtypes:
        keys, values = caches(dtype, device)
        q_all = randn(SLOTS, LENGTH, HEADS, HEAD_DIM, dtype=dtype, device=device, seed=11)
        steps = {"alone": ([(1, 45)], 0), "among decode rows": ([(0, 90), (1, 45), (2, 3), (-1, 0)], 1)}
        for length, at in ((1, 0), (3, 1), (8, 7), (8, 0), (46, 45)):
            chunk = [(1, p) for p in range(45 - at, 45 - at + length)]
            steps[f"chunk of {length}"] = ([(0, 90), *chunk, (2, 20), (2, 21)], 1 + at)
        for window in (None, 20):
            results = {}
            for name, (tokens, index) in steps.items():
                q, positions, slots = step(tokens, q_all, device)
                results[name] = attention(q, keys, values, positions, slots, window)[index]
            alone = results.pop("alone")
            for name, got in results.items():
                assert torch.equal(got, alone), f"{form}, {dtype}, window {window}: {name}"
