"""ONNX initializers written to their external-data file as they are made.

``onnx.save_model(..., save_as_external_data=True)`` needs every weight in memory as part of the
model proto first; a decoder built from a GGUF file would then hold its weights twice (the proto
and the serialized copy). Here each initializer's bytes go straight to the data file and the proto
keeps only its location, offset and length, so building a graph holds one tensor at a time."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from ..manifest import weights_file

INLINE_BYTES = 1024  # smaller tensors (shapes, axes, norms of tiny models) stay in the proto
ALIGN = 4096  # each external tensor starts on a page, so onnxruntime can map it as it is


class TensorFile:
    """The external-data file beside a model: ``path`` is the ``.onnx`` file, the data goes to
    ``weights_file(path)`` (its name is what the proto records, relative to the model)."""

    def __init__(self, model_path: Path):
        self.path = weights_file(model_path)
        self.location = self.path.name
        self._file = self.path.open("wb")
        self.offset = 0

    def tensor(self, name: str, value: np.ndarray) -> Any:
        """An initializer holding ``value``: inline when small, else written out now."""
        from onnx import numpy_helper

        value = np.ascontiguousarray(value)
        if value.nbytes < INLINE_BYTES:
            return numpy_helper.from_array(value, name)
        return self.chunked(name, value.shape, value.dtype, [value])

    def chunked(self, name: str, shape: tuple[int, ...], dtype: Any, chunks: Iterable[np.ndarray]) -> Any:
        """An initializer whose bytes come as ``chunks`` in row-major order (a matrix, rows at a time)."""
        from onnx import TensorProto, helper

        start = -(-self.offset // ALIGN) * ALIGN
        if start > self.offset:
            self._file.write(b"\0" * (start - self.offset))
        written = 0
        for chunk in chunks:
            data = np.ascontiguousarray(chunk, dtype=dtype)
            self._file.write(data.data)
            written += data.nbytes
        expected = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        if written != expected:  # a mistake in the caller, never the input's fault
            raise AssertionError(f"{name}: wrote {written} bytes for shape {tuple(shape)}, {np.dtype(dtype)}")
        self.offset = start + written
        proto = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), dims=list(shape),
                            data_location=TensorProto.EXTERNAL)
        for key, value in (("location", self.location), ("offset", str(start)), ("length", str(written))):
            entry = proto.external_data.add()
            entry.key, entry.value = key, value
        return proto

    def close(self) -> None:
        self._file.close()
