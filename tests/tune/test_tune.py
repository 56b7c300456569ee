"""kiln tune on a tiny artifact with a tiny grid, and the config file it writes."""

from __future__ import annotations

import copy
import inspect
import json
import re

import httpx
import pytest
from helpers import assert_one_line_error, kiln

from modelkiln.errors import KilnError
from modelkiln.native import library_path
from modelkiln.serve.settings import ServeSettings
from modelkiln.serve.config_file import read_serve_config, write_serve_config


def test_read_serve_config_validates(tmp_path):
    good = tmp_path / "good.json"
    write_serve_config(good, {"variant": "int8", "threads": None, "max_batch_size": 8, "max_queue_delay_ms": 1},
                       {"note": "measured"})
    settings = read_serve_config(good)
    assert settings == {"variant": "int8", "threads": None, "max_batch_size": 8, "max_queue_delay_ms": 1.0}
    assert ServeSettings.from_env({}, **settings).max_batch_size == 8
    cases = {"{not json": "not valid JSON", "[1, 2]": "JSON object", '{"max_batchsize": 8}': "unknown setting",
             '{"max_batch_size": "8"}': "must be", '{"truncate": 1}': "must be", '{"models": []}': "unknown setting"}
    for text, message in cases.items():
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        with pytest.raises(KilnError, match=message):
            read_serve_config(bad)
    with pytest.raises(KilnError, match="not found"):
        read_serve_config(tmp_path / "missing.json")


def test_option_lists():
    from modelkiln.option_lists import number_list

    assert number_list("1, 2,4", "--x") == [1, 2, 4]
    assert number_list("auto,0,0.5", "--x", float, auto=True) == [None, 0.0, 0.5]
    with pytest.raises(KilnError, match="--x takes comma-separated whole numbers or auto"):
        number_list("auto,two", "--x", auto=True)
    with pytest.raises(KilnError, match="whole numbers, got 'auto'"):
        number_list("auto", "--x")  # only where the option allows it


@pytest.fixture(scope="module")
def tuned(zoo, tmp_path_factory):
    artifact = zoo.artifact("bert", "text-classification")
    out = tmp_path_factory.mktemp("tune")
    r = kiln("tune", str(artifact), "--variants", "fp32,int8", "--instances", "1", "--threads", "1", "--max-batch-size", "2",
             "--max-queue-delay-ms", "0", "--max-padding", "0.5", "--alone-threads", "0", "--concurrency", "1,2", "--warmup", "0.2", "--window", "0.3",
             "--max-windows", "2", "--p99-ms", "500", "-o", str(out / "best.json"), "--json", str(out / "all.json"),
             timeout=240)
    assert r.returncode == 0, r.stderr
    return artifact, out, r


def test_tune_ranks_and_writes_config(tuned):
    _, out, r = tuned
    assert "best first" in r.stdout and "fp32" in r.stdout and "int8" in r.stdout
    # a column for the one setting that differs (variant); the others once, under the table
    header = next(line for line in r.stdout.splitlines() if "variant" in line and "req/s" in line)
    assert "instances" not in header and "max batch" not in header
    caption = " ".join(r.stdout.split("the same in every trial:", 1)[1].split())
    assert "threads 1" in caption and "instances 1" in caption and "max batch size 2" in caption
    settings = read_serve_config(out / "best.json")
    assert settings["variant"] in ("fp32", "int8") and settings["threads"] == 1 and settings["max_batch_size"] == 2
    assert settings["instances"] == 1 and settings["max_padding"] == 0.5 and settings["alone_threads"] == 0
    notes = json.loads((out / "best.json").read_text())
    assert notes["_within_budget"] is True and notes["_measured"]["throughput_rps"] > 0
    trials = json.loads((out / "all.json").read_text())["trials"]
    assert len(trials) == 2 and all(t["error"] is None for t in trials)
    assert trials[0]["settings"]["variant"] == settings["variant"]  # rank 1 is what was written
    assert trials[0]["peak_rss_mb"] is None or trials[0]["peak_rss_mb"] > 10


def _serve_has_config() -> bool:
    from modelkiln.serve.command import serve

    return "config" in inspect.signature(serve).parameters


