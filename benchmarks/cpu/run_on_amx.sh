#!/usr/bin/env bash
# Everything kiln's AMX paths still need measured, in one run, on a CPU with AMX (Intel Xeon, Sapphire Rapids
# or later). The development machine these paths were written on had none: the AMX kernels were tested there
# only over a C model of their tiles. Run from the repository root after `make install` and `make demo`:
#   bash benchmarks/cpu/run_on_amx.sh OUT [SMOLLM2_ARTIFACT] [GGUF_ARTIFACT_0.5B GGUF_0.5B]
# Each step writes under OUT and says what it ran; a failed step does not stop the others.
#   1. the AMX kernels against the AVX-512 ones, bit for bit, on the unit itself (KILN_AMX=1 pytest);
#   2. the kernels alone, one thread: AMX, AVX-512 VNNI, AVX2 at 1, 4, 16, 64 rows (gguf_kernels.py);
#   3. MiniLM: every variant converted (OpenVINO's too), in process (openvino_vs_onnxruntime.py) and served
#      (serve_variants_ab.sh: int8, openvino-int8, openvino-bf16);
#   4. SmolLM2 in process at 1, 16, 64 streams, greedy and sampled, AMX off and on (inprocess_engines.py, kiln alone;
#      OpenVINO GenAI's row needs its own environment: docs/generation-results.md says how);
#   5. with a 0.5B-shape GGUF artifact: served against llama-server at 1 and 16 streams, AMX on.
set -uo pipefail
OUT=${1:?usage: run_on_amx.sh OUT [SMOLLM2_ARTIFACT] [ARTIFACT_0.5B GGUF_0.5B]}
LLM=${2:-artifacts/smollm2}
ART05=${3:-} GGUF05=${4:-}
PY=${PYTHON:-.venv/bin/python}
export PATH="$PWD/.venv/bin:$PATH" PYTHONPATH=src
mkdir -p "$OUT"
grep -qw amx_int8 /proc/cpuinfo || { echo "this CPU has no AMX-INT8: nothing to measure here" >&2; exit 2; }
"$PY" -c "from modelkiln.machine import cpu_description; print(cpu_description())" | tee "$OUT/cpu.txt"

step() {  # step NAME COMMAND...: run, tee its output to OUT/NAME.txt, report its exit status
  echo "== $1: ${*:2}" | tee "$OUT/$1.txt"
  "${@:2}" 2>&1 | tee -a "$OUT/$1.txt"
  echo "== $1: exit ${PIPESTATUS[0]}" | tee -a "$OUT/$1.txt"
}

step amx-tests env KILN_AMX=1 "$PY" -m pytest -q -rs tests/native
step gguf-kernels "$PY" benchmarks/generation/gguf_kernels.py --rows 1,4,16,64 --json "$OUT/gguf-kernels.json"

MODEL=$("$PY" -m modelkiln.embedded all-MiniLM-L6-v2)
step minilm-convert kiln convert "$MODEL" --out "$OUT/minilm" --threads 2 --force
step minilm-inprocess "$PY" benchmarks/encoders/openvino_vs_onnxruntime.py "$OUT/minilm" --threads 2 --rounds 7 \
  --out "$OUT/openvino-minilm"
step minilm-served bash benchmarks/encoders/serve_variants_ab.sh "$OUT/minilm" "$OUT/serve-minilm" \
  "int8 openvino-int8 openvino-bf16" 2

for mode in greedy sampled; do
  for amx in 0 1; do
    step "smollm2-inprocess-$mode-amx$amx" env KILN_AMX=$amx "$PY" benchmarks/generation/inprocess_engines.py "$LLM" \
      --engines kiln --mode $mode --streams 1,16,64 --rounds 2 --out "$OUT/smollm2-inprocess-$mode-amx$amx"
  done
done

if [ -n "$ART05" ] && [ -n "$GGUF05" ]; then
  step served-0.5b env KILN_AMX=1 "$PY" benchmarks/generation/generation_servers.py --servers "kiln serve,llama-server" \
    --kiln-protocols openai-chat --artifact "$ART05" --gguf "$GGUF05" --modes greedy,sampled --concurrency 1,16 \
    --rounds 2 --max-inputs 32 --out "$OUT/served-0.5b"
fi
echo "done: $OUT"
