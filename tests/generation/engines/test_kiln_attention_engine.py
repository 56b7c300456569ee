"""The serving engine on a serving graph built with KilnAttention (native/attention.c) instead of
GroupQueryAttention: the tiny Llama's fp32 weights, the same logits as GroupQueryAttention's graph
within float rounding, and every position's logits the same bits however its tokens were fed:
decode steps one token at a time, prefill chunks of any length, several sequences in one call."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from modelkiln.generation.engines.onnx.serving import ServingEngine
from modelkiln.generation.engines.registry import EngineOptions
from modelkiln.generation.model import TextGenerationModel
from modelkiln.native import library_path

pytestmark = pytest.mark.skipif(library_path() is None, reason="the native library is not built on this machine")

PROMPT = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 3, 9]


@pytest.fixture(scope="module")
def tiny(tiny_generation_artifact):
    return TextGenerationModel(tiny_generation_artifact)


@pytest.fixture(scope="module", params=["f32", "f16"])
def kiln_graph(request, tiny_kiln_attention_graph, tiny_kiln_attention_graph_f16):
    """The graph with a KV cache of floats, and of halves (KilnAttentionF16)."""
    return tiny_kiln_attention_graph_f16 if request.param == "f16" else tiny_kiln_attention_graph


@pytest.fixture
def engine(tiny, kiln_graph, tiny_kiln_attention_graph_f16) -> ServingEngine:
    made = tiny.engine_for_file(kiln_graph, EngineOptions(threads=2, max_rows=8))
    assert isinstance(made, ServingEngine) and made.kiln_attention and made.min_rows == 1
    assert made.shape.key_blocks  # the graph keeps its keys in blocks (graph_io.KEY_CACHE_KEY)
    assert made.shape.halves == (kiln_graph == tiny_kiln_attention_graph_f16)
    assert made.running.all.dtype == (np.float16 if made.shape.halves else np.float32)
    return made


def feed(engine: ServingEngine, seq: str, chunks: list[int], steps: int) -> list[np.ndarray]:
    """Prefill PROMPT in chunks of these sizes (every position's logits), then greedy decode steps;
    the logits of every position, in order."""
    seen, start = [], 0
    for n in chunks:
        seen.extend(engine.prefill(seq, PROMPT[start:start + n], all_logits=True).copy())
        start += n
    engine.join(seq)
    for _ in range(steps):
        seen.append(engine.step({seq: int(np.argmax(seen[-1]))})[0].copy())
    engine.remove(seq)
    return seen


def test_the_same_logits_as_group_query_attention_within_rounding(tiny, engine):
    """Within float rounding with a cache of floats; within the halves' rounding (2^-11) of keys and values."""
    reference = tiny.engine("fp32", EngineOptions(threads=2))
    assert not reference.kiln_attention
    atol, rtol = (2e-3, 0.0) if engine.shape.halves else (1e-4, 1e-4)  # halves measured: 7.6e-4 on logits up to 5
    np.testing.assert_allclose(engine.prefill("a", PROMPT, all_logits=True),
                               reference.prefill("a", PROMPT, all_logits=True), atol=atol, rtol=rtol)


def test_every_position_is_the_same_bits_decoded_or_in_chunks_of_any_length(engine):
    """A position's logits computed in a decode step, or as a prompt chunk's token of any length."""
    n = len(PROMPT)
    decoded = feed(engine, "one-by-one", [1] * n, 6)
    for size in (2, 3, 4, 5, 7, 16, 17, n):
        chunks = [size] * (n // size) + ([n % size] if n % size else [])
        assert all(np.array_equal(a, b) for a, b in zip(decoded, feed(engine, ("chunks", size), chunks, 6))), size


def test_a_sequence_is_the_same_bits_among_other_sequences(engine):
    """Several first chunks in one call (padded), then decode steps beside other rows that join and leave."""
    alone = feed(engine, "alone", [len(PROMPT)], 5)
    others = [[7, 8, 9], list(range(60, 90)), [5]]
    first = engine.prefill_first([("x", PROMPT[:9]), *[(f"o{i}", ids) for i, ids in enumerate(others)]])
    assert np.array_equal(first[0], alone[8])
    last = engine.prefill("x", PROMPT[9:])
    for i in range(len(others)):
        engine.join(f"o{i}")
    engine.join("x")
    seen = [last]
    for step in range(5):
        if step == 2:
            engine.remove("o1")
        tokens = {seq: 11 for seq in engine.rows}
        tokens["x"] = int(np.argmax(seen[-1]))
        seen.append(engine.step(tokens)[engine.rows.index("x")].copy())
    assert all(np.array_equal(a, b) for a, b in zip(alone[len(PROMPT) - 1:], seen))


def test_a_graph_written_before_key_blocks_keeps_its_layout_and_its_bits(tiny, kiln_graph, engine, tmp_path):
    """The same graph without the ``key_blocks`` attribute and its metadata (as written before them):
    its engine keeps the keys position-major, and every logit is the same bits."""
    import onnx

    from modelkiln.generation.engines.onnx import graph_io as io

    model = onnx.load(str(kiln_graph), load_external_data=False)
    for node in model.graph.node:
        if node.op_type == "KilnAttention":
            kept = [a for a in node.attribute if a.name != "key_blocks"]
            del node.attribute[:]
            node.attribute.extend(kept)
    kept_metadata = [m for m in model.metadata_props if m.key != io.KEY_CACHE_KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(kept_metadata)
    old = tmp_path / kiln_graph.name
    onnx.save_model(model, str(old))
    shutil.copy(kiln_graph.parent / (kiln_graph.name + ".data"), tmp_path)
    before = tiny.engine_for_file(old, EngineOptions(threads=2, max_rows=8))
    assert before.kiln_attention and not before.shape.key_blocks
    for chunks in ([len(PROMPT)], [5, 11, len(PROMPT) - 16]):
        got, expected = feed(before, "old", chunks, 20), feed(engine, "new", chunks, 20)
        assert all(np.array_equal(a, b) for a, b in zip(got, expected)), chunks