@pytest.mark.skipif(not _serve_has_config(), reason="kiln serve --config is not wired yet (serve/command.py)")
def test_serve_accepts_tuned_config(tuned):
    from servers import Server

    artifact, out, _ = tuned
    settings = read_serve_config(out / "best.json")
    srv = Server([f"m={artifact}", "--config", str(out / "best.json")])
    try:
        meta = httpx.get(srv.url + "/v2/models/m").json()
        assert meta["parameters"]["variant"] == settings["variant"]
        # max_batch_size 2 took effect: 5 inputs in one request run as batches of 2, 2, 1
        def batches() -> tuple[float, float]:
            text = httpx.get(srv.url + "/metrics").text
            get = lambda n: float(re.search(rf'{n}{{model="m"}} ([0-9.e+]+)', text).group(1))  # noqa: E731
            return get("kiln_batch_size_count"), get("kiln_batch_size_sum")

        count0, sum0 = batches()
        r = httpx.post(srv.url + "/v2/models/m/predict", json={"inputs": ["a", "b", "c", "d", "e"]})
        assert r.status_code == 200
        count1, sum1 = batches()
        assert sum1 - sum0 == 5 and count1 - count0 >= 3
    finally:
        code, err = srv.stop()
        assert code == 0, err[-2000:]


# --- text generation -----------------------------------------------------------------------------

# Short runs on the tiny decoder: 4 prompts of 8 tokens at 4 streams, a few seconds per configuration.
SHORT_GENERATION_RUN = ("--max-tokens", "8", "--max-inputs", "4", "--concurrency", "4", "--warmup", "0.2",
                        "--window", "0.5", "--max-windows", "2")


@pytest.fixture(scope="module")
def two_accuracy_artifact(tiny_generation_artifact, tmp_path_factory):
    """The tiny decoder with a second kept variant, ``fp32-ppl5``: the fp32 graph again, recorded in
    the manifest with a perplexity 5% above PyTorch's, where the gate's figure for fp32 is about 0."""
    import shutil

    from modelkiln.manifest import Manifest

    folder = tmp_path_factory.mktemp("tune-generation") / "tiny-llama"
    shutil.copytree(tiny_generation_artifact, folder)
    manifest = Manifest.load(folder)
    fp32 = manifest.variant("fp32")
    assert abs(fp32.details["perplexity_change"]) < 0.01  # what the gate measured
    lossy = copy.deepcopy(fp32)
    lossy.name, lossy.details["perplexity_change"] = "fp32-ppl5", 0.05
    manifest.variants.append(lossy)
    manifest.save(folder)
    return folder


def test_tune_generation_picks_the_best_within_the_limits(two_accuracy_artifact, tmp_path):
    from modelkiln.loadtest.report import read_json

    artifact = two_accuracy_artifact
    r = kiln("tune", str(artifact), "--variants", "fp32,fp32-ppl5", "--max-batch-size", "4", "--generation-replicas", "1",
             *SHORT_GENERATION_RUN, "--ttft-p99-ms", "60000", "--max-ppl-increase", "1%", "-o",
             str(tmp_path / "best.json"), "--json", str(tmp_path / "all.json"), timeout=120)
    assert r.returncode == 0, r.stderr
    rows = {variant: status for variant, status in _table_rows(r.stdout)}
    assert set(rows) == {"fp32", "fp32-ppl5"}
    assert "◀ chosen" in rows["fp32"] and "excluded: perplexity +5.00% > 1%" in rows["fp32-ppl5"]
    assert (f"Chosen: kiln serve {artifact} --variant fp32 --max-batch-size 4 --generation-replicas 1 "
            "--prefill-chunk 128") in r.stdout
    assert read_serve_config(tmp_path / "best.json") == {"variant": "fp32", "max_batch_size": 4, "generation_replicas": 1,
                                                         "prefill_chunk": 128}

    data = json.loads((tmp_path / "all.json").read_text())
    assert data["kind"] == "generation" and data["limits"] == {"ttft_p99_ms": 60000.0, "max_ppl_increase": 0.01}
    assert data["chosen"]["variant"] == "fp32" and data["serve_command"].endswith("--prefill-chunk 128")
    first, second = data["configurations"]
    assert first["chosen"] and first["excluded"] == [] and second["excluded"] == ["perplexity +5.00% > 1%"]
    assert second["perplexity_change"] == 0.05 and abs(first["perplexity_change"]) < 0.01
    for c in (first, second):  # both measured: the accuracy limit excludes, it does not skip the run
        assert c["output_tokens_per_s"] > 0 and 0 < c["ttft_p50_ms"] <= c["ttft_p99_ms"] < 60000
        assert c["checked_answers"] > 0 and c["changed_answers"] == 0 and c["failed_requests"] == {}
        assert c["run"]["steps"][0]["output_tokens_per_request"] == 8  # fixed lengths
    run = tmp_path / "run.json"  # the embedded run is kiln loadtest's own record
    run.write_text(json.dumps(first["run"]))
    assert read_json(run).steps[0].generation.output_tokens_per_s == pytest.approx(first["output_tokens_per_s"])


