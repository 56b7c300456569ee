"""The attention forms of a serving graph on the same weights, timed in turns on the ONNX serving engine:

- an artifact whose graph has GroupQueryAttention: that graph against a copy whose attention nodes are
  swapped for KilnAttention (native/attention.c), its key cache in blocks (``key_blocks = 1``);
- an artifact whose graph has KilnAttention already: copies of that graph with each KV cache it can
  keep: floats with keys position-major (no ``key_blocks``, as graphs written before it), floats with
  keys in blocks, halves (KilnAttentionF16, keys in blocks).

The copy's weights file is linked, not copied.

    PYTHONPATH=src python benchmarks/generation/kiln_attention.py /work/art/llama1b --variant gguf \
        --prompt 1536 --streams 16 --rounds 2

Per graph: a prefill of ``--prompt`` random tokens in one call (tokens/s), then decode steps of
one stream after that prompt and of ``--streams`` streams of ``--stream-prompt``-token prompts
(tokens/s over every stream). The graphs run alternately ``--rounds`` times, so another load on
the machine falls on both; the table gives each round and the ratio of the best of each."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from modelkiln.machine import cpu_description


def linked_copy(folder: Path, variant_file: str, into: Path) -> None:
    """``folder``'s files but ``variant_file`` and kiln.json, hard-linked (onnxruntime refuses a weights
    file reached through a symbolic link out of the model's folder) or else copied."""
    into.mkdir(parents=True, exist_ok=True)
    for item in folder.iterdir():
        if item.name not in (variant_file, "kiln.json"):
            try:
                os.link(item, into / item.name)
            except OSError:
                shutil.copy(item, into / item.name)


def attention_of(folder: Path, variant_file: str) -> str:
    import onnx

    model = onnx.load(str(folder / variant_file), load_external_data=False)
    kiln = any(n.op_type in ("KilnAttention", "KilnAttentionF16") for n in model.graph.node)
    return "KilnAttention" if kiln else "GroupQueryAttention"


