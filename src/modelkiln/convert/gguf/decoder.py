"""A GGUF file of the serving graph's architectures (llama, mistral, qwen2) read by tensor name.

The config comes from the file's metadata (transformers parses it, without the weights:
``source.load_gguf_source``); the tensors are read from gguf-py's ``GGUFReader``, which maps the file
into memory, so a tensor is read when the graph writer or the reference asks for it and nothing
holds the whole model. Every tensor's shape is checked against the config before any work.

llama.cpp's converter permutes the rows of a Llama's q and k projections (and their biases) for its
interleaved rotary layout; transformers undoes that when it loads a file
(``LlamaTensorProcessor``), and so does ``order`` here: whole output rows move, so a row's blocks
move with it. Qwen2 files are not permuted."""

from __future__ import annotations

import functools
from collections import Counter
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import ModelLoadError
from .blocks import FLOAT_TYPES, STORAGE, GgufMatrix
from ..generation.serving_graph import DecoderSpec, rotary_caches

LAYER_TENSORS = {"q": "attn_q.weight", "k": "attn_k.weight", "v": "attn_v.weight", "o": "attn_output.weight",
                 "q_bias": "attn_q.bias", "k_bias": "attn_k.bias", "v_bias": "attn_v.bias",
                 "gate": "ffn_gate.weight", "up": "ffn_up.weight", "down": "ffn_down.weight",
                 "input_norm": "attn_norm.weight", "post_attention_norm": "ffn_norm.weight"}
GLOBAL_TENSORS = {"embed": "token_embd.weight", "lm_head": "output.weight", "final_norm": "output_norm.weight"}
PERMUTED_ARCHITECTURES = ("llama",)  # llama.cpp's converter permutes q/k rows for these (Mistral files say llama)


def read_gguf(path: Path) -> Any:
    """The file's ``GGUFReader``: the one transformers' config and tokenizer loading parsed already
    (``source.one_gguf_parse``: parsing a 150k-token vocabulary takes seconds). A file gguf-py
    cannot parse (truncated, corrupt) is a ModelLoadError."""
    import gguf

    from ..source import one_gguf_parse

    try:
        with one_gguf_parse():
            return gguf.GGUFReader(str(path))
    except Exception as exc:  # gguf-py raises ValueError, struct errors, IndexError... on a bad file
        raise ModelLoadError(f"cannot read {path.name} as GGUF: {str(exc).splitlines()[0] or type(exc).__name__}") from exc


def _string_field(reader: Any, key: str) -> str | None:
    field = reader.fields.get(key)
    if field is None or not field.data:
        return None
    return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")