def test_tune_generation_says_when_no_configuration_meets_the_limits(tiny_generation_artifact, tmp_path):
    r = kiln("tune", str(tiny_generation_artifact), "--variants", "fp32", "--max-batch-size", "2", "--generation-replicas", "1",
             "--prefill-chunk", "16,64", *SHORT_GENERATION_RUN, "--ttft-p99-ms", "0.001", "-o",
             str(tmp_path / "best.json"), "--json", str(tmp_path / "all.json"), timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "no configuration met the limits (TTFT p99 ≤ 0.001 ms" in " ".join(r.stderr.split())
    excluded = [status for _, status in _table_rows(r.stdout) if "excluded: TTFT p99" in status and "> 0.001 ms" in status]
    assert len(excluded) == 2 and "chosen" not in r.stdout
    data = json.loads((tmp_path / "all.json").read_text())
    assert data["chosen"] is None and data["serve_command"] is None
    assert sorted(c["settings"]["prefill_chunk"] for c in data["configurations"]) == [16, 64]
    assert all(c["ttft_p99_ms"] > 0.001 and len(c["excluded"]) == 1 for c in data["configurations"])
    assert not (tmp_path / "best.json").exists()


def test_tune_generation_refuses_what_does_not_apply(tiny_generation_artifact):
    cases = {("--instances", "1,2"): "--instances: not swept for generation models",
             ("--p99-ms", "50"): "--p99-ms: for encoders",
             ("--concurrency", "1,4"): "--concurrency takes one level for text generation",
             ("--protocol", "oip-json"): "openai-chat | openai-completions | generate",
             ("--max-ppl-increase", "1"): "--max-ppl-increase takes a percentage (1%) or a fraction below 1",
             # the speculation settings: checked before any server starts
             ("--speculate", "off,foo"): "--speculate takes comma-separated values of off, ngram, draft-model, got 'off,foo'",
             ("--speculate", "ngram,draft-model"): "--speculate draft-model needs --draft-model ARTIFACT",
             ("--draft-tokens", "2,4"): "--draft-tokens is used only with --speculate ngram or draft-model, which no "
                                        "configuration runs",
             ("--speculate", "off,ngram", "--draft-model", "small"): "--draft-model is used only with --speculate "
                                                                     "draft-model"}
    for args, message in cases.items():
        r = kiln("tune", str(tiny_generation_artifact), *args, timeout=60)
        assert r.returncode == 2 and message in " ".join(r.stderr.split()), (args, r.stdout, r.stderr)
        assert "tuning" not in r.stderr  # refused before the sweep (and its first server) began


def test_tune_refuses_speculation_for_an_encoder(zoo):
    r = kiln("tune", str(zoo.artifact("bert", "text-classification")), "--speculate", "off,ngram", timeout=60)
    assert_one_line_error(r, "--speculate: not swept for encoder models")


def test_serve_command_names_the_speculation_a_configuration_ran():
    from modelkiln.tune.report import serve_command

    plain = {"variant": "fp32", "max_batch_size": 8, "speculate": "off", "draft_tokens": None, "draft_model": None}
    assert serve_command("a", plain) == "kiln serve a --variant fp32 --max-batch-size 8 --speculate off"
    drafting = {**plain, "speculate": "draft-model", "draft_tokens": 4, "draft_model": "small model"}
    assert serve_command("a", drafting).endswith("--speculate draft-model --draft-tokens 4 --draft-model 'small model'")


@pytest.fixture(scope="module")
def speculating_artifact(tiny_generation_artifact, tiny_kiln_attention_graph, tmp_path_factory):
    """The tiny artifact with its fp32 graph built with KilnAttention: an engine that verifies drafts,
    so the ngram configuration really speculates (and --check compares its answers)."""
    from generation_helpers import with_graph

    return with_graph(tiny_generation_artifact, tiny_kiln_attention_graph,
                      tmp_path_factory.mktemp("tune-speculation") / "tiny-kiln-attention")


@pytest.mark.skipif(library_path() is None, reason="the native library (KilnAttention) is not built on this machine")
def test_tune_generation_sweeps_speculation(speculating_artifact, tmp_path):
    artifact = speculating_artifact
    at = SHORT_GENERATION_RUN.index("--concurrency") + 1  # 2 streams: speculation drafts while at most 2 decode
    run = [*SHORT_GENERATION_RUN[:at], "2", *SHORT_GENERATION_RUN[at + 1:]]
    r = kiln("tune", str(artifact), "--variants", "fp32", "--max-batch-size", "4", "--generation-replicas", "1",
             "--speculate", "off,ngram", "--draft-tokens", "4", *run, "-o", str(tmp_path / "best.json"),
             "--json", str(tmp_path / "all.json"), timeout=120)
    assert r.returncode == 0, r.stderr
    assert "tuning tiny-llama: 2 configurations" in r.stderr and "note:" not in r.stderr
    data = json.loads((tmp_path / "all.json").read_text())
    runs = {c["settings"]["speculate"]: c for c in data["configurations"]}
    assert set(runs) == {"off", "ngram"}
    assert runs["off"]["settings"]["draft_tokens"] is None and runs["ngram"]["settings"]["draft_tokens"] == 4
    for c in runs.values():
        assert c["error"] is None and c["output_tokens_per_s"] > 0 and c["checked_answers"] > 0
        assert c["changed_answers"] == 0  # speculation's answers are plain decoding's
    # the table: a speculate and a draft-tokens column, draft tokens "-" where speculation is off
    cells = [[c.strip() for c in line.split("│")] for line in r.stdout.splitlines() if line.count("│") > 10]
    shown = {(row[row.index(method)], row[row.index(method) + 1]) for row in cells for method in ("off", "ngram")
             if method in row}
    assert shown == {("off", "-"), ("ngram", "4")}
    # the chosen one's command and config name its speculation, whichever was faster
    chosen = data["chosen"]
    speculation = {"speculate": "off"} if chosen["speculate"] == "off" else {"speculate": "ngram", "draft_tokens": 4}
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in speculation.items())
    assert data["serve_command"] == (f"kiln serve {artifact} --variant fp32 --max-batch-size 4 --generation-replicas 1 "
                                     f"--prefill-chunk 128 {flags}")
    assert f"Chosen: {data['serve_command']}" in r.stdout
    assert read_serve_config(tmp_path / "best.json") == {"variant": "fp32", "max_batch_size": 4, "generation_replicas": 1,
                                                         "prefill_chunk": 128, **speculation}


