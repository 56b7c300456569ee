"""The one settings declaration (serve/settings.py) and what is derived from it: KILN_* env vars,
the `kiln serve` flags, the --config file's validation and `kiln tune`'s sweepable flags."""

from __future__ import annotations

import json
import os

import pytest
from helpers import kiln
from typer.testing import CliRunner

from modelkiln.errors import KilnError
from modelkiln.serve import command
from modelkiln.serve.config_file import read_serve_config
from modelkiln.serve.settings import ServeSettings, cli_flag, declared, env_var, sweep_default, sweepable
from modelkiln.tune.sweep import Grid, sweepable_flags


def test_new_fields_and_their_defaults():
    s = ServeSettings()
    assert (s.grpc_port, s.model_repository, s.model_control_mode, s.repository_poll_s, s.body_read_timeout_s) == (
        8001, None, "none", 15.0, 10.0)
    flags = {name: cli_flag(name) for name in declared()}
    assert flags["grpc_port"] == "--grpc-port" and flags["model_repository"] == "--model-repository"
    assert flags["model_control_mode"] == "--model-control-mode" and flags["repository_poll_s"] == "--repository-poll-s"
    assert flags["body_read_timeout_s"] == "--body-read-timeout" and flags["request_timeout_s"] == "--request-timeout"
    assert "models" not in declared()  # given as arguments


@pytest.mark.parametrize("env, field, expected", [
    ({"KILN_TRUNCATE": "false"}, "truncate", False),
    ({"KILN_ACCESS_LOG": "yes"}, "access_log", True),
    ({"KILN_WARMUP": "0"}, "warmup", False),
    ({"KILN_GRPC_PORT": "0"}, "grpc_port", 0),
    ({"KILN_MAX_BATCH_SIZE": "8"}, "max_batch_size", 8),
    ({"KILN_REPOSITORY_POLL_S": "0.5"}, "repository_poll_s", 0.5),
    ({"KILN_BODY_READ_TIMEOUT_S": "3"}, "body_read_timeout_s", 3.0),
    ({"KILN_THREADS": "3"}, "threads", 3),  # int | None
    ({"KILN_THREADS": ""}, "threads", None),  # empty: not set
    ({"KILN_MAX_PADDING": "0.25"}, "max_padding", 0.25),  # float | None
    ({"KILN_MODEL_REPOSITORY": "/models"}, "model_repository", "/models"),  # str | None
    ({"KILN_MODEL_REPOSITORY": "/m", "KILN_MODEL_CONTROL_MODE": "poll"}, "model_control_mode", "poll"),  # enum
    ({"KILN_DEVICE": "cuda"}, "device", "cuda"),
])
def test_env_vars_parse_each_type(env, field, expected):
    value = getattr(ServeSettings.from_env(env), field)
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize("env, message", [
    ({"KILN_TRUNCATE": "maybe"}, r"truncate must be a valid boolean.*\(from KILN_TRUNCATE='maybe'\)"),
    ({"KILN_PORT": "eighty"}, r"port must be a valid integer.*KILN_PORT='eighty'"),
    ({"KILN_PORT": "70000"}, r"port must be less than or equal to 65535"),
    ({"KILN_REPOSITORY_POLL_S": "0"}, r"repository_poll_s must be greater than 0"),
    ({"KILN_MAX_PADDING": "-1"}, r"max_padding must be greater than or equal to 0"),
    ({"KILN_MODEL_CONTROL_MODE": "auto"}, r"model_control_mode must be 'none', 'explicit' or 'poll'"),
    ({"KILN_MODEL_CONTROL_MODE": "explicit"}, r"needs a model repository \(--model-repository DIR\)"),
    ({"KILN_DEVICE": "tpu"}, r"device must be 'cpu' or 'cuda'"),
])
def test_bad_env_values_are_one_line_errors(env, message):
    with pytest.raises(KilnError, match=message) as err:
        ServeSettings.from_env(env)
    assert "\n" not in str(err.value)