class GgufDecoder:
    """The weights of a GGUF decoder by role (``serving_graph.DecoderWeights``), checked against
    ``config`` (transformers' config from the same file's metadata)."""

    def __init__(self, path: Path, config: Any):
        from ..source import forget_gguf_parse

        self.path = path
        self.config = config
        reader = read_gguf(path)
        self.tensors = {t.name: t for t in reader.tensors}
        self.architecture = _string_field(reader, "general.architecture") or "?"
        self._file_map = reader.data  # the memory map every tensor's data is a view of
        # The parsed metadata (a 150k-token vocabulary and its merges: 0.36 GB of small arrays for
        # Qwen2.5) served the config and the tokenizer; only the tensors are read from here on.
        del reader
        forget_gguf_parse()
        self.spec = DecoderSpec.from_config(config, qkv_bias="blk.0.attn_q.bias" in self.tensors,
                                            qk_norm="blk.0.attn_q_norm.weight" in self.tensors)
        self.tied = "output.weight" not in self.tensors
        self._matrices: dict[str, GgufMatrix] = {}
        self._check_shapes()

    # -- what the file holds ----------------------------------------------------------------------
    def _expected_shapes(self) -> dict[str, tuple[int, ...]]:
        s = self.spec
        q_rows, kv_rows = s.heads * s.head_dim, s.kv_heads * s.head_dim
        shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (s.vocab, s.hidden), "output_norm.weight": (s.hidden,)}
        if not self.tied:
            shapes["output.weight"] = (s.vocab, s.hidden)
        per_layer = {"attn_q.weight": (q_rows, s.hidden), "attn_k.weight": (kv_rows, s.hidden),
                     "attn_v.weight": (kv_rows, s.hidden), "attn_output.weight": (s.hidden, q_rows),
                     "ffn_gate.weight": (s.intermediate, s.hidden), "ffn_up.weight": (s.intermediate, s.hidden),
                     "ffn_down.weight": (s.hidden, s.intermediate), "attn_norm.weight": (s.hidden,),
                     "ffn_norm.weight": (s.hidden,)}
        if s.qkv_bias:
            per_layer.update({"attn_q.bias": (q_rows,), "attn_k.bias": (kv_rows,), "attn_v.bias": (kv_rows,)})
        for i in range(s.layers):
            shapes.update({f"blk.{i}.{name}": shape for name, shape in per_layer.items()})
        return shapes

    def _check_shapes(self) -> None:
        s = self.spec
        for name, expected in self._expected_shapes().items():
            tensor = self.tensors.get(name)
            if tensor is None:
                raise ModelLoadError(f"{self.path.name} has no tensor {name} (a {s.model_type} of {s.layers} layers needs it)")
            found = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists the fastest-varying dimension first
            if found != expected:
                raise ModelLoadError(f"{self.path.name}: tensor {name} is {list(found)}, but the file's config (hidden "
                                     f"{s.hidden}, {s.heads} heads of {s.head_dim}, {s.kv_heads} kv heads, ffn "
                                     f"{s.intermediate}, vocab {s.vocab}) needs {list(expected)}")
            kind = tensor.tensor_type.name
            if len(expected) == 1 and kind not in FLOAT_TYPES:
                raise ModelLoadError(f"{self.path.name}: tensor {name} is {kind}; norms and biases must be float")

    @cached_property
    def parameters(self) -> int:
        return int(sum(int(t.n_elements) for t in self.tensors.values()))

    def release_pages(self, start: int = 0, length: int = 0) -> None:
        """Unmap the file's pages in [start, start + length) (all of them by default) from this
        process; they stay in the page cache, so a later read maps them again without the disk. A
        memory map's resident pages count as the process's memory: without this, reading the whole
        file once keeps all of it."""
        import mmap

        file_map = getattr(self._file_map, "_mmap", None)
        if file_map is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        first = start - start % mmap.PAGESIZE
        size = (length + start - first) if length else len(file_map) - first
        file_map.madvise(mmap.MADV_DONTNEED, first, min(size, len(file_map) - first))

    @property
    def file_bytes(self) -> int:
        return self.path.stat().st_size

    def matrix_types(self) -> Counter[str]:
        """How many of the file's matrices each GGUF type holds (the embedding counted once)."""
        names = [n for n, shape in self._expected_shapes().items() if len(shape) == 2]
        return Counter(self.tensors[n].tensor_type.name for n in names)

    def unpackable_types(self) -> dict[str, int]:
        """Quantized types with no exact MatMulNBits form (kept fp32), with their tensor counts."""
        return {k: n for k, n in self.matrix_types().items() if k not in STORAGE and k not in FLOAT_TYPES}

    # -- weights by role (serving_graph.DecoderWeights) ----------------------------------------------
    def gguf_name(self, key: str) -> str:
        if key == "lm_head" and self.tied:
            return GLOBAL_TENSORS["embed"]
        if key in GLOBAL_TENSORS:
            return GLOBAL_TENSORS[key]
        _, layer, role = key.split(".")
        return f"blk.{layer}.{LAYER_TENSORS[role]}"

    def _row_order(self, name: str, rows: int) -> np.ndarray | None:
        """The rows transformers' loading moves (its reverse of llama.cpp's q/k permutation)."""
        if self.architecture not in PERMUTED_ARCHITECTURES or not (".attn_q." in name or ".attn_k." in name):
            return None
        heads = self.spec.heads if ".attn_q." in name else self.spec.kv_heads
        return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(2, 1).reshape(-1)

    def tensor(self, key: str) -> Any:
        """A GgufMatrix for matrices (the tied head is the embedding's own object), fp32 values for
        norms and biases."""
        name = self.gguf_name(key)
        t = self.tensors[name]
        shape = tuple(int(d) for d in reversed(t.shape))
        order = self._row_order(name, shape[0])
        if len(shape) == 1:
            values = GgufMatrix(name, t.tensor_type.name, np.asarray(t.data).reshape(1, -1), (1, shape[0])).dequantized()[0]
            return values if order is None else values[order]
        if name not in self._matrices:
            data = t.data if t.tensor_type.name not in FLOAT_TYPES else np.asarray(t.data).reshape(shape[0], -1)
            release = functools.partial(self.release_pages, int(t.data_offset), int(t.n_bytes))
            self._matrices[name] = GgufMatrix(name, t.tensor_type.name, data, (shape[0], shape[1]), order, release)
        return self._matrices[name]

    def rope_freq_factors(self) -> np.ndarray | None:
        """llama.cpp's ``rope_freqs`` (Llama 3's rotary scaling, stored as a tensor): inv_freq is divided by them."""
        t = self.tensors.get("rope_freqs.weight")
        return None if t is None else np.array(t.data, np.float32).reshape(-1)  # a copy: the map is read-only

    def rotary_module(self) -> Any:
        """transformers' rotary embedding of this model type (its inv_freq from the config)."""
        import torch
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(self.config)
        return type(skeleton.model.rotary_emb)(config=self.config)

    def rotary(self, positions: int) -> tuple[np.ndarray, np.ndarray]:
        return rotary_caches(self.rotary_module(), positions, self.rope_freq_factors())
