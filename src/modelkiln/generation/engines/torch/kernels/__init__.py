"""The torch decoder's fused kernels, each a PyTorch operator in the ``kiln`` namespace (``kiln::attention``...),
so that a layer is a handful of launches on a GPU and a row's bits never depend on what else is in the step:

- ``rms_norm`` and ``add_rms_norm`` (the residual added, then RMSNorm; one program per row);
- ``rotary_kv_write``: the rotary embedding of the queries and keys, and the keys and values written into
  the KV cache at each token's (slot, position);
- ``silu_mul``: SiLU(gate) · up on the MLP's concatenated gate/up projection;
- ``attention``: every query token of a step, decode rows and prompt chunks alike, over its own slot's
  cache read in place.

On the CPU (and on a CUDA device where triton cannot be imported) each runs its PyTorch form
(``reference.py``); on CUDA with triton it launches the Triton kernel (``triton_kernels.py``), imported
on first use: triton is optional (a torch install may lack it).

Each is its own ``torch.library.custom_op``: one operator to PyTorch (one node for a dispatch mode
or a CUDA graph), whichever form runs."""

from types import ModuleType

import torch

from . import reference

_TRITON: list[ModuleType | None] = []  # the Triton kernels' module once looked for: None without triton


def _triton() -> ModuleType | None:
    if not _TRITON:
        try:
            from . import triton_kernels
        except ImportError:
            _TRITON.append(None)
        else:
            _TRITON.append(triton_kernels)
    return _TRITON[0]


@torch.library.custom_op("kiln::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm of each row of x [rows, hidden] (in fp32, as transformers computes it)."""
    return reference.rms_norm(x, weight, eps)


@rms_norm.register_kernel("cuda")
def _rms_norm_cuda(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # pragma: no cover - CUDA
    return (_triton() or reference).rms_norm(x, weight, eps)


@torch.library.custom_op("kiln::add_rms_norm", mutates_args=())
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual + x (the new residual stream) and its RMSNorm."""
    return reference.add_rms_norm(x, residual, weight, eps)


@add_rms_norm.register_kernel("cuda")
def _add_rms_norm_cuda(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:  # pragma: no cover - CUDA
    return (_triton() or reference).add_rms_norm(x, residual, weight, eps)


@torch.library.custom_op("kiln::rotary_kv_write", mutates_args=("keys", "values"))
def rotary_kv_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                    slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The rotated queries [tokens, heads, head_dim] of a layer's q/k/v projections; the rotated keys and
    the values written into the cache (``reference.rotary_kv_write``)."""
    return reference.rotary_kv_write(qkv, cos, sin, positions, slots, keys, values)


@rotary_kv_write.register_kernel("cuda")
def _rotary_kv_write_cuda(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                          slots: torch.Tensor, keys: torch.Tensor,
                          values: torch.Tensor) -> torch.Tensor:  # pragma: no cover - CUDA
    return (_triton() or reference).rotary_kv_write(qkv, cos, sin, positions, slots, keys, values)


@torch.library.custom_op("kiln::silu_mul", mutates_args=())
def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) · up of gate_up [rows, 2·intermediate] (gate first)."""
    return reference.silu_mul(gate_up)


@silu_mul.register_kernel("cuda")
def _silu_mul_cuda(gate_up: torch.Tensor) -> torch.Tensor:  # pragma: no cover - CUDA
    return (_triton() or reference).silu_mul(gate_up)


@torch.library.custom_op("kiln::attention", mutates_args=())
def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
              slots: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal attention of each query token over its slot's cache, read in place (``reference.attention``)."""
    return reference.attention(q, keys, values, positions, slots, window)


@attention.register_kernel("cuda")
def _attention_cuda(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                    slots: torch.Tensor, window: int | None) -> torch.Tensor:  # pragma: no cover - CUDA
    return (_triton() or reference).attention(q, keys, values, positions, slots, window)