def test_precedence_defaults_config_env_overrides():
    config = {"port": 1, "threads": 1, "max_batch_size": 2}
    env = {"KILN_PORT": "2", "KILN_THREADS": "2"}
    s = ServeSettings.from_env(env, config, port=3, threads=None)  # None: not given on the command line
    assert (s.port, s.threads, s.max_batch_size, s.host) == (3, 2, 2, "127.0.0.1")
    with pytest.raises(KilnError, match=r"max_batch_size must be greater than 0 \(from --max-batch-size 0\)"):
        ServeSettings.from_env({}, max_batch_size=0)


def test_settings_are_immutable_and_replace_validates():
    s = ServeSettings()
    with pytest.raises(ValueError):
        s.port = 1  # type: ignore[misc]
    assert s.replace(max_batch_size=4).max_batch_size == 4 and s.max_batch_size == 32
    with pytest.raises(KilnError, match="max_batch_size must be greater than 0"):
        s.replace(max_batch_size=0)


@pytest.mark.parametrize("body, message", [
    ({"max_batchsize": 8}, "unknown setting"),
    ({"grpc_port": "8001"}, "'grpc_port'|grpc_port must be a valid integer"),
    ({"warmup": 1}, "warmup must be a valid boolean"),
    ({"model_control_mode": "sometimes"}, "model_control_mode must be 'none', 'explicit' or 'poll'"),
    ({"body_read_timeout_s": -1}, "body_read_timeout_s must be greater than 0"),
    ({"models": []}, "unknown setting"),
])
def test_config_file_errors_name_the_key(tmp_path, body, message):
    path = tmp_path / "serve.json"
    path.write_text(json.dumps(body))
    with pytest.raises(KilnError, match=message) as err:
        read_serve_config(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_config_file_keeps_given_keys_only(tmp_path):
    path = tmp_path / "serve.json"
    path.write_text(json.dumps({"_note": "x", "repository_poll_s": 2, "model_control_mode": "poll", "threads": None}))
    assert read_serve_config(path) == {"repository_poll_s": 2.0, "model_control_mode": "poll", "threads": None}
    assert type(read_serve_config(path)["repository_poll_s"]) is float


@pytest.fixture()
def served(monkeypatch):
    """`kiln serve` in process up to the point it would start the server: the settings it built."""
    from modelkiln.cli import app

    seen = []
    monkeypatch.setattr(command, "run_server", seen.append)

    def no_default() -> None:
        raise AssertionError("the default model was converted")

    monkeypatch.setattr(command, "default_artifact", no_default)
    for name in declared():
        monkeypatch.delenv(env_var(name), raising=False)

    def run(*args: str, env: dict | None = None) -> ServeSettings:
        for key, value in (env or {}).items():
            monkeypatch.setenv(key, value)
        result = CliRunner().invoke(app, ["serve", *args])
        assert result.exit_code == 0, result.output
        return seen.pop()

    return run


def test_cli_flags_override_env_and_config(served, tmp_path):
    config = tmp_path / "serve.json"
    config.write_text(json.dumps({"grpc_port": 9001, "max_batch_size": 4, "repository_poll_s": 1, "truncate": False}))
    s = served("m=/x", "--config", str(config), "--grpc-port", "9003", "--no-truncate", "--request-timeout", "5",
               "--body-read-timeout", "2.5", env={"KILN_GRPC_PORT": "9002", "KILN_MAX_BATCH_SIZE": "6"})
    assert (s.grpc_port, s.max_batch_size, s.repository_poll_s, s.truncate) == (9003, 6, 1.0, False)
    assert (s.request_timeout_s, s.body_read_timeout_s) == (5.0, 2.5)
    assert [(m.name, m.path) for m in s.models] == [("m", "/x")]
    s = served("m=/x", "--truncate", env={"KILN_TRUNCATE": "false"})
    assert s.truncate is True


def test_model_repository_alone_does_not_convert_the_default_model(served, tmp_path):
    s = served("--model-repository", str(tmp_path), "--model-control-mode", "explicit", "--repository-poll-s", "3")
    assert s.models == () and s.model_repository == str(tmp_path)
    assert (s.model_control_mode, s.repository_poll_s) == ("explicit", 3.0)


def test_serve_help_lists_every_setting_with_its_env_var():
    r = kiln("serve", "--help", env={"COLUMNS": "80"}, timeout=60)
    assert r.returncode == 0, r.stderr
    assert max(len(line) for line in r.stdout.splitlines()) <= 80 and "…" not in r.stdout  # nothing cut
    text = " ".join(r.stdout.split())  # help wraps at 80 columns
    for name in declared():
        assert f"{cli_flag(name)} " in text and f"(env {env_var(name)}, default " in text, name
    assert "--config" in text and "--no-truncate" in text and "--model-control-mode none|explicit|poll" in text


def test_only_kiln_serve_imports_the_declaration():
    """Deriving the flags needs pydantic (0.1-0.3 s to import here): `kiln --help` must not pay it."""
    import subprocess
    import sys

    from helpers import SRC

    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "modelkiln", "--help"], capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": str(SRC)}, timeout=60)
    assert r.returncode == 0 and "serve" in r.stdout
    assert "modelkiln.cli" in r.stderr and "pydantic" not in r.stderr


