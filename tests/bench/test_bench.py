"""kiln bench and kiln eval on tiny artifacts (speed goals live in the README's recorded runs)."""

from __future__ import annotations

import json

from helpers import kiln
from modelkiln.bench.accuracy import evaluate_sts
from modelkiln.bench.runner import BenchConfig, make_feeds, run_bench
from modelkiln.manifest import Manifest


def test_bench_grid_covers_every_backend_and_cell(zoo, tmp_path):
    folder = zoo.artifact("bert", "sentence-embeddings")
    cfg = BenchConfig(batches=[1, 2], seqs=[8, 32], threads=1, warmup=1, min_iters=3, min_seconds=0.01)
    result = run_bench(str(folder), cfg, steps=lambda d: __import__("contextlib").nullcontext())
    kept = [f"onnxruntime {v.name}" for v in Manifest.load(folder).kept_variants()]
    backends = {c.backend for c in result.cells}
    assert backends == {"pytorch fp32", *kept}
    assert len(result.cells) == len(backends) * 4
    for c in result.cells:
        assert c.stats.iterations >= 3 and c.stats.min <= c.stats.median <= c.stats.max
        assert c.speedup is not None and c.speedup > 0
        assert abs(c.tokens_per_s - c.sequences_per_s * c.seq) < 1e-6 * c.tokens_per_s
    assert all(c.speedup == 1.0 for c in result.cells if c.backend == "pytorch fp32")


def test_bench_inputs_are_real_text_of_exact_length(zoo):
    folder = zoo.artifact("roberta", "text-classification")
    manifest = Manifest.load(folder)
    feeds = make_feeds(folder, manifest, batch=3, seq=40)
    assert set(feeds) == set(manifest.input_names)
    assert feeds["input_ids"].shape == (3, 40)
    ids = feeds["input_ids"][0]
    assert ids[0] == 0 and ids[-1] == 2  # <s> … </s>
    assert len(set(ids.tolist())) > 10  # real varied tokens, not padding


def test_bench_cli_writes_json_and_skips_too_long_sequences(zoo, tmp_path):
    folder = zoo.artifact("distilbert", "token-classification")
    res = kiln("bench", str(folder), "--batch", "1", "--seq", "16,4096", "--threads", "1", "--no-reference",
               "--min-iters", "3", "--min-seconds", "0.01", "--json", str(tmp_path / "b.json"))
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads((tmp_path / "b.json").read_text())
    assert {c["seq"] for c in data["cells"]} == {16}
    assert any("4096" in s for s in data["skipped"])
    assert "onnxruntime fp32" in res.stdout


def test_bench_rejects_a_bad_grid(zoo):
    res = kiln("bench", str(zoo.artifact("bert", "sentence-embeddings")), "--batch", "one")
    assert res.returncode == 2 and "error:" in res.stderr and "Traceback" not in res.stderr


def test_bench_rejects_an_unknown_variant(zoo):
    res = kiln("bench", str(zoo.artifact("bert", "sentence-embeddings")), "--variants", "nope", "--no-reference")
    assert res.returncode == 2 and "variant 'nope' is not in artifact" in res.stderr and "Traceback" not in res.stderr


def test_sts_eval_fp32_matches_pytorch(zoo):
    scores = evaluate_sts(zoo.artifact("bert", "sentence-embeddings"), None, threads=1, reference=True)
    by_name = {s.backend: s for s in scores}
    assert "pytorch fp32" in by_name and "onnxruntime fp32" in by_name
    assert abs(by_name["onnxruntime fp32"].delta) < 0.01
    assert -100 <= by_name["pytorch fp32"].spearman <= 100


def test_generation_bench_names_the_unit_this_process_ran_on(tiny_generation_artifact, tmp_path, monkeypatch):
    """Not the one convert recorded: an artifact converted without AMX and benched with KILN_AMX=1 (or the
    other way) would be mislabelled. Here the record says AMX; where KILN_AMX=1 is refused, a note says why."""
    import shutil

    from modelkiln import native
    from modelkiln.bench.generation import GenerationBenchConfig, run_generation_bench
    from modelkiln.generation.model import TextGenerationModel
    from modelkiln.machine import cpu_flags

    artifact = tmp_path / "art"
    shutil.copytree(tiny_generation_artifact, artifact)
    manifest = json.loads((artifact / "kiln.json").read_text())
    for v in manifest["variants"]:  # as a GGUF variant on kiln's operators records itself, converted with AMX on
        v.setdefault("details", {}).update(native_ops=native.LAYOUT, matrix_engine="AMX (8+ rows), VNNI")
    (artifact / "kiln.json").write_text(json.dumps(manifest))
    monkeypatch.setenv("KILN_AMX", "1")
    cfg = GenerationBenchConfig(prompt_lengths=[8], batches=[1], past=8, decode_steps=2, repeats=1, threads=1,
                                variants=["fp32"], reference=False, peers=[])
    result = run_generation_bench(TextGenerationModel(artifact), cfg)
    engines = {c.matrix_engine for c in result.cells}
    refusal = native.amx_refusal()
    if "amx_int8" in cpu_flags() and refusal is None:
        assert engines == {native.variant_matrix_engine({"native_ops": 2}, "fp32", "cpu")}
        assert all(e.startswith("AMX (8+ rows)") for e in engines)
    else:
        assert refusal and engines == {native.variant_matrix_engine({"native_ops": 2}, "fp32", "cpu")}
        assert not any(e.startswith("AMX") for e in engines)
        assert f"KILN_AMX=1: AMX refused ({refusal}); kiln's GGUF operators ran on {engines.pop()}" in result.notes
