"""Commands that start from the model you have (model_arg.py, model_cache.py): a GGUF file is converted
once into the model cache ($KILN_CACHE) and found there afterwards; a changed source is converted again;
a killed or failed conversion leaves nothing that looks like an artifact; two processes starting at
once convert once. Real processes on a tiny random GGUF file (a conversion takes a few seconds)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from generation_helpers import write_tiny_gguf
from helpers import SRC, kiln
from modelkiln.atomic import atomic_folder
from modelkiln.errors import KilnError, ModelLoadError
from modelkiln.model_arg import convert_options, model_argument
from modelkiln.model_cache import (cache_key, convert_into_cache, describe, find_source, fingerprint, list_entries,
                                   remove_entry)
from modelkiln.net import free_port, wait_until_ready

CONVERTING = "into the model cache:"  # the line a conversion into the cache says, once per conversion
FAST = ("--gate-prompts", "1,1")  # kiln convert's own runs: a smaller gate (the commands convert with the defaults)


@pytest.fixture()
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("KILN_CACHE", str(root))
    return root


def entries(cache: Path) -> list[Path]:
    """The cache's artifacts (what a command would serve; a conversion's hidden temporary folder holds a
    provisional kiln.json, but no key names it)."""
    return sorted(p for p in (cache / "models").glob("[!.]*") if (p / "kiln.json").is_file())


def tiny(path: Path, matrices: str = "Q4_1") -> Path:
    return write_tiny_gguf(path, matrices=matrices, embedding="Q8_0")


# --- the commands, as a user runs them ----------------------------------------------------------


def test_the_first_start_converts_and_later_ones_find_it(tmp_path, cache):
    gguf = tiny(tmp_path / "tiny.gguf")
    env = {"KILN_CACHE": str(cache)}
    first = kiln("generate", str(gguf), "hello", "-n", "4", "--ignore-eos", "--threads", "1", "--json", env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stderr.count(CONVERTING) == 1 and "✓ Loading model and tokenizer" in first.stderr
    assert json.loads(first.stdout)["completion_tokens"] == 4  # the table went to stderr: stdout is the answer
    [entry] = entries(cache)
    written = (entry / "kiln.json").stat().st_mtime_ns

    again = kiln("generate", str(gguf), "hello", "-n", "4", "--ignore-eos", "--threads", "1", "--json", env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert CONVERTING not in again.stderr and f"using the cached conversion of {gguf}: {entry}" in again.stderr
    assert json.loads(again.stdout)["text"] == json.loads(first.stdout)["text"]
    # kiln convert without --out has the same key: it finds the entry and says where it is
    convert = kiln("convert", str(gguf), env=env)
    assert convert.returncode == 0 and "is converted already" in convert.stderr and str(entry) in convert.stdout
    # kiln serve starts from it too, named after the file, and its process never imports torch
    log = tmp_path / "serve.log"
    port = free_port()
    with log.open("w") as stderr:  # the import list would fill a pipe
        proc = subprocess.Popen([sys.executable, "-m", "modelkiln", "serve", str(gguf), "--port", str(port)],
                                env={**os.environ, "PYTHONPATH": str(SRC), "KILN_CACHE": str(cache),
                                     "KILN_THREADS": "1", "PYTHONPROFILEIMPORTTIME": "1"},
                                stdout=subprocess.DEVNULL, stderr=stderr)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_until_ready(proc, url, 60, "kiln serve", lambda: log.read_text()[-3000:], proc.kill, poll_s=0.05)
            assert [m["id"] for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]] == ["tiny"]
        finally:
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(60)
    err = log.read_text()
    assert code == 0 and CONVERTING not in err and "using the cached conversion" in err
    imported = {line.rsplit("|", 1)[-1].strip() for line in err.splitlines() if line.startswith("import time:")}
    assert "onnxruntime" in imported and not {m for m in imported if m.split(".")[0] in ("torch", "transformers")}
    assert (entry / "kiln.json").stat().st_mtime_ns == written  # nothing was written again

    listed = kiln("cache", "ls", env=env)
    assert listed.returncode == 0 and entry.name in listed.stdout and "ready" in listed.stdout
    assert "MB" in listed.stdout and "1 entry, " in listed.stdout
    removed = kiln("cache", "rm", entry.name, env=env)
    assert removed.returncode == 0 and f"Removed {entry.name} (" in removed.stdout and not entries(cache)


def test_a_killed_conversion_leaves_no_artifact_and_a_changed_source_is_converted_again(tmp_path, cache):
    gguf = tiny(tmp_path / "tiny.gguf")
    env = {**os.environ, "PYTHONPATH": str(SRC), "KILN_CACHE": str(cache)}
    proc = subprocess.Popen([sys.executable, "-m", "modelkiln", "convert", str(gguf), *FAST], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None and not list((cache / "models").glob(".*.tmp-*")):
        time.sleep(0.02)  # the temporary folder appears once the model is loaded, before any variant is built
    assert proc.poll() is None, "the conversion ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert entries(cache) == [] and list((cache / "models").glob(".*.tmp-*"))
    listed = kiln("cache", "ls", env={"KILN_CACHE": str(cache)})
    assert "interrupted" in listed.stdout and "ready" not in listed.stdout
    env = {"KILN_CACHE": str(cache)}
    done = kiln("convert", str(gguf), *FAST, env=env)
    assert done.returncode == 0 and done.stderr.count(CONVERTING) == 1, done.stderr[-3000:]
    assert not list((cache / "models").glob(".*.tmp-*"))  # the leftover is gone
    [old] = entries(cache)

    tiny(gguf, matrices="Q8_0")  # the same path, other weights
    again = kiln("convert", str(gguf), *FAST, env=env)
    assert again.returncode == 0 and again.stderr.count(CONVERTING) == 1, again.stderr[-3000:]
    assert len(entries(cache)) == 2 and old in entries(cache)
    listed = kiln("cache", "ls", env=env).stdout
    assert "stale: source changed" in listed and "ready" in listed and "--gate-prompts 1,1" in listed
    stale = kiln("cache", "rm", "--stale", env=env)
    assert stale.returncode == 0 and f"Removed {old.name}" in stale.stdout and old not in entries(cache)
    assert len(entries(cache)) == 1


def test_two_processes_starting_at_once_convert_once(tmp_path, cache):
    gguf = tiny(tmp_path / "tiny.gguf")
    env = {**os.environ, "PYTHONPATH": str(SRC), "KILN_CACHE": str(cache)}
    args = [sys.executable, "-m", "modelkiln", "generate", str(gguf), "hi", "-n", "3", "--ignore-eos", "--threads", "1",
            "--json"]
    procs = [subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in results]
    errs = "".join(err for _, err in results)
    assert errs.count(CONVERTING) == 1, errs[-4000:]  # one conversion, and the other process found it
    assert "is converted already" in errs or "using the cached conversion" in errs
    assert len(entries(cache)) == 1
    assert json.loads(results[0][0])["text"] == json.loads(results[1][0])["text"]


def test_commands_name_what_is_neither_artifact_nor_model(tmp_path, cache):
    empty = tmp_path / "empty"
    empty.mkdir()
    res = kiln("generate", str(empty), "hi", env={"KILN_CACHE": str(cache)})
    assert res.returncode == 2 and "not a modelkiln artifact (no kiln.json) nor a model" in res.stderr
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    res = kiln("serve", str(text), env={"KILN_CACHE": str(cache)})
    assert res.returncode == 2 and "is not a GGUF file" in res.stderr and "Traceback" not in res.stderr


# --- the cache's rules, in process ----------------------------------------------------------------


def fake_convert(calls: list[str], fail: bool = False):
    """Writes a folder with a kiln.json atomically, as kiln convert does; ``fail``: raises half way."""

    def convert(out: Path, source) -> None:
        calls.append(source.location)
        with atomic_folder(out, force=True) as folder:
            (folder / "kiln.json").write_text("{}")
            if fail:
                raise RuntimeError("killed half way")

    return convert


def test_a_failed_conversion_leaves_nothing_and_a_change_converts_again(tmp_path, cache):
    source = tmp_path / "m.gguf"
    source.write_bytes(b"GGUF" + bytes(100))
    calls: list[str] = []
    with pytest.raises(RuntimeError):
        convert_into_cache(str(source), {}, fake_convert(calls, fail=True), say=lambda _: None)
    assert entries(cache) == [] and not list((cache / "models").glob(".*.tmp-*"))
    [interrupted] = list_entries()
    assert interrupted.status == "interrupted"
    first = convert_into_cache(str(source), {}, fake_convert(calls), say=lambda _: None)
    assert convert_into_cache(str(source), {}, fake_convert(calls), say=lambda _: None) == first
    assert len(calls) == 2  # the failed one and the first that succeeded; the third call found it
    source.write_bytes(b"GGUF" + bytes(101))
    second = convert_into_cache(str(source), {}, fake_convert(calls), say=lambda _: None)
    assert second != first and len(calls) == 3
    assert {e.key: e.status for e in list_entries()} == {first.name: "stale: source changed", second.name: "ready"}
    assert remove_entry(first.name) > 0 and [e.key for e in list_entries()] == [second.name]
    with pytest.raises(KilnError, match="no cache entry nope"):
        remove_entry("nope")


def test_the_key_holds_the_options_that_decide_the_artifact(tmp_path):
    source = tmp_path / "m.gguf"
    source.write_bytes(b"GGUF" + bytes(100))
    s = describe(str(source))
    assert (s.kind, s.name, s.location) == ("gguf", "m", str(source.resolve()))
    assert cache_key(s, {}) == cache_key(s, convert_options(task="auto"))  # kiln convert's defaults are left out
    assert cache_key(s, {"precision": "int8,gguf"}) == cache_key(s, {"precision": "gguf, int8"})
    assert len({cache_key(s, {}), cache_key(s, {"precision": "int8"}), cache_key(s, {"task": "text-generation"})}) == 3
    assert cache_key(s, {}).startswith("m-")


def test_the_fingerprint_sees_size_mtime_and_both_ends(tmp_path):
    """Not a full hash: the first and last MiB, size and mtime. An edit between them that keeps the
    size and the mtime goes unseen (the documented price of starting in milliseconds)."""
    path = tmp_path / "big.gguf"
    data = bytearray(os.urandom(3 << 20))
    path.write_bytes(data)
    stat = path.stat()
    before = fingerprint(path)

    def rewrite(offset: int) -> str:
        data[offset] ^= 0xFF
        path.write_bytes(data)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        return fingerprint(path)

    assert rewrite(10) != before  # the header
    assert rewrite(len(data) - 10) != before  # the end
    data[10] ^= 0xFF
    data[len(data) - 10] ^= 0xFF
    assert rewrite(3 << 19) == before  # the middle, size and mtime kept
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert fingerprint(path) != before  # touched


def test_what_a_model_argument_may_name(tmp_path, cache, monkeypatch):
    assert find_source(str(tmp_path / "missing")) is None  # the command says it does not exist, as before
    assert model_argument(f"m={tmp_path / 'missing'}") == f"m={tmp_path / 'missing'}"
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert describe(str(folder)).kind == "folder"
    with pytest.raises(ModelLoadError, match="not a modelkiln artifact"):
        find_source(str(tmp_path))
    # a hub id: offline (the tests' setting), the revision the local hub cache holds
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelLoadError, match="not in the local hub cache"):
        find_source("someone/tiny")
    refs = tmp_path / "hub" / "models--someone--tiny" / "refs"
    refs.mkdir(parents=True)
    (refs / "main").write_text("abc123\n")
    hub = find_source("someone/tiny")
    assert hub is not None and (hub.kind, hub.fingerprint, hub.name) == ("hub", "revision abc123", "tiny")


def test_kiln_convert_keys_the_options_as_the_other_commands_pass_them(tmp_path, cache, monkeypatch):
    """`kiln serve MODEL --task T --precision P` converts with `kiln convert MODEL --task T --precision P` in a
    child and then looks for the key it computed itself: both sides must key the same options the same way."""
    from typer.testing import CliRunner

    import modelkiln.model_cache as model_cache
    from modelkiln.cli import app

    source = tmp_path / "m.gguf"
    source.write_bytes(b"GGUF" + bytes(100))
    seen: list[dict] = []
    monkeypatch.setattr(model_cache, "convert_into_cache",
                        lambda ref, options, convert, force, **_: seen.append(options) or tmp_path)
    cases = ((["--task", "text-generation", "--precision", "int8,gguf"],
              {"task": "text-generation", "precision": "int8,gguf"}),
             (["--task", "auto"], {"task": "auto"}),
             ([], {}))
    for flags, given in cases:
        result = CliRunner().invoke(app, ["convert", str(source), *flags])  # converts nothing: patched
        assert result.exit_code == 0, result.output
        s = describe(str(source))
        assert cache_key(s, seen.pop()) == cache_key(s, convert_options(**given))
