"""`kiln generate`, and `kiln bench` / `kiln eval` on a text-generation artifact, as a user runs them
(real subprocesses, a tiny converted Llama with a chat template)."""

from __future__ import annotations

import json

import pytest

from helpers import kiln


@pytest.fixture(scope="module")
def artifact(tiny_generation_artifact):
    return tiny_generation_artifact


def test_generate_streams_the_answer(artifact):
    greedy = kiln("generate", str(artifact), "The quick brown fox", "-n", "12", "--threads", "1", "--ignore-eos")
    assert greedy.returncode == 0, greedy.stderr
    assert greedy.stdout.strip() and "12 generated (length)" in greedy.stderr
    as_json = kiln("generate", str(artifact), "The quick brown fox", "-n", "12", "--threads", "1", "--ignore-eos", "--json")
    result = json.loads(as_json.stdout)
    assert result["completion_tokens"] == 12 and result["finish_reason"] == "length"
    assert result["text"] == greedy.stdout[:-1]  # the streamed text, less the final newline


def test_generate_chat_seed_and_stop(artifact):
    args = [str(artifact), "Hello there", "--chat", "--system", "Be brief.", "-n", "16", "--threads", "1",
            "--temperature", "0.9", "--top-p", "0.9", "--seed", "3", "--ignore-eos", "--json"]
    first, second = (json.loads(kiln("generate", *args).stdout) for _ in range(2))
    assert first["text"] == second["text"] and first["prompt_tokens"] > 5  # the template added its markup
    if len(first["text"]) > 4:
        stop = first["text"][2:4]
        cut = json.loads(kiln("generate", *args, "--stop", stop).stdout)
        assert cut["finish_reason"] == "stop" and cut["text"] == first["text"][: first["text"].index(stop)]


def test_every_sampling_setting_is_an_option_of_kiln_generate(artifact):
    """The options come from the declaration: each setting's flag is there and reaches the sampler."""
    from modelkiln.generation.request.settings import SETTINGS

    shown = kiln("generate", "--help").stdout
    for setting in SETTINGS:
        flag = "--max-new-tokens" if setting.name == "max_tokens" else "--" + setting.name.replace("_", "-")
        assert flag in shown, flag
    args = [str(artifact), "Hello", "-n", "8", "--threads", "1", "--temperature", "1.0", "--seed", "5", "--json"]
    plain = json.loads(kiln("generate", *args).stdout)
    tuned = kiln("generate", *args, "--min-p", "0.2", "--top-k", "3", "--frequency-penalty", "0.5",
                 "--presence-penalty", "0.1", "--logit-bias", "7:1.5", "--stop-token-ids", "3")
    assert tuned.returncode == 0, tuned.stderr
    assert json.loads(tuned.stdout)["completion_tokens"] >= 1 and plain["completion_tokens"] >= 1
    bad = kiln("generate", *args, "--logit-bias", "seven")
    assert bad.returncode == 2 and "TOKEN_ID:BIAS" in bad.stderr and "Traceback" not in bad.stderr


def test_generate_errors_are_one_line(artifact, tmp_path):
    bad = kiln("generate", str(artifact), "hi", "--top-p", "7")  # named as the option, not the field
    assert bad.returncode == 2 and "--top-p must be in (0, 1], got 7.0" in bad.stderr and "Traceback" not in bad.stderr
    negative = kiln("generate", str(artifact), "hi", "--max-new-tokens", "-3")  # named as the option, not the field
    assert negative.returncode == 2 and "--max-new-tokens must be at least 1, got -3" in negative.stderr
    empty = kiln("generate", str(tmp_path), "hi")
    assert empty.returncode == 2 and "not a modelkiln artifact" in empty.stderr
    typo = kiln("generate", str(tmp_path / "smollm2.gguf"), "hi")  # a path that does not exist is named as such
    assert typo.returncode == 2 and f"{tmp_path / 'smollm2.gguf'}: no such file or folder" in typo.stderr


@pytest.mark.slow  # ~35 s on 2 shared cores: PyTorch is loaded twice
def test_bench_and_eval_on_a_generation_artifact(artifact, tmp_path):
    out = tmp_path / "bench.json"
    bench = kiln("bench", str(artifact), "--seq", "8,16", "--batch", "1,2", "--past", "8", "--threads", "1",
                 "--json", str(out))
    assert bench.returncode == 0, bench.stderr
    cells = json.loads(out.read_text())["cells"]
    backends = {c["backend"] for c in cells}
    kept = {f"onnxruntime {v['name']}" for v in json.loads((artifact / "kiln.json").read_text())["variants"] if v["kept"]}
    assert kept <= backends and any(b.startswith("pytorch") for b in backends)
    assert {(c["phase"], c["batch"], c["tokens"]) for c in cells if c["backend"] == "onnxruntime fp32"} == {
        ("prefill", 1, 8), ("prefill", 1, 16), ("decode", 1, 8), ("decode", 2, 8)}
    evaluation = kiln("eval", str(artifact), "--threads", "1")
    assert evaluation.returncode == 0, evaluation.stderr
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
            for line in evaluation.stdout.splitlines() if line.startswith("│")}
    assert set(rows) == {"pytorch fp32"} | kept
    assert rows["pytorch fp32"][0] == rows["onnxruntime fp32"][0]  # the same perplexity, to 3 decimals


def test_fp32_greedy_answers_equal_pytorch_on_squad_prompts(artifact):
    from modelkiln.bench.generation_backends import TorchBackend
    from modelkiln.bench.generation_eval import eval_inputs
    from modelkiln.generation.core import Request, complete
    from modelkiln.generation.model import CoreOptions, TextGenerationModel
    from modelkiln.generation.sampling import SamplingParams

    model = TextGenerationModel(artifact)
    _, _, prompts = eval_inputs(model, 0, 6, 256, 16)
    params = SamplingParams(max_new_tokens=16)
    torch_model = TorchBackend(model, 1)
    torch_answers = [torch_model.greedy_text(p, params, model) for p in prompts]
    ours = complete(model.core("fp32", CoreOptions(threads=1, max_running=4)), [Request(i, p, params) for i, p in enumerate(prompts)])
    assert len(prompts) == 6 and [c.text for c in ours] == torch_answers