def test_tune_sweeps_what_the_declaration_marks(monkeypatch):
    assert sweepable_flags() == {name: cli_flag(name) for name in sweepable()}
    assert sweepable_flags()["max_queue_delay_ms"] == "--max-queue-delay-ms" and "port" not in sweepable_flags()
    # per kind of model: what the declaration's sweep= names for it
    assert list(sweepable_flags("generation")) == ["variant", "threads", "max_batch_size", "generation_replicas",
                                                   "prefill_chunk", "speculate", "draft_tokens", "draft_model"]
    assert sweep_default("speculate", "generation") == ""  # sweepable, but only tried when asked
    assert "prefill_chunk" not in sweepable_flags("encoder") and "instances" in sweepable_flags("encoder")
    assert sweep_default("max_batch_size", "encoder") == "32" and sweep_default("max_batch_size", "generation") == "8,16"
    # marking another field sweepable in the declaration is all it takes: kiln serve's flag for
    # the sweep and a kiln tune option with the declared default values
    extra = ServeSettings.model_fields["max_queue_size"].json_schema_extra
    monkeypatch.setitem(extra, "sweep", "512,1024")
    assert sweepable_flags()["max_queue_size"] == "--max-queue-size"
    assert sweep_default("max_queue_size", "generation") == "512,1024"
    options = {p.name: p for p in _tune_command().derive()}
    assert options["max_queue_size"].opts == ["--max-queue-size"] and "Default: 512,1024." in options["max_queue_size"].help


def _tune_command():
    import typer

    from modelkiln.cli import app

    return typer.main.get_command(app).commands["tune"]


def test_tune_options_are_the_sweepable_settings():
    options = {p.name: p for p in _tune_command().derive()}
    numeric = [n for n in sweepable() if n != "variant"]  # variant is tune's own --variants
    assert list(options) == numeric
    assert {n: options[n].opts[0] for n in numeric} == {n: cli_flag(n) for n in numeric}
    # not given: the values the declaration gives for the artifact's kind, which the help says
    assert all(options[n].default is None for n in numeric)
    assert "Default: auto; encoders only." in options["instances"].help
    assert "Default: 1,2 for encoders, auto for text generation." in options["threads"].help
    assert "Default: 32 for encoders, 8,16 for text generation." in options["max_batch_size"].help
    assert "comma-separated, of off, ngram, draft-model. Default: kiln serve's (off); text generation only." in " ".join(
        options["speculate"].help.split())
    r = kiln("tune", "--help", env={"COLUMNS": "80"}, timeout=60)
    text = " ".join(r.stdout.split())
    assert r.returncode == 0 and all(f"{cli_flag(n)} <str>" in text for n in numeric)
    assert "--install-completion" not in text and "--show-completion" not in text  # (--protocol names openai-completions)


