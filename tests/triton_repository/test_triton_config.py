"""`kiln triton` repositories without a server: every config.pbtxt is parsed with Triton's own
ModelConfig protobuf schema (tritonclient.grpc.model_config_pb2), so a misspelled field or a
wrong enum fails here; the CLI's options and errors; the README's version record."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

model_config_pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")
from google.protobuf import text_format  # noqa: E402

from modelkiln.manifest import Manifest  # noqa: E402
from modelkiln.triton import config as cfg  # noqa: E402
from modelkiln.tasks import tensors as names  # noqa: E402
from modelkiln.triton import versions  # noqa: E402
from modelkiln.triton.repository import model_name, onnx_io, write_repository  # noqa: E402

TASKS = ["text-classification", "sentence-embeddings", "token-classification", "question-answering"]


def parse(text: str):
    return text_format.Parse(text, model_config_pb2.ModelConfig())


def kiln(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "modelkiln", *args], capture_output=True, text=True, timeout=120)


def test_schema_rejects_a_misspelled_field():
    with pytest.raises(text_format.ParseError):
        parse('name: "x"\nmax_batch_sise: 4\n')


@pytest.mark.parametrize("task", TASKS)
def test_onnxruntime_repository_configs_parse(zoo, tmp_path, task):
    artifact = zoo.artifact("roberta", task)  # roberta: no token_type_ids
    manifest = Manifest.load(artifact)
    out = write_repository(artifact, tmp_path / "repo", cfg.Options(max_batch_size=16, max_queue_delay_us=300, instances=2))
    name = model_name(manifest)
    configs = {p.parent.name: parse(p.read_text()) for p in out.glob("*/config.pbtxt")}
    assert set(configs) == {name, f"{name}_tokenize", f"{name}_model", f"{name}_postprocess"}

    model = configs[f"{name}_model"]
    assert model.platform == "onnxruntime_onnx" and model.default_model_filename == "model.onnx"
    assert model.max_batch_size == 16
    assert list(model.dynamic_batching.preferred_batch_size) == [8, 16]
    assert model.dynamic_batching.max_queue_delay_microseconds == 300
    assert model.instance_group[0].count == 2 and model.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_CPU
    assert [i.name for i in model.input] == manifest.input_names and "token_type_ids" not in manifest.input_names
    assert all(i.data_type == model_config_pb2.TYPE_INT64 and list(i.dims) == [-1] for i in model.input)
    assert not any(i.allow_ragged_batch for i in model.input)  # onnxruntime needs equal shapes: buckets
    assert [o.name for o in model.output] == manifest.output_names
    # the graph under Triton's name, its weights under the name the graph gives them: onnxruntime (as
    # Triton's backend) loads it from the version folder and gives the variant's answers
    import numpy as np
    import onnxruntime as ort

    version = out / f"{name}_model" / "1"
    chosen = next(v for v in manifest.kept_variants() if (artifact / (v.file + ".data")).is_file()
                  and (version / (v.file + ".data")).is_file())
    feeds = {n: np.ones((2, 5), np.int64) for n in manifest.input_names}
    copied = ort.InferenceSession(str(version / "model.onnx")).run(None, feeds)
    original = ort.InferenceSession(str(artifact / chosen.file)).run(None, feeds)
    assert all(np.array_equal(a, b) for a, b in zip(copied, original))

    tokenize = configs[f"{name}_tokenize"]
    assert tokenize.backend == "python" and [o.name for o in tokenize.output] == manifest.input_names
    required, optional = names.TASK_INPUTS[task]
    assert [i.name for i in tokenize.input] == list(required + optional)
    assert tokenize.parameters["pad_to_buckets"].string_value == "true"
    assert [i.optional for i in tokenize.input] == [False] * len(required) + [True] * len(optional)

    ensemble = configs[name]
    assert ensemble.platform == "ensemble"
    assert [o.name for o in ensemble.output] == list(names.TASK_OUTPUTS[task])
    steps = ensemble.ensemble_scheduling.step
    assert [s.model_name for s in steps] == [f"{name}_tokenize", f"{name}_model", f"{name}_postprocess"]
    # Every tensor a step reads is an ensemble input or an earlier step's output.
    available = {i.name for i in ensemble.input}
    for step in steps:
        assert set(step.input_map.values()) <= available
        available |= set(step.output_map.values())
    assert {o.name for o in ensemble.output} <= available

    # The python models carry what they import, generated from the installed package.
    for part in ("tokenize", "postprocess"):
        version = out / f"{name}_{part}" / "1"
        assert (version / "model.py").is_file() and (version / "kiln.json").is_file()
        assert (version / "modelkiln" / "tasks" / "base.py").read_text() == (
            Path(cfg.__file__).parents[1] / "tasks" / "base.py").read_text()
    if task == "sentence-embeddings":
        assert list(configs[name].output[0].dims) == [onnx_io(artifact / manifest.fastest_variant().file).outputs[0].dims[-1]]


def test_python_backend_and_gpu_configs(zoo, tmp_path):
    artifact = zoo.artifact("bert", "text-classification")
    out = write_repository(artifact, tmp_path / "repo",
                           cfg.Options(model_backend="python", kind="gpu", threads=2, max_batch_size=4))
    name = model_name(Manifest.load(artifact))
    model = parse((out / f"{name}_model" / "config.pbtxt").read_text())
    assert model.backend == "python" and not model.platform
    assert model.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_GPU
    assert model.parameters["intra_op_thread_count"].string_value == "2"
    # The python model pads batches itself: ragged inputs, and each request keeps its own width.
    assert all(i.allow_ragged_batch for i in model.input)
    tokenize = parse((out / f"{name}_tokenize" / "config.pbtxt").read_text())
    assert tokenize.parameters["pad_to_buckets"].string_value == "false"
    assert (out / f"{name}_model" / "1" / "model.py").is_file()


def test_an_openvino_variant_runs_in_the_python_backend_only(zoo, tmp_path):
    pytest.importorskip("nncf", reason="the nncf extra is not installed (pip install 'modelkiln[nncf]')")
    from modelkiln.triton.repository import TritonOptionError, openvino_io

    artifact = zoo.artifact("bert", "sentence-embeddings", ("fp32", "openvino-int8"))
    manifest = Manifest.load(artifact)
    name = model_name(manifest)
    with pytest.raises(TritonOptionError, match="--model-backend python"):
        write_repository(artifact, tmp_path / "refused", cfg.Options(), variant="openvino-int8")
    assert not (tmp_path / "refused").exists()
    # the onnxruntime backend's own choice: the fastest variant it runs as kiln does (fp32 here)
    plain = write_repository(artifact, tmp_path / "plain", cfg.Options())
    assert "`fp32`" in (plain / "README.md").read_text()
    out = write_repository(artifact, tmp_path / "repo", cfg.Options(model_backend="python"), variant="openvino-int8")
    model = parse((out / f"{name}_model" / "config.pbtxt").read_text())
    assert model.backend == "python" and model.parameters["variant"].string_value == "openvino-int8"
    files = sorted(p.name for p in (out / f"{name}_model" / "1").glob("model.*"))
    assert files == ["model.openvino-int8.bin", "model.openvino-int8.xml", "model.py"]
    io = openvino_io(artifact / "model.openvino-int8.xml")
    assert [i.name for i in model.input] == [t.name for t in io.inputs] == manifest.input_names
    assert [list(o.dims) for o in model.output] == [[-1, 32]]
    readme = (out / "README.md").read_text()
    assert "python backend running openvino" in readme and "pip install tokenizers openvino" in readme


@pytest.mark.parametrize("task", TASKS)
def test_tensorrt_plan_config_parses(zoo, task):
    """No TensorRT here, so the plan itself cannot be built; its config is still checked as text."""
    artifact = zoo.artifact("bert", task)
    manifest = Manifest.load(artifact)
    io = onnx_io(artifact / manifest.variant("fp32").file)
    opts = cfg.Options(model_backend="tensorrt", kind="gpu", max_batch_size=8)
    model = parse(cfg.model_config(manifest, opts, io.inputs, io.outputs).to_pbtxt())
    assert model.platform == "tensorrt_plan" and model.default_model_filename == "model.plan"
    assert model.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_GPU
    assert [i.name for i in model.input] == manifest.input_names


def test_cli_writes_a_repository_with_readme(zoo, tmp_path):
    artifact = zoo.artifact("bert", "sentence-embeddings")
    result = kiln("triton", str(artifact), str(tmp_path / "repo"), "--max-batch-size", "8")
    assert result.returncode == 0, result.stderr
    readme = (tmp_path / "repo" / "README.md").read_text()
    manifest = Manifest.load(artifact)
    assert "tritonserver --model-repository=/models" in readme
    assert "nvcr.io/nvidia/tritonserver:" in readme
    assert f"onnxruntime {manifest.versions['onnxruntime']}" in readme
    assert f"opset {manifest.opset}" in readme
    # Existing output is never overwritten without --force, and nothing half-written is left.
    again = kiln("triton", str(artifact), str(tmp_path / "repo"))
    assert again.returncode == 2 and "already exists" in again.stderr
    assert kiln("triton", str(artifact), str(tmp_path / "repo"), "--force").returncode == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["repo"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model-backend", "tensorrt", "--kind", "gpu"], "needs the TensorRT Python package"),
        (["--model-backend", "tensorrt"], "add --kind gpu"),
        (["--model-backend", "openvino"], "--model-backend must be one of"),
        (["--max-batch-size", "0"], "--max-batch-size must be at least 1"),
        (["--kind", "tpu"], "--kind must be cpu or gpu"),
        (["--variant", "fp16"], "variant 'fp16' is not in artifact"),
    ],
)
def test_cli_errors_are_one_line(zoo, tmp_path, args, message):
    artifact = zoo.artifact("bert", "text-classification")
    result = kiln("triton", str(artifact), str(tmp_path / "repo"), *args)
    if message.startswith("needs the TensorRT") and _tensorrt_installed():
        pytest.skip("tensorrt is installed here")
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and len(result.stderr.strip().splitlines()) <= 3  # one line, maybe wrapped
    assert not (tmp_path / "repo").exists()


def _tensorrt_installed() -> bool:
    try:
        import tensorrt  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        return False
    return True


def test_version_record():
    assert versions.server_version("24.10") == "2.51.0"
    assert versions.server_version("25.03") == "2.56.0"
    assert "matches Triton" in versions.onnxruntime_note("1.20.1", 17)
    assert "NO known Triton release" in versions.onnxruntime_note("1.31.1", 17)
    assert "NO known Triton release" in versions.tensorrt_note("7.0.0")
    assert "24.10" in versions.tensorrt_note("10.5.0")


def test_bucket_widths():
    from modelkiln.triton.batching import bucket_width

    assert [bucket_width(n, 128) for n in (1, 8, 9, 16, 17, 100, 128)] == [8, 8, 16, 16, 32, 128, 128]
    assert bucket_width(200, 384) == 256 and bucket_width(300, 384) == 384


def test_stack_and_split_round_trip():
    import numpy as np

    from modelkiln.triton.batching import split, stack

    a = {"input_ids": np.ones((2, 3), np.int64), "attention_mask": np.ones((2, 3), np.int64)}
    b = {"input_ids": np.full((1, 5), 7, np.int64), "attention_mask": np.ones((1, 5), np.int64)}
    batch, sizes = stack([a, b], {"input_ids": 0})
    assert batch["input_ids"].shape == (3, 5) and batch["attention_mask"][:2, 3:].sum() == 0
    hidden = np.arange(3 * 5 * 2, dtype=np.float32).reshape(3, 5, 2)
    parts = split({"h": hidden}, sizes, per_token=True)
    assert parts[0]["h"].shape == (2, 3, 2) and parts[1]["h"].shape == (1, 5, 2)
    assert split({"logits": np.zeros((3, 4))}, sizes, per_token=False)[1]["logits"].shape == (1, 4)


# Each generated python model imports modelkiln from the snapshot next to it; a module missing from
# the snapshot would fail only inside tritonserver. Run each model file's imports with a stand-in
# for Triton's ``triton_python_backend_utils``, then import every module of the snapshot (what the
# model imports when it loads its engine), and check that every modelkiln module came from the snapshot.
_IMPORT_CHECK = """
import importlib, pathlib, runpy, sys, types
sys.modules["triton_python_backend_utils"] = types.ModuleType("triton_python_backend_utils")
folder = sys.argv[1]
runpy.run_path(folder + "/model.py")
for path in sorted(pathlib.Path(folder, "modelkiln").rglob("*.py")):
    importlib.import_module(".".join(path.relative_to(folder).with_suffix("").parts).removesuffix(".__init__"))
outside = sorted(n for n, m in sys.modules.items()
                 if n.split(".")[0] == "modelkiln" and not (getattr(m, "__file__", None) or folder).startswith(folder))
assert not outside, outside
"""


@pytest.mark.parametrize("template, files", [
    ("tokenize_model.py", "ENCODER_FILES"), ("postprocess_model.py", "ENCODER_FILES"),
    ("encoder_model.py", "ENCODER_FILES"), ("generate_model.py", "GENERATION_FILES"),
])
def test_each_python_model_imports_from_its_snapshot_alone(tmp_path, template, files):
    from modelkiln.triton import snapshot

    (tmp_path / "model.py").write_bytes((snapshot.MODELS_DIR / template).read_bytes())
    snapshot.copy_snapshot(tmp_path / "modelkiln", getattr(snapshot, files))
    r = subprocess.run([sys.executable, "-c", _IMPORT_CHECK, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
