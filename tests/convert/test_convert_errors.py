"""Each conversion failure: non-zero exit, one clear line, no traceback, nothing half-written."""

from __future__ import annotations

import json
import shutil

import pytest

from helpers import assert_one_line_error, kiln
from modelkiln.convert.pipeline import ConvertConfig, convert
from modelkiln.convert.validate import DEFAULT_TOLERANCES, Tolerance
from modelkiln.errors import OutputNotWritableError, ValidationFailedError


def test_unknown_task(zoo, tmp_path):
    res = kiln("convert", str(zoo.model("bert", "text-classification")), "--out", str(tmp_path / "a"), "--task", "summarize")
    assert_one_line_error(res, "unknown task 'summarize'")
    assert not (tmp_path / "a").exists()


def test_task_the_architecture_cannot_do(zoo, tmp_path):
    res = kiln("convert", str(zoo.model("bert", "text-classification")), "--out", str(tmp_path / "a"),
               "--task", "question-answering")
    assert_one_line_error(res, "BertForSequenceClassification", "cannot do question-answering")


def test_missing_model_folder(tmp_path):
    res = kiln("convert", str(tmp_path / "nope" / "model"), "--out", str(tmp_path / "a"))
    assert_one_line_error(res)
    assert not (tmp_path / "a").exists()


def test_folder_without_config(tmp_path):
    (tmp_path / "m").mkdir()
    res = kiln("convert", str(tmp_path / "m"), "--out", str(tmp_path / "a"))
    assert_one_line_error(res, "no config.json")


def test_corrupt_config(zoo, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(zoo.model("bert", "text-classification"), model)
    (model / "config.json").write_text('{"model_type": "bert", ')
    res = kiln("convert", str(model), "--out", str(tmp_path / "a"))
    assert_one_line_error(res, "config")


def test_corrupt_weights(zoo, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(zoo.model("bert", "text-classification"), model)
    (model / "model.safetensors").write_bytes(b"not a safetensors file")
    res = kiln("convert", str(model), "--out", str(tmp_path / "a"))
    assert_one_line_error(res)
    assert not (tmp_path / "a").exists()


def test_unsupported_architecture(zoo, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(zoo.model("bert", "text-classification"), model)
    config = json.loads((model / "config.json").read_text())
    config["model_type"] = "no-such-architecture"
    (model / "config.json").write_text(json.dumps(config))
    res = kiln("convert", str(model), "--out", str(tmp_path / "a"))
    assert_one_line_error(res, "no-such-architecture")


def test_unwritable_output_folder(zoo, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file where a folder should be")
    res = kiln("convert", str(zoo.model("bert", "text-classification")), "--out", str(blocker / "artifact"))
    assert_one_line_error(res, "cannot write")


def test_existing_output_needs_force(zoo, tmp_path):
    out = tmp_path / "a"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    res = kiln("convert", str(zoo.model("bert", "text-classification")), "--out", str(out))
    assert_one_line_error(res, "already exists", "--force")
    assert (out / "keep.txt").read_text() == "mine"


def test_failed_validation_leaves_nothing_behind(zoo, tmp_path):
    impossible = dict(DEFAULT_TOLERANCES, fp32=Tolerance(max_abs_diff=-1, min_cosine=2, min_mean_cosine=2, min_agreement=2))
    with pytest.raises(ValidationFailedError, match="no variant passed"):
        convert(ConvertConfig(model=str(zoo.model("distilbert", "text-classification")), out=tmp_path / "a",
                              precisions=("fp32",), tolerances=impossible, timing_seconds=0.02))
    assert list(tmp_path.iterdir()) == []  # no artifact, no temporary folder


def test_interrupted_conversion_leaves_nothing_behind(zoo, tmp_path):
    def interrupt(description):
        if description.startswith("Validating"):
            raise KeyboardInterrupt
        import contextlib

        return contextlib.nullcontext()

    with pytest.raises(KeyboardInterrupt):
        convert(ConvertConfig(model=str(zoo.model("distilbert", "text-classification")), out=tmp_path / "a",
                              timing_seconds=0.02), steps=interrupt)
    assert list(tmp_path.iterdir()) == []


def test_force_replaces_atomically(zoo, tmp_path):
    out = tmp_path / "a"
    cfg = ConvertConfig(model=str(zoo.model("distilbert", "text-classification")), out=out, precisions=("fp32",),
                        timing_seconds=0.02)
    convert(cfg)
    with pytest.raises(OutputNotWritableError):
        convert(cfg)
    cfg.force, cfg.precisions = True, ("fp32", "int8")
    manifest = convert(cfg)
    assert [p.name for p in tmp_path.iterdir()] == ["a"]
    assert {v.name for v in manifest.kept_variants()} <= {"fp32", "int8"} and (out / "kiln.json").is_file()


def test_cli_convert_prints_the_variant_table(zoo, tmp_path):
    res = kiln("convert", str(zoo.model("mpnet", "question-answering")), "--out", str(tmp_path / "qa"),
               "--precision", "fp32,int8", "--threads", "1")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "question-answering" in res.stdout and "fp32" in res.stdout and "int8" in res.stdout
    assert "✓ Exporting to ONNX" in res.stderr