def _table_rows(stdout: str) -> list[tuple[str, str]]:
    """(variant, status) of each row of kiln tune's generation table, a status cell wrapped onto
    continuation lines joined back."""
    rows: list[tuple[str, str]] = []
    for line in (line for line in stdout.splitlines() if line.count("│") > 10):
        cells = [c.strip() for c in line.split("│")]
        if cells[1]:  # the row number: a new row
            rows.append((cells[2], cells[-2]))
        elif rows:
            rows[-1] = (rows[-1][0], f"{rows[-1][1]} {cells[-2]}".strip())
    return rows


def _trial(answered: dict[str, int], mismatches: int, ttft_p99_ms: float, perplexity_change: float | None):
    from modelkiln.loadtest.runner import GenerationStats, Latency, RunResult, StepResult
    from modelkiln.tune.generation import GenerationTrial

    ttft = Latency(ttft_p99_ms / 2, ttft_p99_ms / 2, ttft_p99_ms, ttft_p99_ms, ttft_p99_ms, ttft_p99_ms)
    step = StepResult("concurrency", 4, 1.0, 1.0, 10, ttft, {}, 2, True, 10.0, sum(answered.values()), answered,
                      generation=GenerationStats(ttft, None, 100.0, 8, "usage"), checked=20, mismatches=mismatches)
    run = RunResult("t", "http://x", "m", "openai-chat", "sts", 1, "now", steps=[step])
    return GenerationTrial({"variant": "fp32", "max_batch_size": 4}, perplexity_change, run=run)


def test_generation_limits_name_every_reason():
    from modelkiln.tune.generation import Limits, choose, limit_reasons, parse_fraction

    limits = Limits(ttft_p99_ms=500, max_ppl_increase=0.01)
    good = _trial({"200": 20}, 0, 400, -0.002)  # a perplexity below PyTorch's is within any limit
    assert limit_reasons(good, limits) == []
    bad = _trial({"200": 17, "503": 2, "mid-stream": 1}, 3, 900, 0.02)
    assert limit_reasons(bad, limits) == ["3 failed requests (503: 2, mid-stream: 1)", "3/20 answers changed under load",
                                          "TTFT p99 900.0 ms > 500 ms", "perplexity +2.00% > 1%"]
    assert limit_reasons(_trial({"200": 20}, 0, 400, None), limits) == ["no perplexity recorded by the gate"]
    assert limit_reasons(bad, Limits()) == ["3 failed requests (503: 2, mid-stream: 1)", "3/20 answers changed under load"]
    faster = _trial({"200": 20}, 0, 400, 0.0)
    faster.run.steps[0].generation.output_tokens_per_s = 200.0
    trials = [good, faster, bad]
    for t in trials:
        t.excluded = limit_reasons(t, limits)
    assert choose(trials) is faster and faster.chosen and not good.chosen
    assert parse_fraction("1%", "--x") == 0.01 and parse_fraction("0.5%", "--x") == 0.005
    assert parse_fraction("0.03", "--x") == 0.03
    for text in ("1", "-1%", "one"):
        with pytest.raises(KilnError, match="--x takes a percentage"):
            parse_fraction(text, "--x")
