"""The environment of the servers kiln starts as child processes (kiln tune, kiln ray, the fault suite)."""

from __future__ import annotations

from modelkiln.net import child_environment


def test_child_environment_drops_kiln_settings_but_keeps_paths(monkeypatch):
    monkeypatch.setenv("KILN_VARIANT", "int8")
    monkeypatch.setenv("KILN_MAX_BATCH_SIZE", "1")
    monkeypatch.setenv("KILN_CACHE_DIR", "/tmp/cache")
    monkeypatch.setenv("KILN_DATA_DIR", "/tmp/data")
    monkeypatch.setenv("NOT_KILN_VARIANT", "kept")
    env = child_environment(KILN_API_KEY="secret", RAY_USAGE_STATS_ENABLED="0")
    assert "KILN_VARIANT" not in env and "KILN_MAX_BATCH_SIZE" not in env
    assert (env["KILN_CACHE_DIR"], env["KILN_DATA_DIR"]) == ("/tmp/cache", "/tmp/data")
    assert env["NOT_KILN_VARIANT"] == "kept" and env["PATH"]
    assert (env["KILN_API_KEY"], env["RAY_USAGE_STATS_ENABLED"]) == ("secret", "0")  # overrides come last
