"""`kiln serve --speculate ngram` and `--speculate draft-model` end to end: the tiny Llama with its
fp32 variant's graph built with KilnAttention; answers (greedy and seeded sampled) equal those of
the same server without speculation, and /metrics counts the drafts under vLLM's names. The draft
model is the same artifact (drafting for itself: every greedy draft accepted)."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import openai
import pytest

from modelkiln.native import library_path
from generation_helpers import with_graph
from servers import Server

pytestmark = pytest.mark.skipif(library_path() is None, reason="the native library is not built on this machine")

MODEL = "tiny"
PROMPTS = ["one two three four one two three four one two", "The quick brown fox", "a b c a b c a b"]
SAMPLED = {"temperature": 0.8, "top_p": 0.95, "seed": 3, "frequency_penalty": 0.4}


@pytest.fixture(scope="module")
def kiln_attention_artifact(tiny_generation_artifact, tiny_kiln_attention_graph, tmp_path_factory):
    """The tiny artifact with its fp32 variant's graph (model.onnx) swapped for the KilnAttention one,
    its default variant (as a draft model's must be)."""
    return with_graph(tiny_generation_artifact, tiny_kiln_attention_graph,
                      tmp_path_factory.mktemp("speculation") / "tiny-kiln-attention")


def answers(server: Server, **fields) -> list[list[int]]:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    got = []
    for prompt in PROMPTS:
        answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32,
                                           extra_body={"ignore_eos": True, "return_token_ids": True, **fields})
        got.append(answer.choices[0].token_ids)  # type: ignore[attr-defined]
    return got


def serving(artifact) -> list[str]:
    return [f"{MODEL}={artifact}", "--variant", "fp32", "--threads", "2"]


@pytest.fixture(scope="module")
def plain_answers(kiln_attention_artifact) -> dict[str, list[list[int]]]:
    """The server's answers without speculation, greedy and seeded sampled: what every speculating one must give."""
    plain = Server(serving(kiln_attention_artifact))
    try:
        return {"greedy": answers(plain, temperature=0), "sampled": answers(plain, **SAMPLED)}
    finally:
        plain.stop()


def counter(server: Server, name: str) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(f'{name}_total{{model_name="{MODEL}"}}'):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


def test_speculating_server_answers_as_the_plain_one(kiln_attention_artifact, plain_answers):
    expected = plain_answers
    speculating = Server([*serving(kiln_attention_artifact), "--speculate", "ngram", "--draft-tokens", "4"])
    try:
        assert answers(speculating, temperature=0) == expected["greedy"]
        assert answers(speculating, **SAMPLED) == expected["sampled"]
        drafted = counter(speculating, "vllm:spec_decode_num_draft_tokens")
        accepted = counter(speculating, "vllm:spec_decode_num_accepted_tokens")
        assert counter(speculating, "vllm:spec_decode_num_drafts") > 0 and 0 < accepted <= drafted
    finally:
        speculating.stop()


def test_a_server_drafting_with_a_draft_model_answers_as_the_plain_one(kiln_attention_artifact, plain_answers):
    expected = plain_answers
    speculating = Server([*serving(kiln_attention_artifact), "--speculate", "draft-model", "--draft-model",
                          str(kiln_attention_artifact), "--draft-tokens", "4"])
    try:
        assert answers(speculating, temperature=0) == expected["greedy"]
        drafted = counter(speculating, "vllm:spec_decode_num_draft_tokens")
        accepted = counter(speculating, "vllm:spec_decode_num_accepted_tokens")
        assert drafted > 0 and accepted == drafted  # its own greedy tokens: every one accepted
        assert answers(speculating, **SAMPLED) == expected["sampled"]
    finally:
        speculating.stop()


def test_a_server_refuses_to_start_without_a_good_draft_model(kiln_attention_artifact, tmp_path):
    """Before serving anything, one line: the method without --draft-model, a folder that is not a
    text-generation artifact."""
    env = {**os.environ, "KILN_GRPC_PORT": "0", "KILN_THREADS": "1"}
    base = [sys.executable, "-m", "modelkiln", "serve", f"{MODEL}={kiln_attention_artifact}", "--variant", "fp32",
            "--speculate", "draft-model"]
    missing = subprocess.run(base, capture_output=True, text=True, env=env, timeout=120)
    assert missing.returncode == 2 and "--speculate draft-model needs --draft-model" in missing.stderr
    bad = subprocess.run([*base, "--draft-model", str(tmp_path)], capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode != 0 and f"draft model {tmp_path}: " in bad.stderr and "not a modelkiln artifact" in bad.stderr
    assert "Traceback" not in missing.stderr + bad.stderr
