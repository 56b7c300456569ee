"""Every install hint that names an extra reaches the terminal with its brackets: rich takes
"[llamacpp]" in "pip install 'modelkiln[llamacpp]'" for a markup tag and drops it unless the text is
escaped. Each hint is rendered through the paths the CLI prints hints on: a bench note, a bench
skipped line and an error line. And the llama.cpp hint builds llama.cpp without its AMX code."""

from __future__ import annotations

import re
from importlib.metadata import metadata

import pytest

from helpers import SRC
from modelkiln import cli
from modelkiln.bench.generation import GenerationBenchConfig, GenerationBenchResult
from modelkiln.bench.generation_backends import llama_cpp_cmake_args, llama_cpp_install_hint
from modelkiln.bench.generation_report import print_generation_bench
from modelkiln.bench.report import print_table
from modelkiln.bench.runner import BenchConfig, BenchResult, machine_info
from modelkiln.errors import KilnError
from modelkiln.extras import install_hint

EXTRAS = metadata("modelkiln").get_all("Provides-Extra") or []
XEON_AMX = set("fpu sse4_2 avx f16c fma avx2 avx512f avx512bw avx512_vnni avx512_bf16 avx512vbmi amx_bf16 amx_tile amx_int8".split())
EPYC_AVX2 = set("fpu sse4_2 avx f16c fma avx2".split())
HINTS = [install_hint(extra) for extra in EXTRAS] + [llama_cpp_install_hint(flags) for flags in (XEON_AMX, EPYC_AVX2, set())]
HINT_IDS = EXTRAS + ["llamacpp-on-xeon-amx", "llamacpp-on-epyc-avx2", "llamacpp-without-avx2"]


def test_every_extra_is_covered():
    assert {"convert", "serve", "loadtest", "ray", "llamacpp", "test"} <= set(EXTRAS)


def test_no_install_hint_is_written_by_hand():
    """Hints naming an extra come from extras.install_hint, so the rendering tests below cover them all."""
    by_hand = [f"{path.relative_to(SRC)}:{n}" for path in SRC.rglob("*.py") if path.name != "extras.py"
               for n, line in enumerate(path.read_text().splitlines(), 1) if re.search(r"pip install '?modelkiln\[", line)]
    assert by_hand == []


@pytest.mark.parametrize("hint", HINTS, ids=HINT_IDS)
def test_bench_notes_keep_the_brackets(hint, capsys):
    machine = machine_info(1)
    print_generation_bench(cli.out, GenerationBenchResult("m", "text-generation", [], [f"peer: {hint}"], machine,
                                                          GenerationBenchConfig()))
    print_table(cli.out, BenchResult("m", "sentence-embeddings", [], [f"peer: {hint}"], machine, BenchConfig()))
    printed = capsys.readouterr().out.splitlines()
    assert f"note: peer: {hint}" in printed and f"skipped: peer: {hint}" in printed  # whole, on one line


@pytest.mark.parametrize("hint", HINTS, ids=HINT_IDS)
def test_error_lines_keep_the_brackets(hint, capsys, monkeypatch):
    def command():
        raise KilnError(f"this needs more: {hint}")

    monkeypatch.setattr(cli, "app", command)
    with pytest.raises(SystemExit) as exited:
        cli.main()
    assert exited.value.code == 2
    assert f"error: this needs more: {hint}" in " ".join(capsys.readouterr().err.split())  # an error line may wrap


def test_llama_cpp_is_built_without_amx_where_the_cpu_has_it():
    xeon = llama_cpp_cmake_args(XEON_AMX).split()
    assert xeon[0] == "-DGGML_NATIVE=OFF" and "-DGGML_NATIVE=ON" not in xeon
    assert {"-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON",
            "-DGGML_AVX512_BF16=ON", "-DGGML_AVX512_VBMI=ON"} <= set(xeon)
    assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(xeon)
    assert llama_cpp_cmake_args(EPYC_AVX2) == "-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
    # an AVX-512 CPU without VNNI/BF16/VBMI (Skylake-X) gets none of those instructions
    assert llama_cpp_cmake_args(EPYC_AVX2 | {"avx512f"}).endswith("-DGGML_AVX512=ON")
    assert llama_cpp_cmake_args({"neon", "asimd"}) == ""  # no AVX2: llama.cpp's own default build
    assert llama_cpp_install_hint(set()) == "pip install 'modelkiln[llamacpp]' (compiles llama.cpp, minutes)"
    assert llama_cpp_install_hint(EPYC_AVX2).startswith('CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON')
