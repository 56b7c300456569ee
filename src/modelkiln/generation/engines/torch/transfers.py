"""Every copy between the host and the torch engine's device during a step goes through here, so that
the step's waits on the device are counted (the tests assert one a step) and each copy is made the
way that does not stall a GPU:

- host → device (``to_device``): staged in pinned memory and queued without blocking, behind the
  step's kernels; the host goes on at once (a copy from pageable memory makes the host wait).
- device → host (``to_host``): the step's one wait on the device. The tokens it chose are copied
  into pinned memory and the host waits for that copy (which comes after the step's kernels on the
  stream). Rows that need more on the host (log-probabilities, a grammar's error, kept logits, a
  row whose best score overflowed) add a wait of their own; the callers say where.

On the CPU the "device" is the host: nothing is copied and nothing waits, but the waits are counted
the same, so the CPU tests check what a GPU would do."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

host_waits = 0  # device → host copies made so far: each is a wait on the device


def to_device(values: Sequence[int] | Sequence[float] | np.ndarray, dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """``values`` as a tensor on ``device``, without waiting for it."""
    host = torch.from_numpy(values) if isinstance(values, np.ndarray) else torch.tensor(values, dtype=dtype)
    host = host.to(dtype)
    if device.type == "cuda":  # pragma: no cover - CUDA
        return host.pin_memory().to(device, non_blocking=True)
    return host


def to_host(tensor: torch.Tensor) -> np.ndarray:
    """A device tensor's values on the host (an array of its own): one wait on the device."""
    global host_waits
    host_waits += 1
    if tensor.device.type == "cuda":  # pragma: no cover - CUDA
        pinned = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        pinned.copy_(tensor, non_blocking=True)
        torch.cuda.current_stream(tensor.device).synchronize()
        return pinned.numpy()
    return tensor.detach().numpy().copy()