def test_tune_values_are_typed_as_declared():
    from modelkiln.tune.command import sweep_values

    assert sweep_values("instances", "0,1,2") == (None, 1, 2)  # 0 cannot be an instance count: the default
    assert sweep_values("alone_threads", "auto,0,3") == (None, 0, 3)  # 0 is a value here: off
    assert sweep_values("max_padding", "0,0.5") == (0.0, 0.5) and sweep_values("max_batch_size", "8") == (8,)
    with pytest.raises(KilnError, match="--max-batch-size takes comma-separated whole numbers, got 'auto'"):
        sweep_values("max_batch_size", "auto")  # no server default to fall back on
    # a setting declared with choices takes those words, and nothing else
    assert sweep_values("speculate", "off, ngram,draft-model") == ("off", "ngram", "draft-model")
    for text in ("foo", "none,ngram", "auto"):  # kiln serve's word for no speculation is off
        with pytest.raises(KilnError, match=f"--speculate takes comma-separated values of off, ngram, draft-model, got '{text}'"):
            sweep_values("speculate", text)
    assert sweep_values("draft_tokens", "2,4") == (2, 4) and sweep_values("draft_model", "auto,small") == (None, "small")
    assert sweep_values("speculate", "") == ()  # not given and not swept by default: the server's default


def test_grid_combinations_follow_the_declaration():
    combos = Grid({"variant": ("int8", "fp32"), "instances": (1,), "max_batch_size": (8, 16)}).combinations()
    assert len(combos) == 4 and all(list(c) == list(sweepable("encoder")) for c in combos)
    pairs = {(c["variant"], c["max_batch_size"]) for c in combos}
    assert pairs == {("int8", 8), ("int8", 16), ("fp32", 8), ("fp32", 16)}
    assert all(c["threads"] is None for c in combos)  # not swept: the server's default
    with pytest.raises(KilnError, match="not sweepable for encoder models: port"):
        Grid({"port": (1, 2)}).combinations()
    combos = Grid({"variant": ("fp32",), "prefill_chunk": (64, 256)}, "generation").combinations()
    assert combos == [{"variant": "fp32", "threads": None, "max_batch_size": None, "generation_replicas": None,
                       "prefill_chunk": c, "speculate": None, "draft_tokens": None, "draft_model": None} for c in (64, 256)]
    with pytest.raises(KilnError, match="not sweepable for generation models: instances"):
        Grid({"instances": (1, 2)}, "generation").combinations()


def test_grid_runs_a_setting_only_where_it_has_an_effect():
    """Draft tokens do nothing without speculation and the draft model nothing without draft-model:
    the grid leaves them to the server's default there, so those grid points are one configuration."""
    from modelkiln.serve.settings import applies

    assert applies("draft_tokens", {"speculate": "ngram"}) and not applies("draft_tokens", {"speculate": "off"})
    assert not applies("draft_tokens", {})  # speculate left to the server: off
    assert applies("draft_model", {"speculate": "draft-model"}) and not applies("draft_model", {"speculate": "ngram"})
    assert applies("max_batch_size", {})
    grid = Grid({"variant": ("fp32",), "max_batch_size": (8, 16), "speculate": ("off", "ngram", "draft-model"),
                 "draft_tokens": (2, 4), "draft_model": ("small",)}, "generation")
    runs = [(c["max_batch_size"], c["speculate"], c["draft_tokens"], c["draft_model"]) for c in grid.combinations()]
    assert runs == [(b, *rest) for b in (8, 16) for rest in  # 2 x 5, not 2 x 3 x 2
                    [("off", None, None), ("ngram", 2, None), ("ngram", 4, None), ("draft-model", 2, "small"),
                     ("draft-model", 4, "small")]]
    # every combination is checked as kiln serve would check it, before any server starts
    with pytest.raises(KilnError, match="--speculate draft-model needs --draft-model ARTIFACT"):
        Grid({"variant": ("fp32",), "speculate": ("off", "draft-model")}, "generation").combinations()
    with pytest.raises(KilnError, match="max_batch_size must be greater than 0"):
        Grid({"variant": ("fp32",), "max_batch_size": (0,)}, "generation").combinations()
    with pytest.raises(KilnError, match="not sweepable for encoder models: speculate"):
        Grid({"speculate": ("ngram",)}).combinations()
