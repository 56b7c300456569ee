"""kiln's torch engines against PyTorch on one device, in one run, the backends interleaved round by
round (a burst of load elsewhere hits them alike):

encoder (all-MiniLM-L6-v2): batch 1 × 128 tokens, model only (ids in, vectors out) and text → vector
(tokenizing included); batch 64 and 256 × 128, sequences/s;
decoder (SmolLM2-135M): one stream's decode tokens/s; 64 and 256 streams' output tokens/s (kiln:
continuous batching through its engine core; PyTorch: one ``generate`` over the whole batch); the time
to the first token of a 512-token prompt; answers changed by load (greedy tokens of 8 prompts alone vs
among 56 others);
backends: kiln's torch engine, eager PyTorch (transformers, SDPA), and PyTorch's best recipe
(transformers' static KV cache with its ``torch.compile``d decode step; encoders: ``torch.compile``
with CUDA graphs, ``mode="reduce-overhead"``);
and ``kiln serve`` over HTTP: one client's p50 of an embedding of one sentence and of a 16-token
completion; 256 clients streaming 128-token answers over SSE (output tokens/s, to set against the
engine's in-process 256 streams), with ``--workers 1`` and ``--workers 4`` (an engine process, 4 fronts).

    python benchmarks/gpu/torch_engines.py --device cuda --out benchmarks/results/gpu-torch-engines.json
    python benchmarks/gpu/torch_engines.py --device cpu --tiny      # checks the script; its figures mean nothing

The real weights are used when installed (``make install`` puts all-MiniLM-L6-v2 and SmolLM2's GGUF in
the venv); otherwise random weights of the same configurations (the speed is the same; ``answers
changed`` then compares random models' tokens). ``--tiny`` takes tiny configurations instead. The
artifacts are written without the conversion gate (``kiln convert --engine torch`` gates them: run it
separately, docs/gpu.md). Prints the device, and a table; ``--out`` writes the figures as JSON."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks" / "generation"))  # sse_front's load of SSE streams

from modelkiln.convert.generation.torch_weights import save_weights, variant_name, weights_file, torch_dtype  # noqa: E402
from modelkiln.manifest import Manifest, Pooling, TokenizerSpec, Variant  # noqa: E402
from modelkiln.samples import SAMPLE_TEXTS  # noqa: E402

LONG_TEXT = " ".join(SAMPLE_TEXTS * 8)


# --- models: the real ones when installed, else random weights of their configurations -----------------------


def given_folder(given: Path, work: Path, name: str, auto: Any) -> tuple[Path, str]:
    """A model folder named on the command line: as it is when it holds weights, else its configuration
    with random weights and its tokenizer files (a folder small enough to copy onto a GPU machine)."""
    if any(given.glob("*.safetensors")) or any(given.glob("*.bin")):
        return given, f"{given.name} (its weights)"
    import transformers as tf

    folder = work / name
    folder.mkdir(parents=True, exist_ok=True)
    for file in given.iterdir():
        if file.is_file():
            (folder / file.name).write_bytes(file.read_bytes())
    torch.manual_seed(0)
    getattr(tf, auto).from_config(tf.AutoConfig.from_pretrained(given)).save_pretrained(folder)
    return folder, f"{given.name}'s configuration and tokenizer (random weights)"


def encoder_folder(work: Path, tiny: bool, given: Path | None = None) -> tuple[Path, str]:
    import transformers as tf

    from modelkiln.embedded import embedded_model_path
    from modelkiln.errors import KilnError

    if given is not None:
        return given_folder(given, work, "minilm", "AutoModel")
    if not tiny:
        try:
            return embedded_model_path("all-MiniLM-L6-v2"), "all-MiniLM-L6-v2 (real weights)"
        except KilnError:  # not installed: its configuration with random weights
            pass
    folder = work / "minilm"
    tokenizer = _wordpiece(folder)
    size = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64) if tiny else \
        dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536)
    torch.manual_seed(0)
    model = tf.BertModel(tf.BertConfig(vocab_size=30522 if not tiny else tokenizer.get_vocab_size(),
                                       max_position_embeddings=512, **size))
    model.save_pretrained(folder)
    return folder, "tiny BERT (random)" if tiny else "all-MiniLM-L6-v2's configuration (random weights)"


def decoder_folder(work: Path, tiny: bool, given: Path | None = None) -> tuple[Path, str]:
    import transformers as tf

    from modelkiln.embedded import embedded_model_path
    from modelkiln.errors import KilnError

    if given is not None:
        return given_folder(given, work, "smollm2", "AutoModelForCausalLM")
    folder = work / "smollm2"
    if not tiny:
        try:
            gguf = embedded_model_path("SmolLM2-135M-Instruct")
        except KilnError:  # not installed: its configuration with random weights
            gguf = None
        if gguf is not None:
            model = tf.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
            tf.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(folder)
            model.save_pretrained(folder)
            return folder, "SmolLM2-135M-Instruct (real weights, from its Q4_1 GGUF)"
    _byte_bpe(folder)
    size = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2) \
        if tiny else dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                          num_key_value_heads=3)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=49152 if not tiny else 400, max_position_embeddings=8192,
                                               rope_theta=100000.0, tie_word_embeddings=True, eos_token_id=2, **size))
    model.save_pretrained(folder)
    return folder, "tiny Llama (random)" if tiny else "SmolLM2-135M's configuration (random weights)"


def _wordpiece(folder: Path) -> Any:
    from tokenizers import BertWordPieceTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    tok = BertWordPieceTokenizer(lowercase=True)
    tok.train_from_iterator(list(SAMPLE_TEXTS), vocab_size=400, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    tok.save(str(folder / "tokenizer.json"))
    return tok


def _byte_bpe(folder: Path) -> None:
    from tokenizers import ByteLevelBPETokenizer

    folder.mkdir(parents=True, exist_ok=True)
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(list(SAMPLE_TEXTS), vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.save(str(folder / "tokenizer.json"))


# --- artifacts written as `kiln convert --engine torch` writes them (without its gate) -------------------------


def write_artifact(source: Path, out: Path, task: str, precision: str, device: str) -> Path:
    import transformers as tf

    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_bytes((source / "tokenizer.json").read_bytes())
    config = tf.AutoConfig.from_pretrained(source)
    config.to_json_file(str(out / "config.json"))
    auto = tf.AutoModelForCausalLM if task == "text-generation" else tf.AutoModel
    save_weights(auto.from_pretrained(source, dtype=torch.float32), out / weights_file(precision), precision)
    variant = Variant(variant_name(precision), precision, device, weights_file(precision), True, engine="torch")
    if task == "text-generation":
        heads = config.num_attention_heads
        generation = {"eos_token_ids": [int(config.eos_token_id or 0)], "chat_template": None, "special_tokens": {},
                      "max_context": config.max_position_embeddings, "defaults": {"max_new_tokens": 128},
                      "layers": config.num_hidden_layers, "heads": heads, "kv_heads": config.num_key_value_heads,
                      "head_dim": config.hidden_size // heads, "default_variant": variant.name, "graph": {"kind": "torch"}}
        manifest = Manifest(out.name, task, ["input_ids"], ["logits"], config.max_position_embeddings,
                            TokenizerSpec(pad_token="<|endoftext|>", pad_token_id=0), [variant], generation=generation)
    else:
        manifest = Manifest(out.name, task, ["input_ids", "attention_mask", "token_type_ids"], ["last_hidden_state"],
                            min(512, config.max_position_embeddings), TokenizerSpec(), [variant],
                            pooling=Pooling("mean", True))
    manifest.save(out)
    return out


# --- timing -------------------------------------------------------------------------------------------------------


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: str, runs: int) -> float:
    """Median seconds of ``runs`` calls (after one warm-up call)."""
    fn()
    sync(device)
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        sync(device)
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


class Figures:
    """name → samples, one per round; reported as medians."""

    def __init__(self) -> None:
        self.samples: dict[tuple[str, str], list[float]] = {}

    def add(self, backend: str, figure: str, value: float) -> None:
        self.samples.setdefault((figure, backend), []).append(value)
        print(f"  {figure} [{backend}]: {value:.2f}", flush=True)  # as it comes: a run cut short still says

    def medians(self) -> dict[str, dict[str, float]]:
        table: dict[str, dict[str, float]] = {}
        for (figure, backend), values in self.samples.items():
            table.setdefault(figure, {})[backend] = round(statistics.median(values), 3)
        return table


# --- encoders -----------------------------------------------------------------------------------------------------


class EncoderBackends:
    """kiln's torch engine, eager PyTorch and torch.compile on the same weights and inputs."""

    def __init__(self, artifact: Path, source: Path, device: str, precision: str, compile_: bool):
        import transformers as tf
        from tokenizers import Tokenizer

        from modelkiln.runtime.pipeline import load_pipeline

        self.device = device
        self.pipeline = load_pipeline(artifact, device=device)
        self.tokenizer = Tokenizer.from_file(str(artifact / "tokenizer.json"))
        self.tokenizer.enable_truncation(128)
        dtype = torch_dtype(precision)
        self.eager = tf.AutoModel.from_pretrained(source, dtype=dtype, attn_implementation="sdpa").to(device).eval()
        self.compiled = torch.compile(self.eager, mode="reduce-overhead" if device == "cuda" else "default") if compile_ else None
        ids = self.tokenizer.encode(LONG_TEXT).ids[:128]
        self.ids = np.asarray([ids + [0] * (128 - len(ids))], dtype=np.int64)

    def feeds(self, batch: int) -> dict[str, np.ndarray]:
        ids = np.repeat(self.ids, batch, axis=0)
        return {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}

    def kiln(self, batch: int) -> Callable[[], Any]:
        feeds = self.feeds(batch)
        return lambda: self.pipeline.engine.run(feeds)

    def torch_model(self, batch: int, compiled: bool) -> Callable[[], Any]:
        module = self.compiled if compiled else self.eager
        feeds = self.feeds(batch)

        def run() -> np.ndarray:
            inputs = {k: torch.from_numpy(v).to(self.device) for k, v in feeds.items()}
            with torch.inference_mode():
                hidden = module(**inputs).last_hidden_state.float()
                mask = inputs["attention_mask"].unsqueeze(-1).float()
                pooled = (hidden * mask).sum(1) / mask.sum(1)
                return torch.nn.functional.normalize(pooled, dim=-1).cpu().numpy()
        return run

    def text_kiln(self) -> Callable[[], Any]:
        return lambda: self.pipeline([LONG_TEXT])

    def text_torch(self, compiled: bool) -> Callable[[], Any]:
        module = self.compiled if compiled else self.eager

        def run() -> np.ndarray:
            ids = self.tokenizer.encode(LONG_TEXT).ids
            tensor = torch.tensor([ids], device=self.device)
            with torch.inference_mode():
                hidden = module(input_ids=tensor, attention_mask=torch.ones_like(tensor)).last_hidden_state.float()
                return torch.nn.functional.normalize(hidden.mean(1), dim=-1).cpu().numpy()
        return run


