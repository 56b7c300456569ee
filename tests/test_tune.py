"""kiln tune on a tiny artifact with a tiny grid, and the config file it writes."""

from __future__ import annotations

import inspect
import json
import re

import httpx
import pytest
from helpers import kiln

from modelkiln.errors import KilnError
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
    from test_serve import Server

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
