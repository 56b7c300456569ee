"""The peer backends of the generation bench: PyTorch ``generate`` with its KV cache, llama.cpp
(through llama-cpp-python) on the GGUF file the artifact was converted from, and onnxruntime-genai's
Generator on the int4 model its own builder makes from the same weights. The bench runs each in a
child process (``generation.measure_peer``, started through bench/isolation.py).

PyTorch is timed inside ``generate`` itself: a logits processor records the time each token's
logits arrive, so prefill is the time to the first token and each decode step is the gap between
two tokens, generate's own loop and cache included."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..extras import install_hint
from ..generation.model import TextGenerationModel
from ..machine import cpu_flags

# llama.cpp's CMake switch for each vector extension, and the /proc/cpuinfo flag that must be there for it.
GGML_EXTENSIONS = (("GGML_AVX2", "avx2"), ("GGML_FMA", "fma"), ("GGML_F16C", "f16c"), ("GGML_AVX512", "avx512f"),
                   ("GGML_AVX512_VNNI", "avx512_vnni"), ("GGML_AVX512_BF16", "avx512_bf16"),
                   ("GGML_AVX512_VBMI", "avx512vbmi"))
GGML_AMX = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")


def llama_cpp_cmake_args(flags: set[str]) -> str:
    """CMake flags that build llama.cpp for a CPU with these /proc/cpuinfo ``flags``. Not llama.cpp's
    own -DGGML_NATIVE=ON: on a CPU with AMX that build turns on llama.cpp's AMX code, which crashed with
    SIGSEGV on this project's Xeons (llama-cpp-python in process and llama-server alike); llama-server
    built with each extension named and AMX off runs there. Empty for a CPU without AVX2 (llama.cpp's
    default build)."""
    if "avx2" not in flags:
        return ""
    args = ["-DGGML_NATIVE=OFF"] + [f"-D{option}=ON" for option, flag in GGML_EXTENSIONS if flag in flags]
    if any(flag.startswith("amx") for flag in flags):
        args += [f"-D{option}=OFF" for option in GGML_AMX]
    return " ".join(args)


def llama_cpp_install_hint(flags: set[str] | None = None) -> str:
    """How to install llama.cpp for the bench's llama.cpp row on this machine (or one with ``flags``)."""
    cmake_args = llama_cpp_cmake_args(cpu_flags() if flags is None else flags)
    prefix = f'CMAKE_ARGS="{cmake_args}" ' if cmake_args else ""
    return f"{prefix}{install_hint('llamacpp')} (compiles llama.cpp, minutes)"


def gguf_path(source: dict) -> str | None:
    """The GGUF file an artifact was converted from (its manifest's ``source``), if any."""
    model, name = str(source.get("model", "")), source.get("gguf_file")
    if model.endswith(".gguf"):
        return model
    return str(Path(model) / name) if name else None


def ort_genai_available() -> bool:
    try:
        return importlib.util.find_spec("onnxruntime_genai") is not None
    except (ImportError, ValueError):
        return False


def llama_cpp_available() -> bool:
    """Whether llama-cpp-python is installed, found without importing it (importing loads llama.cpp)."""
    try:
        return importlib.util.find_spec("llama_cpp") is not None
    except (ImportError, ValueError):
        return False


def drawing(sampled: bool) -> dict[str, Any]:
    """The peers' token choice (transformers' ``generate``, onnxruntime-genai's search options): greedy,
    or sampled as the bench's own rows draw (``kiln loadtest --sampled``'s settings), top-k off: each
    one's default of 50 would cut what the others keep."""
    if not sampled:
        return {"do_sample": False}
    from ..loadtest.streaming import SAMPLED

    return {"do_sample": True, "top_k": 0, **SAMPLED}


class TorchBackend:
    def __init__(self, model: TextGenerationModel, threads: int | None):
        import torch

        if threads:
            torch.set_num_threads(threads)
        self.torch = torch
        from ..convert.generation.sources import load_causal_lm
        from ..convert.source import load_source

        self.model = load_causal_lm(load_source(model.manifest.source["model"], with_tokenizer=False))
        self.pad_id = (model.eos_ids or [0])[0]

    def _token_times(self, prompts: list[list[int]], new_tokens: int, sampled: bool = False) -> tuple[float, list[float]]:
        torch = self.torch
        stamps: list[float] = []

        def stamp(input_ids: Any, scores: Any) -> Any:
            stamps.append(time.perf_counter())
            return scores

        ids = torch.tensor(prompts, dtype=torch.long)
        started = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, logits_processor=[stamp], pad_token_id=self.pad_id,
                                **drawing(sampled))
        return stamps[0] - started, [b - a for a, b in zip(stamps, stamps[1:])]

    def prefill_seconds(self, ids: list[int]) -> float:
        return self._token_times([ids], 1)[0]

    def decode_step_seconds(self, prompts: list[list[int]], steps: int, sampled: bool = False) -> list[float]:
        return self._token_times(prompts, steps + 2, sampled)[1][1:]  # the first gap is a warm-up

    # -- for kiln eval ---------------------------------------------------------------------
    def logits(self, ids: list[int]) -> Any:
        torch = self.torch
        with torch.inference_mode():
            return self.model(torch.tensor([ids], dtype=torch.long)).logits[0].float().numpy()

    def greedy_text(self, prompt_ids: list[int], params: Any, model: TextGenerationModel) -> str:
        """PyTorch's greedy answer, cut at the first stop string as the engine cuts it."""
        torch = self.torch
        ids = torch.tensor([prompt_ids], dtype=torch.long)
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=params.max_new_tokens,
                                      do_sample=False, eos_token_id=model.eos_ids or None, pad_token_id=self.pad_id)
        text = model.tokenizer.decode(out[0, len(prompt_ids):].tolist(), skip_special_tokens=True)
        cuts = [text.find(s) for s in params.stop if s in text]
        return text[: min(cuts)] if cuts else text