def measure_encoders(enc: EncoderBackends, figures: Figures, runs: int, compile_: bool) -> None:
    backends = [("kiln torch", None), ("pytorch eager", False)] + ([("pytorch compiled", True)] if compile_ else [])
    for name, compiled in backends:
        one = enc.kiln(1) if compiled is None else enc.torch_model(1, compiled)
        figures.add(name, "encoder b1x128 model ms", timed(one, enc.device, runs) * 1000)
        text = enc.text_kiln() if compiled is None else enc.text_torch(compiled)
        figures.add(name, "encoder b1x128 text->vector ms", timed(text, enc.device, runs) * 1000)
        for batch in (64, 256):
            fn = enc.kiln(batch) if compiled is None else enc.torch_model(batch, compiled)
            figures.add(name, f"encoder b{batch}x128 seq/s", batch / timed(fn, enc.device, max(2, runs // 4)))


# --- decoders -----------------------------------------------------------------------------------------------------


def prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, length).tolist() for _ in range(count)]


class KilnDecoder:
    ROW_TOKENS = 1024  # KV per row: the longest sequence here is 512 + 1 (its cache is allocated up front on CUDA)

    def __init__(self, artifact: Path, device: str, streams: int):
        from modelkiln.generation.model import CoreOptions, TextGenerationModel

        self.model = TextGenerationModel(artifact)
        self.device = device
        self.core = self.model.core(None, CoreOptions(device=device, max_running=streams, warm_up=True,
                                                      kv_budget=streams * self.ROW_TOKENS))

    def run(self, batch: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]], float]:
        """(seconds, tokens per prompt, seconds to the first token of the first prompt)"""
        from modelkiln.generation.core import Request, greedy, run_to_completion

        started = time.perf_counter()
        first = None
        tokens: dict[int, list[int]] = {i: [] for i in range(len(batch))}
        for output in run_to_completion(self.core, [Request(i, p, greedy(new_tokens)) for i, p in enumerate(batch)]):
            if output.error is not None:
                raise output.error
            tokens[output.request_id].append(output.delta.token_id)
            if first is None:
                first = time.perf_counter() - started
        return time.perf_counter() - started, [tokens[i] for i in range(len(batch))], first or 0.0