def cache_copy(folder: Path, variant_file: str, into: Path, key_blocks: bool, halves: bool) -> Path:
    """``folder`` with ``variant_file``'s KilnAttention nodes keeping another cache: keys position-major
    (no ``key_blocks``, as graphs written before it) or in blocks; floats or halves (KilnAttentionF16)."""
    import onnx
    from onnx import TensorProto, helper

    from modelkiln.generation.engines.onnx import graph_io as io

    linked_copy(folder, variant_file, into)
    model = onnx.load(str(folder / variant_file), load_external_data=False)
    for node in model.graph.node:
        if node.op_type in ("KilnAttention", "KilnAttentionF16"):
            node.op_type = "KilnAttentionF16" if halves else "KilnAttention"
            kept = [a for a in node.attribute if a.name != "key_blocks"]
            del node.attribute[:]
            node.attribute.extend(kept + ([helper.make_attribute("key_blocks", 1)] if key_blocks else []))
    for value in [*model.graph.input, *model.graph.output]:
        if value.name.startswith(("past_key_values.", "present.")):
            value.type.tensor_type.elem_type = TensorProto.FLOAT16 if halves else TensorProto.FLOAT
    kept_metadata = [m for m in model.metadata_props if m.key != io.KEY_CACHE_KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(kept_metadata)
    if key_blocks:
        model.metadata_props.add(key=io.KEY_CACHE_KEY, value=io.KEY_BLOCKS)
    onnx.save_model(model, str(into / variant_file))
    shutil.copy(folder / "kiln.json", into / "kiln.json")
    return into


def swapped_copy(folder: Path, variant_file: str, into: Path) -> Path:
    """``folder`` with ``variant_file``'s GroupQueryAttention nodes replaced by KilnAttention (q, k
    and v split from the packed projection; keys in blocks, as the graph writer makes them)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from modelkiln.generation.engines.onnx import graph_io as io
    from modelkiln.native import DOMAIN

    linked_copy(folder, variant_file, into)
    model = onnx.load(str(folder / variant_file), load_external_data=False)
    graph = model.graph
    nodes = []
    for node in graph.node:
        if node.op_type != "GroupQueryAttention":
            nodes.append(node)
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        heads, kv_heads = attrs["num_heads"], attrs["kv_num_heads"]
        q, k, v = node.input[:3]
        if not k:  # packed: split by the cache's head size
            past = next(i for i in graph.input if i.name == node.input[3])
            head_dim = past.type.tensor_type.shape.dim[3].dim_value
            sizes = f"{node.name}.split_sizes"
            graph.initializer.append(numpy_helper.from_array(
                np.asarray([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], np.int64), sizes))
            q, k, v = (f"{node.name}.{part}" for part in "qkv")
            nodes.append(helper.make_node("Split", [node.input[0], sizes], [q, k, v], name=f"{node.name}.split", axis=-1))
        nodes.append(helper.make_node("KilnAttention", [q, k, v, node.input[3], node.input[4], io.CACHE_ROWS, io.POSITIONS,
                                                        node.input[7], node.input[8]], list(node.output), name=node.name,
                                      domain=DOMAIN, num_heads=heads, kv_num_heads=kv_heads, key_blocks=1))
    del graph.node[:]
    graph.node.extend(nodes)
    inputs = [i for i in graph.input if i.name not in (io.SEQLENS_K, io.TOTAL_SEQUENCE_LENGTH)]
    places = [helper.make_tensor_value_info(name, TensorProto.INT64, ["batch", "sequence"]) for name in (io.CACHE_ROWS, io.POSITIONS)]
    del graph.input[:]
    graph.input.extend(inputs[:1] + places + inputs[1:])
    if DOMAIN not in [o.domain for o in model.opset_import]:
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    model.metadata_props.add(key=io.KEY_CACHE_KEY, value=io.KEY_BLOCKS)
    onnx.save_model(model, str(into / variant_file))
    manifest = json.loads((folder / "kiln.json").read_text())
    names = manifest.get("input_names", [])
    manifest["input_names"] = [n for n in names if n not in (io.SEQLENS_K, io.TOTAL_SEQUENCE_LENGTH)][:1] + \
        [io.CACHE_ROWS, io.POSITIONS] + [n for n in names if n not in (io.SEQLENS_K, io.TOTAL_SEQUENCE_LENGTH)][1:]
    (into / "kiln.json").write_text(json.dumps(manifest, indent=2))
    return into


def measure(folder: Path, variant: str, prompt: int, streams: int, stream_prompt: int, steps: int,
            threads: int) -> dict[str, float]:
    from modelkiln.generation.engines.registry import EngineOptions
    from modelkiln.generation.model import TextGenerationModel

    model = TextGenerationModel(folder)
    engine = model.engine(variant, EngineOptions(threads=threads, max_rows=max(streams, 1)))
    rng = np.random.default_rng(0)
    vocab = 1000  # token ids well inside any vocabulary
    ids = rng.integers(10, vocab, prompt).tolist()
    started = time.perf_counter()
    logits = engine.prefill("long", ids)
    prefill = prompt / (time.perf_counter() - started)
    engine.join("long")
    token = int(np.argmax(logits))
    started = time.perf_counter()
    for _ in range(steps):
        token = int(np.argmax(engine.step({"long": token})[0]))
    one = steps / (time.perf_counter() - started)
    engine.remove("long")
    for s in range(streams):
        engine.add(("s", s), rng.integers(10, vocab, stream_prompt).tolist())
    started = time.perf_counter()
    for _ in range(steps):
        engine.step({seq: 11 for seq in engine.rows})
    many = streams * steps / (time.perf_counter() - started)
    return {"prefill": prefill, "decode_1": one, f"decode_{streams}": many}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--variant", default="gguf")
    parser.add_argument("--prompt", type=int, default=1536)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--stream-prompt", type=int, default=64, help="tokens of each stream's prompt")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--work", type=Path, default=None, help="where the swapped copy is made (the artifact's file "
                        "system links instead of copying)")
    args = parser.parse_args()
    from modelkiln.generation.model import TextGenerationModel

    variant_file = TextGenerationModel(args.artifact)._chosen(args.variant, "cpu").file
    assert variant_file is not None
    work = Path(tempfile.mkdtemp(prefix="kiln-attention-", dir=args.work))
    try:
        copy = work / args.artifact.name
        if attention_of(args.artifact, variant_file) == "GroupQueryAttention":
            forms = [("GroupQueryAttention", args.artifact), ("KilnAttention", swapped_copy(args.artifact, variant_file, copy))]
        else:
            forms = [(name, cache_copy(args.artifact, variant_file, work / name.replace(" ", "-") / args.artifact.name,
                                       key_blocks, halves))
                     for name, key_blocks, halves in (("f32 keys position-major", False, False),
                                                      ("f32 keys in blocks", True, False), ("f16 keys in blocks", True, True))]
        cpu = cpu_description()
        print(f"{args.artifact} ({args.variant}), {cpu['cpu']} ({cpu['isa']}), {args.threads} threads, prompt "
              f"{args.prompt}, {args.streams} streams of {args.stream_prompt}-token prompts, {args.steps} steps")
        best: dict[str, dict[str, float]] = {}
        for round_ in range(args.rounds):
            for name, folder in forms[::-1 if round_ % 2 else 1]:
                got = measure(folder, args.variant, args.prompt, args.streams, args.stream_prompt, args.steps,
                              args.threads)
                print(f"  round {round_} {name:20s} " + "  ".join(f"{k} {v:8.1f} tok/s" for k, v in got.items()), flush=True)
                for key, value in got.items():
                    best.setdefault(name, {})[key] = max(best.get(name, {}).get(key, 0.0), value)
        old = forms[0][0]
        for new, _ in forms[1:]:
            print(f"  best ratio {new} / {old}: " + "  ".join(f"{k} {best[new][k] / best[old][k]:.2f}" for k in best[new]))
    finally:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