class LlamaCppBackend:
    batched = False  # llama-cpp-python's Llama evaluates one sequence

    def __init__(self, gguf: str, threads: int | None, context: int):
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(gguf), n_threads=threads or None, n_threads_batch=threads or None,
                         n_ctx=context, n_batch=512, verbose=False)

    def prefill_seconds(self, ids: list[int]) -> float:
        self.llm.reset()
        started = time.perf_counter()
        self.llm.eval(ids)
        return time.perf_counter() - started

    def decode_step_seconds(self, prompts: list[list[int]], steps: int, sampled: bool = False) -> list[float]:
        """The model's step alone (``eval`` of one token), greedy or sampled alike: no token is chosen."""
        self.llm.reset()
        self.llm.eval(prompts[0])
        token = prompts[0][-1]
        self.llm.eval([token])  # warm-up
        samples = []
        for _ in range(steps):
            started = time.perf_counter()
            self.llm.eval([token])
            samples.append(time.perf_counter() - started)
        return samples



class OrtGenaiBackend:
    """onnxruntime-genai 0.18's Generator (static batches on CPU) on the int4 model its own builder
    writes (``python -m onnxruntime_genai.models.builder -p int4 -e cpu``: it re-quantizes the weights,
    block 32, accuracy level 4) from the artifact's source model, dequantized to fp32 when that is a
    GGUF file. Built once per source into the cache folder (``model_cache.cache_root()``)."""

    def __init__(self, model: TextGenerationModel, threads: int | None):
        import onnxruntime_genai as og

        self.og = og
        folder = ort_genai_model(model.manifest.source["model"])
        config_path = folder / "genai_config.json"
        config = json.loads(config_path.read_text())
        options = config["model"]["decoder"].setdefault("session_options", {})
        if threads:
            options["intra_op_num_threads"] = threads
        config_path.write_text(json.dumps(config, indent=2))
        og_config = og.Config(str(folder))
        og_config.clear_providers()
        self.model = og.Model(og_config)
        self.pad_token_id = config["model"]["pad_token_id"]  # what its Generator takes for padding in a batch

    def _generator(self, prompts: list[list[int]], new_tokens: int, sampled: bool = False) -> Any:
        params = self.og.GeneratorParams(self.model)
        length = len(prompts[0]) + new_tokens + 2
        # min_length = max_length: no end-of-sequence stops a row early (a done generator returns at once
        # from generate_next_token, which would time nothing)
        params.set_search_options(max_length=length, min_length=length, batch_size=len(prompts),
                                  **drawing(sampled))
        return self.og.Generator(self.model, params)

    def prefill_seconds(self, ids: list[int]) -> float:
        generator = self._generator([ids], 1)
        started = time.perf_counter()
        generator.append_tokens(np.asarray([ids], dtype=np.int32))
        return time.perf_counter() - started

    def decode_step_seconds(self, prompts: list[list[int]], steps: int, sampled: bool = False) -> list[float]:
        generator = self._generator(prompts, steps + 1, sampled)
        generator.append_tokens(np.asarray(prompts, dtype=np.int32))
        generator.generate_next_token()  # warm-up
        samples = []
        for _ in range(steps):
            started = time.perf_counter()
            generator.generate_next_token()
            samples.append(time.perf_counter() - started)
        return samples


def ort_genai_model(source_model: str) -> Path:
    """The builder's int4 model of ``source_model``, built into the cache the first time."""
    import hashlib
    import os
    import subprocess
    import sys
    import tempfile

    stat = os.stat(source_model)
    key = hashlib.sha256(f"{os.path.realpath(source_model)}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    from ..model_cache import cache_root

    cache = cache_root() / "onnxruntime-genai" / key
    if (cache / "genai_config.json").is_file():
        return cache
    with tempfile.TemporaryDirectory(prefix="kiln-ort-genai-") as tmp:
        hf = hf_folder(source_model, Path(tmp) / "hf")
        out = Path(tmp) / "int4"
        built = subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out),
                                "-p", "int4", "-e", "cpu", "-c", str(Path(tmp) / "cache")],
                               capture_output=True, text=True)
        if built.returncode != 0:
            last = (built.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"onnxruntime-genai's builder failed: {last}")
        cache.parent.mkdir(parents=True, exist_ok=True)
        os.replace(out, cache) if not cache.exists() else None
    return cache


def hf_folder(source_model: str, folder: Path) -> Path:
    """A Hugging Face folder (fp32 safetensors, tokenizer) of the source, which the builder reads:
    a GGUF file is loaded dequantized by transformers and saved without its quantization config."""
    from ..convert.generation.sources import load_causal_lm
    from ..convert.source import load_source

    source = load_source(source_model)
    model = load_causal_lm(source)
    if source.gguf_file:
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        fresh = type(model)(type(model.config).from_dict(config))
        fresh.load_state_dict(model.state_dict())
        fresh.tie_weights()
        model = fresh
    model.save_pretrained(folder)
    source.tokenizer.save_pretrained(folder)
    return folder
