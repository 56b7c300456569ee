"""Every copy between the host and the torch engine's device during a step goes through here, so that
the step's waits on the device are counted (the tests assert one a step) and each copy is made the
way that does not stall a GPU:

- host → device (``to_device``): staged in pinned memory and queued without blocking, behind the
  step's kernels; the host goes on at once (a copy from pageable memory makes the host wait).
- device → host (``HostCopy``, ``to_host``): the step's one wait on the device. The tokens it chose
  are copied into pinned memory, queued behind the step's kernels, with an event after the copy;
  the host waits for that event only when it reads them (``HostCopy.result``), so it can queue the
  next step first (overlapped scheduling: a wait on the whole stream would wait for that step too).
  Rows that need more on the host (log-probabilities, kept logits) add a wait of their own; the
  callers say where.

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


class HostCopy:
    """A device tensor's values on their way to the host: the copy is queued now, behind the
    kernels that compute them, and ``result`` waits for it (one wait on the device)."""

    def __init__(self, tensor: torch.Tensor):
        self._event = None
        if tensor.device.type == "cuda":  # pragma: no cover - CUDA
            self._pinned = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._pinned.copy_(tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(tensor.device))
        else:
            self._pinned = tensor.detach().clone()

    def result(self) -> np.ndarray:
        """The values (an array of its own)."""
        global host_waits
        host_waits += 1
        if self._event is not None:  # pragma: no cover - CUDA
            self._event.synchronize()
        return self._pinned.numpy()


def to_host(tensor: torch.Tensor) -> np.ndarray:
    """A device tensor's values on the host (an array of its own): one wait on the device."""
    return HostCopy(tensor).result()