class TorchDecoder:
    """transformers' generate: eager (dynamic cache) or its best recipe (static cache, compiled decode step)."""

    def __init__(self, source: Path, device: str, precision: str, compiled: bool):
        import transformers as tf

        self.device = device
        self.model = tf.AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype(precision),
                                                            attn_implementation="sdpa").to(device).eval()
        self.extra: dict[str, Any] = {}
        if compiled:
            config = tf.CompileConfig(fullgraph=True, mode="reduce-overhead" if device == "cuda" else "default")
            if device != "cuda":  # transformers compiles the decode step on accelerators only; asked for the CPU check
                config._compile_all_devices = True
            self.extra = {"cache_implementation": "static", "compile_config": config}

    def run(self, batch: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]], float]:
        ids = torch.tensor(batch, device=self.device)
        with torch.inference_mode():
            sync(self.device)
            started = time.perf_counter()
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                      min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, **self.extra)
            sync(self.device)
        return time.perf_counter() - started, out[:, ids.shape[1]:].tolist(), float("nan")

    def first_token(self, prompt: list[int]) -> float:
        return self.run([prompt], 1)[0]


def measure_decoders(backends: dict[str, Any], figures: Figures, args: argparse.Namespace, vocab: int, round_: int) -> None:
    new = args.new_tokens
    for name, backend in backends.items():
        one = prompts(1, 128, vocab, 100 + round_)
        total, _, first = backend.run(one, new)
        if isinstance(backend, KilnDecoder):
            first_token = first
        else:
            first_token = backend.first_token(one[0])
        figures.add(name, "decoder 1 stream decode tok/s", (new - 1) / max(total - first_token, 1e-9))
        for streams in args.streams:
            seconds, _, _ = backend.run(prompts(streams, 128, vocab, 1000 + round_), new)
            figures.add(name, f"decoder {streams} streams output tok/s", streams * new / seconds)
        long_prompt = prompts(1, args.ttft_prompt, vocab, 2000 + round_)
        ttft = backend.run(long_prompt, 1)[0] if isinstance(backend, KilnDecoder) else backend.first_token(long_prompt[0])
        figures.add(name, f"decoder TTFT {args.ttft_prompt}-token prompt ms", ttft * 1000)
        # answers changed by load: 8 prompts alone, then among 56 others (the same lengths: no padding for generate)
        probe = prompts(8, 128, vocab, 3000)
        alone = [backend.run([p], 32)[1][0] for p in probe]
        crowd = backend.run(probe + prompts(56, 128, vocab, 4000 + round_), 32)[1][:8]
        figures.add(name, "decoder answers changed by load (of 8)", sum(a != b for a, b in zip(alone, crowd)))


