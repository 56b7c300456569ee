"""The fault suite's short form (``fault_suite.py --short``, beside this file) against a tiny embedding
model (served by one process, and by ``--workers 2``) and, in its generation mode, the tiny generation model,
run as a user runs it (a subprocess
starting real ``kiln serve`` processes), and its correctness goals asserted from the JSON it writes
(the latency goals are reported, not asserted). About 1.5 minutes each on 2 cores (more on a loaded
machine): marked slow, and run by CI on its own (``make reliability``, called from ``.ci/run``).

The fp32 variant is served: the answers must equal the answer each text gets alone (cosine >=
0.99999), and the tiny model's int8 variant is not batch-invariant yet (issue 15, first part).

Each probe was checked once to fail on a planted defect (then the defect was removed):
- misrouting: the batcher answered each batch's rows in reverse order -> misrouted > 0;
- bad input: ``codec._parameters`` without its isinstance check -> 500s, the probe fails;
- disconnects: ``RequestWatch._cancel`` ignoring "gone" -> every abandoned queued input computed (a count the probe
  now reports without judging: on a fast engine the work is done before the disconnect is seen; dropping it is
  asserted by test_serve.py::test_work_of_clients_that_left_is_not_computed);
- overload: no Retry-After on 503 (``errors.RETRY_AFTER`` emptied) -> fails;
- soak: every request body kept in a module-level list -> RSS growth over 5%;
- security: default host 0.0.0.0 -> "listens on 0.0.0.0";
- sigterm: SIGTERM left in uvicorn's captured signals -> exit code -15.
- and without ``serve/http/protocol.py`` the bad-input probe found stalled request heads and
  silent connections held open past 30 s (a real defect, fixed; see test_serve.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SUITE = Path(__file__).resolve().parent / "fault_suite.py"


def short_run(artifact: Path, out: Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    done = subprocess.run([sys.executable, str(SUITE), str(artifact), "--short", "--variant", "fp32", "--out", str(out),
                           *extra], capture_output=True, text=True, env=env, timeout=400)
    return done, json.loads((out / "reliability.json").read_text())


@pytest.fixture(scope="module")
def run(zoo, tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict]:
    return short_run(zoo.artifact("bert", "sentence-embeddings"), tmp_path_factory.mktemp("reliability"))


@pytest.fixture(scope="module")
def workers_run(zoo, tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict]:
    """The same suite against kiln serve --workers 2: one server to its clients (serve/workers.py)."""
    return short_run(zoo.artifact("bert", "sentence-embeddings"), tmp_path_factory.mktemp("reliability-workers"),
                     "--workers", "2")


@pytest.fixture(scope="module")
def generation_run(tiny_generation_artifact, tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict]:
    return short_run(tiny_generation_artifact, tmp_path_factory.mktemp("reliability-generation"))


def probe(report: dict, name: str) -> dict:
    return next(p for p in report["probes"] if p["name"] == name)


@pytest.mark.parametrize("fixture", ["run", "workers_run", "generation_run"])
def test_every_probe_ran(fixture, request):
    done, report = request.getfixturevalue(fixture)
    assert report["mode"] == ("generation" if fixture == "generation_run" else "encoder")
    assert [p["name"] for p in report["probes"]] == ["misrouting", "bad input", "disconnects", "overload", "soak",
                                                     "security", "sigterm"], done.stderr[-3000:]
    # Whether every goal was met is the script's exit code; its latency goals (503 p99, soak p99
    # stability, recovery time) are measurements, recorded in docs/reliability.md, not asserted here:
    # on a shared 2-core machine at load average 16 the 503 p99 reached 1.3 s.
    assert done.returncode in (0, 1), done.stderr[-3000:]


@pytest.mark.parametrize("fixture", ["run", "workers_run"])
def test_the_goals_in_numbers(fixture, request):
    _, report = request.getfixturevalue(fixture)
    m = probe(report, "misrouting")["details"]
    assert m["answers"] >= 3000 and m["misrouted"] == 0 and m["differs"] == 0 and m["statuses"] == {"200": m["requests"]}
    bad = probe(report, "bad input")["details"]
    assert bad["kinds"] >= 100 and not bad["failed_kinds"] and not bad["fuzz"]["failures"]
    assert not any(int(s) >= 500 for s in bad["fuzz"]["statuses"]) and bad["fuzz"]["sent"] >= 150
    assert bad["alongside"]["misrouted"] == 0 and bad["alongside"]["differs"] == 0
    d = probe(report, "disconnects")["details"]
    assert d["idle"] and d["in_flight"] == 1 and d["abandoned_inputs"] > 0
    o = probe(report, "overload")["details"]
    assert set(o["statuses"]) <= {"200", "503"} and o["statuses"]["503"] > 0 and "missing" not in o["retry_after"]
    s = probe(report, "soak")["details"]
    assert s["rss_growth"] < 0.05 and s["misrouted"] == 0
    sec = probe(report, "security")["details"]
    assert sec["listening"] == ["127.0.0.1"] and not sec["problems"] and sec["error_bodies"] > 100
    t = probe(report, "sigterm")["details"]
    assert t["before_signal"] > 0 and t["lost"] == 0 and t["exit_code"] == 0


# --- the generation mode ---------------------------------------------------------------------------------
# Each generation probe was checked once to fail on a planted defect (then removed): the scheduler
# delivering the first two requests' tokens of each step to each other -> misrouting: 2 misrouted and 123
# differing of 300 answers; Stream._close not cancelling -> disconnects: 8,800 of the 12,685 tokens the
# departed clients asked for generated. And the first runs found real defects, fixed (test_serve_generation_hostile.py):
# a stalled body held its connection for good, a client gone mid-body logged tracebacks, 'model': 7 was answered.


def test_the_generation_goals_in_numbers(generation_run):
    _, report = generation_run
    m = probe(report, "misrouting")["details"]
    assert m["answers"] >= 1000 and m["verdicts"] == {"equal": m["requests"]}
    bad = probe(report, "bad input")["details"]
    assert bad["kinds"] >= 200 and not bad["failed_kinds"] and not bad["fuzz"]["failures"]
    assert not any(int(s) >= 500 for s in bad["fuzz"]["statuses"]) and bad["fuzz"]["sent"] >= 150
    assert bad["alongside"]["verdicts"] == {"equal": bad["alongside"]["requests"]}
    d = probe(report, "disconnects")["details"]
    assert d["idle"] and d["running"] == 0 and d["waiting"] == 0 and d["in_flight"] == 1
    assert d["tokens_generated"] <= d["tokens_asked"] / 2
    o = probe(report, "overload")["details"]
    assert set(o["statuses"]) <= {"200", "503"} and o["statuses"]["503"] > 0 and "missing" not in o["retry_after"]
    assert o["answers_checked"] > 0 and o["answers_wrong"] == 0
    s = probe(report, "soak")["details"]
    assert s["rss_growth"] < 0.05 and s["verdicts"] == {"equal": s["requests"]}
    sec = probe(report, "security")["details"]
    assert sec["listening"] == ["127.0.0.1"] and not sec["problems"] and sec["error_bodies"] > 100
    t = probe(report, "sigterm")["details"]
    assert t["before_signal"] > 0 and t["lost"] == 0 and t["exit_code"] == 0
