"""The torch engine for encoder artifacts (embeddings, classification, token classification, QA): a
torch variant's weights (``model.torch-<precision>.safetensors``) in transformers' module for the
task, with SDPA attention, on the CPU or a CUDA device, behind the runtime's engine protocol
(``run(feeds) -> outputs``, numpy in and out).

- Sentence embeddings are pooled (mean, CLS or max, as the manifest says) and L2-normalised on the
  device: ``run`` returns ``sentence_embedding`` [batch, hidden] (``tasks/embeddings.py`` takes it as
  is), and the hidden states only when asked (``keep_hidden``: the gate compares them).
- On CUDA, each (batch, length) bucket (batch 1, 2, 4, ... 256; length 16, 32, ... the model's
  maximum) runs as a CUDA graph, captured the first time the bucket is met (``kiln serve``'s warm-up
  batches meet the first ones); inputs are padded to the bucket (padding is cheap there), padding rows attend to one
  token. A bucket whose capture fails (a module that reads a value on the host) runs eagerly, and
  says so once in the log. Beyond the largest bucket a batch runs eagerly.

Imports torch and transformers: only ``runtime/registry.py`` opens it, for a variant whose engine is
``torch``; the ONNX serving path never does."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import ArtifactError
from ..manifest import Manifest, Pooling
from ..tasks import task_class
from ..tasks.embeddings import POOLED

log = logging.getLogger(__name__)

GRAPH_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
GRAPH_LENGTHS = (16, 32, 64, 128, 256, 512)

_AUTO_CLASSES = {
    "text-classification": "AutoModelForSequenceClassification",
    "token-classification": "AutoModelForTokenClassification",
    "question-answering": "AutoModelForQuestionAnswering",
    "sentence-embeddings": "AutoModel",
}


def load_module(folder: Path, task: str, weights: Path, device: torch.device) -> Any:
    """transformers' module for ``task`` built from the artifact's config.json, with SDPA attention
    where transformers has it for the architecture, holding the weights file's tensors in their own
    precision."""
    import transformers
    from safetensors.torch import load_file

    try:
        config = transformers.AutoConfig.from_pretrained(str(folder))
        tensors = load_file(str(weights))
    except Exception as exc:  # config or safetensors errors: the artifact is unreadable
        raise ArtifactError(f"cannot load the torch variant {weights}: {str(exc).splitlines()[0]}") from exc
    dtype = next((t.dtype for t in tensors.values() if t.is_floating_point()), torch.float32)
    auto = getattr(transformers, _AUTO_CLASSES[task])
    with _no_init_weights():
        try:
            module = auto.from_config(config, dtype=dtype, attn_implementation="sdpa")
        except ValueError:  # an architecture transformers has no SDPA attention for (MPNet): eager
            module = auto.from_config(config, dtype=dtype, attn_implementation="eager")
    missing, unexpected = module.load_state_dict(tensors, strict=False)
    module.tie_weights()
    missing = [n for n in missing if not any(n == m for m in _tied_names(module))]
    if missing or unexpected:
        raise ArtifactError(f"{weights} does not fit the model in config.json (missing {missing[:3]}, "
                            f"unexpected {unexpected[:3]})")
    return module.to(device).eval()


class TorchEncoderEngine:
    def __init__(self, folder: Path, manifest: Manifest, weights: Path, device: str = "cpu",
                 threads: int | None = None, label: str = "", keep_hidden: bool = False, graphs: bool | None = None):
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ArtifactError("this variant runs on CUDA; torch sees no CUDA device here")
        if self.device.type == "cpu" and threads:
            torch.set_num_threads(threads)  # torch's pool is the process's: every torch engine shares it
        self.task = manifest.task
        self.module = load_module(folder, manifest.task, weights, self.device)
        self.dtype = self.module.dtype
        self.name = label or f"torch-{self.device.type}"
        self.input_names = list(manifest.input_names)
        info = task_class(manifest.task).info
        self.task_outputs, self.per_token = list(info.output_names), info.per_token
        self.pooling: Pooling | None = (manifest.pooling or Pooling()) if manifest.task == "sentence-embeddings" else None
        self.keep_hidden = keep_hidden or self.pooling is None
        self.output_names = ([POOLED] if self.pooling else []) + (self.task_outputs if self.keep_hidden else [])
        hidden = int(getattr(self.module.config, "hidden_size", -1))
        self.output_shapes: dict[str, tuple[int, ...]] = {
            n: (-1, -1, hidden) if n == "last_hidden_state" else (-1, -1) for n in self.task_outputs}
        self.max_length = manifest.max_length
        use_graphs = self.device.type == "cuda" if graphs is None else graphs
        # per (batch, length) bucket: its replay, or None where the capture failed
        self._graphs: dict[tuple[int, int], Callable[[], dict[str, torch.Tensor]] | None] | None = {} if use_graphs else None
        self._static: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle() if use_graphs and self.device.type == "cuda" else None

    # -- running ---------------------------------------------------------------------------------
    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        rows, length = feeds["input_ids"].shape
        if self._graphs is not None:
            lengths = [n for n in GRAPH_LENGTHS if n < self.max_length] + [self.max_length]
            batch, width = _bucket(rows, GRAPH_BATCHES), _bucket(length, lengths)
            if batch is not None and width is not None:
                return self._run_bucket(feeds, (batch, width))
        inputs = {n: torch.from_numpy(np.ascontiguousarray(feeds[n])).to(self.device) for n in self.input_names}
        with torch.inference_mode():
            outputs = self._forward(inputs)
        return {n: v.float().cpu().numpy() for n, v in outputs.items()}

    def _forward(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = self.module(**inputs, return_dict=True)
        result: dict[str, torch.Tensor] = {}
        if self.pooling is not None:
            result[POOLED] = pool(out["last_hidden_state"], inputs["attention_mask"], self.pooling)
        if self.keep_hidden:
            result.update({n: out[n] for n in self.task_outputs})
        return result

    def _run_bucket(self, feeds: dict[str, np.ndarray], bucket: tuple[int, int]) -> dict[str, np.ndarray]:
        """Run padded to ``bucket``: its CUDA graph's replay (captured now if new), or eagerly where
        the capture failed. On the CPU (``graphs=True``: tests) the replay is the same forward on
        the same static buffers, run eagerly."""
        rows, length = feeds["input_ids"].shape
        assert self._graphs is not None  # run() buckets only with graphs on
        if bucket not in self._graphs:
            self._graphs[bucket] = self._capture(bucket)
        replay = self._graphs[bucket]
        padded = self._padded(feeds, bucket)
        if replay is None:  # its capture failed
            with torch.inference_mode():
                outputs = self._forward(padded)
        else:
            for n, tensor in padded.items():
                self._static[bucket][n].copy_(tensor, non_blocking=True)
            outputs = replay()
        return {n: (v[:rows, :length] if self.per_token and n != POOLED else v[:rows]).float().cpu().numpy()
                for n, v in outputs.items()}

    def _padded(self, feeds: dict[str, np.ndarray], bucket: tuple[int, int]) -> dict[str, torch.Tensor]:
        """Inputs padded to ``bucket``: padding positions masked, padding rows attending to their first token."""
        rows, length = feeds["input_ids"].shape
        padded = {}
        for n in self.input_names:
            array = np.zeros(bucket, dtype=np.int64)
            array[:rows, :length] = feeds[n]
            if n == "attention_mask":
                array[rows:, 0] = 1
            padded[n] = torch.from_numpy(array).to(self.device, non_blocking=True)
        return padded

    def _capture(self, bucket: tuple[int, int]) -> Callable[[], dict[str, torch.Tensor]] | None:
        static = {n: torch.zeros(bucket, dtype=torch.long, device=self.device) for n in self.input_names}
        static["attention_mask"][:, 0] = 1
        self._static[bucket] = static
        if self.device.type != "cuda":
            def eager() -> dict[str, torch.Tensor]:
                with torch.inference_mode():
                    return self._forward(static)
            return eager
        try:  # pragma: no cover - CUDA
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), torch.inference_mode():  # the first runs allocate outside the graph
                for _ in range(2):
                    self._forward(static)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool), torch.inference_mode():
                outputs = self._forward(static)
        except Exception as exc:  # noqa: BLE001 - a module that syncs or branches on values cannot be captured
            log.warning("encoder bucket %s runs eagerly: CUDA graph capture failed (%s)", bucket, str(exc).splitlines()[0])
            return None

        def replay() -> dict[str, torch.Tensor]:  # pragma: no cover - CUDA
            graph.replay()
            return outputs
        return replay


def pool(hidden: torch.Tensor, mask: torch.Tensor, pooling: Pooling) -> torch.Tensor:
    """tasks/embeddings.py's ``pool`` on the device, in fp32: hidden [n, seq, d], mask [n, seq] → [n, d]."""
    hidden = hidden.float()
    weights = mask.to(hidden.dtype)
    if pooling.mode == "cls":
        pooled = hidden[:, 0]
    elif pooling.mode == "max":
        pooled = hidden.masked_fill(weights[:, :, None] == 0, float("-inf")).amax(dim=1)
    else:
        pooled = torch.einsum("nsd,ns->nd", hidden, weights) / weights.sum(dim=1, keepdim=True).clamp(min=1e-9)
    if pooling.normalize:
        pooled = pooled / pooled.norm(dim=1, keepdim=True).clamp(min=1e-12)
    return pooled


def _bucket(n: int, sizes: Any) -> int | None:
    return next((s for s in sizes if s >= n), None)


def _tied_names(module: Any) -> list[str]:
    """Parameter names that share their tensor with another name (tied weights: written once)."""
    seen: dict[int, str] = {}
    tied = []
    for name, tensor in module.state_dict(keep_vars=True).items():
        if tensor.data_ptr() in seen:
            tied.append(name)
        seen.setdefault(tensor.data_ptr(), name)
    return tied


@contextlib.contextmanager
def _no_init_weights() -> Any:
    """Skip the random initialisation the weights file overwrites (transformers 5, then 4's place)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        try:
            from transformers.modeling_utils import no_init_weights  # type: ignore[attr-defined, no-redef]  # transformers 4's place
        except ImportError:
            no_init_weights = contextlib.nullcontext  # type: ignore[assignment]  # neither has it: initialise, then overwrite
    with no_init_weights():
        yield
