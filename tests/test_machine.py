"""Machines differ (an AVX2-only AMD EPYC, an AVX-512/AMX Intel Xeon): `kiln bench` names the CPU and
its vector extensions in the table header and the JSON, and `kiln convert` records them in the manifest,
all from one description (modelkiln.machine.cpu_description)."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import kiln
from modelkiln.machine import cpu_description, cpu_flags, matrix_engine, native_bf16, vector_extensions
from modelkiln.manifest import Manifest


def test_vector_extensions_of_the_project_machines():
    xeon = set("fpu avx f16c fma avx2 avx512f avx512bw avx512_vnni avx_vnni avx512_bf16 amx_bf16 amx_tile amx_int8".split())
    epyc = set("fpu avx f16c fma avx2 sse4_2".split())
    zen5 = set("fpu avx f16c fma avx2 avx512f avx512bw avx512_vnni avx_vnni avx512_bf16".split())
    assert vector_extensions(xeon) == "AVX2 FMA AVX-512 VNNI BF16 AMX"
    assert vector_extensions(zen5) == "AVX2 FMA AVX-512 VNNI BF16"
    assert vector_extensions(epyc) == "AVX2 FMA"
    assert vector_extensions(set("fp asimd sve".split())) == "NEON SVE"
    assert vector_extensions(set()) == ""


def test_the_matrix_engine_of_each_precision():
    xeon = set("avx2 fma avx512f avx512_vnni avx512_bf16 amx_tile amx_bf16 amx_int8".split())
    epyc_zen5 = set("avx2 fma avx512f avx512_vnni avx_vnni avx512_bf16".split())
    epyc_zen3 = set("avx2 fma".split())
    assert [matrix_engine(p, "cpu", xeon) for p in ("bf16", "int8", "fp32")] == ["AMX", "VNNI", "AVX-512"]
    assert [matrix_engine(p, "cpu", epyc_zen5) for p in ("bf16", "int8", "fp32")] == ["AVX-512 BF16", "VNNI", "AVX-512"]
    assert [matrix_engine(p, "cpu", epyc_zen3) for p in ("int8", "fp32")] == ["AVX2", "AVX2"]
    assert native_bf16(epyc_zen3) is None and matrix_engine("bf16", "cpu", epyc_zen3).startswith("emulated")
    assert matrix_engine("fp16", "cuda", epyc_zen3) == "GPU"


def test_this_machine_is_described():
    machine = cpu_description()
    assert machine["cpu"] and machine["cores"] >= 1
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():  # Linux: the first processor's model name and flags
        lines = cpuinfo.read_text().splitlines()
        model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), None)
        flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
        assert model is None or machine["cpu"] == model
        assert ("AVX2" in machine["isa"].split()) == ("avx2" in flags)


def test_convert_records_the_machine_in_the_manifest(zoo, tiny_generation_artifact):
    for folder in (zoo.artifact("bert", "sentence-embeddings"), tiny_generation_artifact):  # encoder, generation
        assert Manifest.load(folder).machine == cpu_description()


def test_bench_names_the_cpu_and_its_extensions(zoo, tmp_path):
    res = kiln("bench", str(zoo.artifact("bert", "sentence-embeddings")), "--batch", "1", "--seq", "16", "--threads", "1",
               "--variants", "fp32", "--no-reference", "--min-iters", "3", "--min-seconds", "0.01",
               "--json", str(tmp_path / "bench.json"))
    assert res.returncode == 0, res.stderr[-3000:]
    machine = cpu_description()
    header = f"{machine['cpu']} ({machine['isa']})" if machine["isa"] else machine["cpu"]
    assert f"— {header}, 1 threads" in " ".join(res.stdout.split())  # the title may wrap
    data = json.loads((tmp_path / "bench.json").read_text())
    recorded = data["machine"]
    assert {key: recorded[key] for key in machine} == machine and recorded["threads"] == 1
    assert {c["matrix_engine"] for c in data["cells"]} == {matrix_engine("fp32", "cpu", cpu_flags())}