# --- kiln serve ---------------------------------------------------------------------------------------------------


def measure_serve(encoder: Path, decoder: Path, device: str, requests: int, streams: int, new_tokens: int,
                  vocab: int, workers: list[int]) -> dict[str, float]:
    """kiln serve over HTTP: one client's embedding and 16-token completion (one process), then
    ``streams`` clients streaming ``new_tokens``-token answers to 128-token prompts over SSE (output
    tokens/s, ``sse_front.python_sse_load``) with each of ``workers`` (N > 1: the engine process and N
    fronts), to set against the engine's in-process figure at as many streams."""
    figures: dict[str, float] = {}
    for count in workers:
        with _kiln_serve([f"emb={encoder}", f"gen={decoder}", "--device", device, "--workers", str(count),
                          "--max-batch-size", str(max(32, streams))]) as url:
            if count == 1:
                figures.update(_one_client(url, requests))
            if streams:
                from sse_front import python_sse_load

                prompt = prompts(1, 128, vocab, 99)[0]
                body = {"model": "gen", "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
                python_sse_load(url + "/v1/completions", body, streams, 3, processes=4)  # warm: graphs, connections
                tokens_s = python_sse_load(url + "/v1/completions", body, streams, 10, processes=4)
                figures[f"serve {streams} streams SSE tok/s (--workers {count})"] = round(tokens_s, 1)
    return figures


def _one_client(url: str, requests: int) -> dict[str, float]:
    import httpx

    with httpx.Client(base_url=url, timeout=60) as client:
        def one(path: str, body: dict) -> float:
            started = time.perf_counter()
            client.post(path, json=body).raise_for_status()
            return time.perf_counter() - started

        embed = [one("/v1/embeddings", {"model": "emb", "input": SAMPLE_TEXTS[0]}) for _ in range(requests)]
        complete = [one("/v1/completions", {"model": "gen", "prompt": SAMPLE_TEXTS[1], "max_tokens": 16,
                                            "temperature": 0, "ignore_eos": True}) for _ in range(max(4, requests // 4))]
    return {"serve embedding p50 ms (1 client)": round(statistics.median(embed[2:]) * 1000, 3),
            "serve 16-token completion p50 ms (1 client)": round(statistics.median(complete[1:]) * 1000, 3)}


@contextlib.contextmanager
def _kiln_serve(arguments: list[str]) -> Iterator[str]:
    """``kiln serve`` with these arguments on a free port, ready; its URL."""
    import subprocess

    from sse_front import wait_ready

    from modelkiln.net import free_port

    port = free_port()
    env = {**os.environ, "KILN_PORT": str(port), "KILN_GRPC_PORT": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "modelkiln", "serve", *arguments], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_ready(port, proc, timeout_s=600)  # a GPU's warm-up captures its graphs first
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=60)


# --- main ---------------------------------------------------------------------------------------------------------


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    from modelkiln.machine import cpu_description

    return str(cpu_description().get("cpu") or platform.processor())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="tiny configurations (checks the script on a CPU)")
    parser.add_argument("--precision", default=None, help="default: bf16 on cuda, fp32 on cpu")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runs", type=int, default=20, help="timed calls per encoder figure and round")
    parser.add_argument("--streams", default="64,256")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--ttft-prompt", type=int, default=512)
    parser.add_argument("--serve-requests", type=int, default=50)
    parser.add_argument("--serve-streams", type=int, default=256, help="SSE streams against kiln serve (0: none)")
    parser.add_argument("--serve-workers", default="1,4", help="kiln serve --workers for the SSE streams")
    parser.add_argument("--no-compile", action="store_true", help="leave out PyTorch's compiled recipe")
    parser.add_argument("--encoder", type=Path, default=None,
                        help="an encoder's model folder (default: all-MiniLM-L6-v2); config and tokenizer alone: random weights")
    parser.add_argument("--decoder", type=Path, default=None,
                        help="a decoder's model folder (default: SmolLM2-135M-Instruct); config and tokenizer alone: random weights")
    parser.add_argument("--models-only", type=Path, default=None, metavar="FOLDER",
                        help="write the two model folders (random weights where none) into FOLDER and stop")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.models_only:
        for folder, label in (encoder_folder(args.models_only, args.tiny, args.encoder),
                              decoder_folder(args.models_only, args.tiny, args.decoder)):
            print(f"{folder}: {label}")
        return
    args.streams = [int(s) for s in args.streams.split(",")]
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    precision = args.precision or ("bf16" if args.device == "cuda" else "fp32")
    compile_ = not args.no_compile
    print(f"device: {args.device} ({device_name(args.device)}); torch {torch.__version__}; precision {precision}", flush=True)
    with tempfile.TemporaryDirectory(prefix="kiln-gpu-bench-") as scratch:
        work = Path(scratch)
        enc_source, enc_label = encoder_folder(work, args.tiny, args.encoder)
        dec_source, dec_label = decoder_folder(work, args.tiny, args.decoder)
        print(f"encoder: {enc_label}\ndecoder: {dec_label}", flush=True)
        enc_artifact = write_artifact(enc_source, work / "emb", "sentence-embeddings", precision, args.device)
        dec_artifact = write_artifact(dec_source, work / "gen", "text-generation", precision, args.device)
        enc = EncoderBackends(enc_artifact, enc_source, args.device, precision, compile_)
        decoders: dict[str, Any] = {"kiln torch": KilnDecoder(dec_artifact, args.device, max(args.streams) + 8),
                                    "pytorch eager": TorchDecoder(dec_source, args.device, precision, compiled=False)}
        if compile_:
            decoders["pytorch compiled"] = TorchDecoder(dec_source, args.device, precision, compiled=True)
        vocab = decoders["pytorch eager"].model.config.vocab_size
        figures = Figures()
        started = time.perf_counter()  # a round not recorded: compilations, graph captures, first allocations
        measure_encoders(enc, Figures(), 2, compile_)
        measure_decoders(decoders, Figures(), args, vocab, -1)
        print(f"warm-up round: {time.perf_counter() - started:.0f}s", flush=True)
        for round_ in range(args.rounds):
            started = time.perf_counter()
            measure_encoders(enc, figures, args.runs, compile_)
            measure_decoders(decoders, figures, args, vocab, round_)
            print(f"round {round_ + 1}/{args.rounds}: {time.perf_counter() - started:.0f}s", flush=True)
            write(args, precision, enc_label, dec_label, figures, {})  # so far: a run cut short keeps its rounds
        del decoders, enc
        if args.device == "cuda":
            torch.cuda.empty_cache()
        serve = measure_serve(enc_artifact, dec_artifact, args.device, args.serve_requests, args.serve_streams,
                              args.new_tokens, vocab, [int(w) for w in args.serve_workers.split(",")])
    write(args, precision, enc_label, dec_label, figures, serve)
    table = figures.medians()
    width = max(len(f) for f in table)
    backends = ["kiln torch", "pytorch eager", "pytorch compiled"]
    print(f"\n{'figure':<{width}}  " + "  ".join(f"{b:>16}" for b in backends))
    for figure, row in table.items():
        print(f"{figure:<{width}}  " + "  ".join(f"{row.get(b, float('nan')):>16.2f}" for b in backends))
    for figure, value in serve.items():
        print(f"{figure:<{width}}  {value:>16.2f}")
    if args.out:
        print(f"wrote {args.out}")


def write(args: argparse.Namespace, precision: str, enc_label: str, dec_label: str, figures: Figures,
          serve: dict[str, float]) -> None:
    if args.out:
        rounds = min((len(v) for v in figures.samples.values()), default=0)
        args.out.write_text(json.dumps({"device": args.device, "device_name": device_name(args.device),
                                        "torch": torch.__version__, "precision": precision, "tiny": args.tiny,
                                        "encoder": enc_label, "decoder": dec_label, "rounds": rounds,
                                        "figures": figures.medians(), "serve": serve}, indent=2) + "\n")


if __name__ == "__main__":
    main()
