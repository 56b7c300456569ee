"""Padding policy and request (un)batching for the generated Triton models.

Triton's dynamic batcher only joins requests whose tensors have the same shape. Padding each
request to the longest text in it (what the pipeline does) would give almost every request its
own width, so the tokenize model pads to a small set of bucket widths instead: requests of
similar length batch together, and padding never more than doubles the work."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

MIN_BUCKET = 8


def bucket_width(longest: int, max_length: int) -> int:
    """Smallest power of two ≥ ``longest`` (at least MIN_BUCKET), capped at ``max_length``."""
    width = MIN_BUCKET
    while width < longest:
        width *= 2
    return min(width, max(max_length, longest))


def stack(requests: Sequence[Mapping[str, np.ndarray]], pad_values: Mapping[str, int]) -> tuple[dict[str, np.ndarray], list[tuple[int, int]]]:
    """Join requests' [rows, width] feeds into one batch, padding to the widest.
    Returns the batch and each request's (rows, width) to split the outputs with."""
    width = max(next(iter(r.values())).shape[1] for r in requests)
    sizes = []
    batch: dict[str, list[np.ndarray]] = {name: [] for name in requests[0]}
    for request in requests:
        rows, own = next(iter(request.values())).shape
        sizes.append((rows, own))
        for name, array in request.items():
            if own < width:
                array = np.pad(array, ((0, 0), (0, width - own)), constant_values=pad_values.get(name, 0))
            batch[name].append(array)
    return {name: np.concatenate(arrays) for name, arrays in batch.items()}, sizes


def split(outputs: Mapping[str, np.ndarray], sizes: Sequence[tuple[int, int]], per_token: bool) -> list[dict[str, np.ndarray]]:
    """Undo ``stack``: each request's rows, and (per-token outputs) its own width back."""
    results, start = [], 0
    for rows, width in sizes:
        part = {}
        for name, array in outputs.items():
            chunk = array[start : start + rows]
            part[name] = np.ascontiguousarray(chunk[:, :width]) if per_token else chunk
        results.append(part)
        start += rows
    return results
