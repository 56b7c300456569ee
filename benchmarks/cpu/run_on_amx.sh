#!/usr/bin/env bash
# Every figure kiln's AMX paths still need, in one run, on a CPU with AMX (Intel Xeon, Sapphire Rapids or later).
# The development machine these paths were written on had none: the AMX kernels were tested there only over a C
# model of their tiles. From the repository root, after `make install`:
#   bash benchmarks/cpu/run_on_amx.sh OUT
# It first builds what it compares against, each once, under PEERS (default OUT/peers; what is there already is
# kept, so a stopped run goes on where it stopped):
#   - wrk (apt-get), which drives the served encoders;
#   - llama-server and llama-quantize from the llama.cpp in the llama-cpp-python 0.3.36 sdist, AMX off (its AMX
#     code crashed on these Xeons), with the flags `kiln bench` names for the CPU;
#   - OpenVINO GenAI in a virtual environment of its own, and SmolLM2 exported for it (int4, groups of 64);
#   - the Qwen2.5-0.5B and Llama-3.2-1B shapes (random weights, Q4_K_M: model_shapes.py) and kiln artifacts of them.
# Then it measures, each step into OUT/<step>.txt (a failed step does not stop the others), KILN_AMX=0 being the
# same build with the AVX-512 kernels:
#   1. the AMX kernels against the AVX-512 ones, bit for bit, on the unit itself, and beside onnxruntime's own AMX
#      GEMM in one thread (KILN_AMX=1 pytest);
#   2. the kernels alone, one thread: AMX, AVX-512 VNNI, AVX2 at 1, 4, 8, 12, 16, 64 rows (gguf_kernels.py; 8 and 12:
#      whether AMX from 8 rows on, gguf_ops.c's AMX_MIN_ROWS, is where it starts to win);
#   3. MiniLM: every variant converted (OpenVINO's too; the gate checks alone = batched), STS-B of each, in process
#      at 1 x 16 and 1 x 128 (openvino_vs_onnxruntime.py) and served at c1 and c16 (serve_variants_ab.sh);
#   4. SmolLM2 (converted afresh): `kiln bench` prefill of 16, 128 and 512 tokens and decode steps, AMX off and on;
#   5. SmolLM2 in process at 1, 16 and 64 streams, greedy and sampled: kiln with AMX on against OpenVINO GenAI,
#      and kiln with AMX off (inprocess_engines.py; answers changed by load counted for each);
#   6. the 0.5B and 1B shapes served against llama-server at 1 and 16 streams, greedy and sampled, AMX on.
# OUT/goals.txt then puts each goal beside its figures (amx_goals.py). A CPU without AMX stops here with exit 2, unless
# REHEARSE=1 (runs every step but the AMX-on ones: to try the script on another machine) or REHEARSE=amx (the AMX-on
# steps too, where KILN_AMX=1 is refused and says why: their plumbing, and goals.txt's flag); ROUNDS=N (default 2)
# sets the interleaved rounds of steps 3 to 6; ONLY="minilm-served smollm2-inprocess-*" runs those steps again
# into the same OUT (their names are OUT's .txt files).
set -uo pipefail
OUT=${1:?usage: run_on_amx.sh OUT}
if grep -qw amx_int8 /proc/cpuinfo; then AMX_MODES="0 1"
elif [ "${REHEARSE:-0}" = 1 ]; then AMX_MODES="0"; echo "REHEARSE=1: no AMX here, the AMX-on steps are left out"
elif [ "${REHEARSE:-0}" = amx ]; then AMX_MODES="0 1"
  echo "REHEARSE=amx: no AMX here; the AMX-on steps run all the same, with KILN_AMX=1 refused (their plumbing, not AMX)"
else echo "this CPU has no AMX-INT8: nothing to measure here (REHEARSE=1 tries the script without it)" >&2; exit 2
fi
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
PEERS=${PEERS:-$OUT/peers}
ROUNDS=${ROUNDS:-2}
PY=${PYTHON:-$PWD/.venv/bin/python}
export PATH="$(dirname "$PY"):$PATH"
mkdir -p "$PEERS"
AMX_ON=${AMX_MODES##* }  # 1 where the CPU has AMX, else 0
{ "$PY" -c "from modelkiln.machine import cpu_description; print(cpu_description())"
  lscpu | grep -E "Model name|CPU family|^Model:|^CPU\(s\)"
  grep -m1 -o -E "amx[a-z_0-9]*" /proc/cpuinfo | sort -u | tr '\n' ' '; echo
  git log -1 --format="build %h %s"; date -u
  [ "${REHEARSE:-0}" = amx ] && echo "REHEARSE=amx"; } | tee "$OUT/cpu.txt"

step() {  # step NAME COMMAND...: run, tee its output to OUT/NAME.txt, report its exit status
  if [ -n "${ONLY:-}" ] && [[ $1 != prepare-* ]]; then  # ONLY: the steps to run again (patterns); peers are kept
    local pattern wanted=0
    for pattern in $ONLY; do [[ $1 == $pattern ]] && wanted=1; done
    [ $wanted = 1 ] || return 0
  fi
  echo "== $1: ${*:2}" | tee "$OUT/$1.txt"
  "${@:2}" 2>&1 | tee -a "$OUT/$1.txt"
  echo "== $1: exit ${PIPESTATUS[0]}" | tee -a "$OUT/$1.txt"
}

# ---- what the figures are measured against (PEERS)
LLAMA_CPP=$PEERS/llama_cpp_python-0.3.36/vendor/llama.cpp
OV_PY=$PEERS/ov-venv/bin/python
SMOLLM2_GGUF=$("$PY" -m modelkiln.embedded SmolLM2-135M-Instruct)

build_llama_cpp() {
  [ -x "$LLAMA_CPP/build/bin/llama-server" ] && [ -x "$LLAMA_CPP/build/bin/llama-quantize" ] && return 0
  if [ ! -d "$LLAMA_CPP" ]; then
    "$PY" -m pip download -q --no-deps --no-binary=:all: llama-cpp-python==0.3.36 -d "$PEERS" &&
      tar xzf "$PEERS/llama_cpp_python-0.3.36.tar.gz" -C "$PEERS" || return 1
  fi
  command -v cmake > /dev/null || "$PY" -m pip install -q cmake || return 1
  local flags
  flags=$("$PY" -c "from modelkiln.bench.generation_backends import llama_cpp_cmake_args
from modelkiln.machine import cpu_flags; print(llama_cpp_cmake_args(cpu_flags()))") || return 1
  echo "cmake flags: $flags"
  # shellcheck disable=SC2086  # the flags are words
  cmake -S "$LLAMA_CPP" -B "$LLAMA_CPP/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF $flags > /dev/null &&
    cmake --build "$LLAMA_CPP/build" --target llama-server llama-quantize -j"$(nproc)" 2>&1 | tail -3
}

build_openvino_genai() {  # its own environment: its pins (optimum-intel, a newer transformers) are not ours.
  # torch stays the CPU wheel: named again with the rest, or optimum-intel's torchvision pulls the newest (CUDA)
  # torch; then torchvision goes (built for another torch, it breaks the export: "torchvision::nms does not exist")
  if [ ! -x "$OV_PY" ]; then
    python3 -m venv "$PEERS/ov-venv" &&
      "$OV_PY" -m pip install -q --upgrade pip &&
      { "$OV_PY" -m pip install -q --retries 0 --timeout 5 --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 ||
        "$OV_PY" -m pip install -q torch==2.13.0; } &&
      "$OV_PY" -m pip install -q torch==2.13.0 openvino-genai optimum-intel nncf transformers gguf accelerate &&
      { "$OV_PY" -m pip uninstall -q -y torchvision 2> /dev/null; true; } || { rm -rf "$PEERS/ov-venv"; return 1; }
  fi
  "$OV_PY" -m pip list 2> /dev/null | grep -i -E "^(openvino|optimum|torch|transformers) "
  if [ ! -d "$PEERS/smollm2-hf" ]; then  # transformers reads the GGUF dequantized; saved without its quantization
    "$PY" -c "import sys; from modelkiln.bench.generation_backends import hf_folder; hf_folder(sys.argv[1], sys.argv[2])" \
      "$SMOLLM2_GGUF" "$PEERS/smollm2-hf.partial" && mv "$PEERS/smollm2-hf.partial" "$PEERS/smollm2-hf" || return 1
  fi
  if [ ! -d "$PEERS/smollm2-ov-int4" ]; then  # groups of 64: the default 128 does not divide SmolLM2's 576 channels
    "$(dirname "$OV_PY")/optimum-cli" export openvino --model "$PEERS/smollm2-hf" --task text-generation-with-past \
      --weight-format int4 --group-size 64 "$PEERS/smollm2-ov-int4.partial" | tail -3 &&
      mv "$PEERS/smollm2-ov-int4.partial" "$PEERS/smollm2-ov-int4"
  fi
}

make_shapes() {  # the two shapes' Q4_K_M files and kiln artifacts of them (kiln's default variant: gguf)
  "$PY" -c "import sentencepiece" 2> /dev/null || "$PY" -m pip install -q sentencepiece || return 1
  "$PY" benchmarks/generation/model_shapes.py --llama-cpp "$LLAMA_CPP" --out "$PEERS/models" \
    --shapes Qwen2.5-0.5B-Instruct,Llama-3.2-1B-Instruct --types Q4_K_M || return 1
  local shape
  for shape in Qwen2.5-0.5B-Instruct Llama-3.2-1B-Instruct; do
    [ -f "$PEERS/art-$shape/kiln.json" ] && continue
    kiln convert "$PEERS/models/$shape-random/$shape-random.Q4_K_M.gguf" --task text-generation \
      --out "$PEERS/art-$shape" --threads 2 --force | tail -4 || return 1
  done
}

install_load_generators() {  # serve_variants_ab.sh drives the encoders with wrk
  command -v wrk > /dev/null && return 0
  apt-get install -y -q wrk hey > /dev/null || sudo apt-get install -y -q wrk hey > /dev/null
  command -v wrk
}

step prepare-load-generators install_load_generators
step prepare-llama-cpp build_llama_cpp
step prepare-openvino-genai build_openvino_genai
step prepare-shapes make_shapes
export LLAMA_SERVER=$LLAMA_CPP/build/bin/llama-server

# ---- 1, 2: the kernels
[ "$AMX_ON" = 1 ] && step amx-tests env KILN_AMX=1 "$PY" -m pytest -q -rs tests/native
step gguf-kernels "$PY" benchmarks/generation/gguf_kernels.py --rows 1,4,8,12,16,64 --json "$OUT/gguf-kernels.json"

# ---- 3: MiniLM (encoders do not use KILN_AMX: onnxruntime's and OpenVINO's own kernels choose)
MINILM=$("$PY" -m modelkiln.embedded all-MiniLM-L6-v2)
step minilm-convert kiln convert "$MINILM" --out "$OUT/minilm" --threads 2 --force
step minilm-eval kiln eval "$OUT/minilm" --threads 2
kept_of() {  # kept_of ARTIFACT NAME...: those of the NAMEs the artifact kept (openvino-bf16 only where bf16 is native)
  "$PY" -c "import sys; from modelkiln.manifest import Manifest
kept = {v.name for v in Manifest.load(sys.argv[1]).kept_variants()}; print(' '.join(n for n in sys.argv[2:] if n in kept))" "$@"
}
INPROCESS_VARIANTS=$(kept_of "$OUT/minilm" fp32 int8 openvino-fp32 openvino-bf16 openvino-int8)
step minilm-inprocess "$PY" benchmarks/encoders/openvino_vs_onnxruntime.py "$OUT/minilm" --threads 2 --rounds 7 \
  --variants "${INPROCESS_VARIANTS// /,}" --out "$OUT/openvino-minilm"
step minilm-served bash benchmarks/encoders/serve_variants_ab.sh "$OUT/minilm" "$OUT/serve-minilm" \
  "$(kept_of "$OUT/minilm" int8 openvino-int8 openvino-bf16)" "$ROUNDS"

# ---- 4: SmolLM2's prefill and decode steps
step smollm2-convert kiln convert "$SMOLLM2_GGUF" --task text-generation --out "$OUT/smollm2" --threads 2 --force
for amx in $AMX_MODES; do
  step "smollm2-bench-amx$amx" env KILN_AMX="$amx" kiln bench "$OUT/smollm2" --threads 2 --seq 16,128,512 \
    --batch 1,16,64 --peers none --no-reference --json "$OUT/smollm2-bench-amx$amx.json"
done

# ---- 5: SmolLM2 in process, against OpenVINO GenAI
for mode in sampled greedy; do
  step "smollm2-inprocess-$mode-amx$AMX_ON" env KILN_AMX="$AMX_ON" "$PY" benchmarks/generation/inprocess_engines.py \
    "$OUT/smollm2" --engines kiln,openvino-genai --ov-model "$PEERS/smollm2-ov-int4" --openvino-python "$OV_PY" \
    --mode $mode --streams 1,16,64 --rounds "$ROUNDS" --out "$OUT/smollm2-inprocess-$mode-amx$AMX_ON"
  [ "$AMX_ON" = 1 ] && step "smollm2-inprocess-$mode-amx0" env KILN_AMX=0 "$PY" \
    benchmarks/generation/inprocess_engines.py "$OUT/smollm2" --engines kiln --mode $mode --streams 1,16,64 \
    --rounds "$ROUNDS" --out "$OUT/smollm2-inprocess-$mode-amx0"
done

# ---- 6: the 0.5B and 1B shapes served, against llama-server on the same file
for shape in Qwen2.5-0.5B-Instruct Llama-3.2-1B-Instruct; do
  step "served-$shape" env KILN_AMX="$AMX_ON" "$PY" benchmarks/generation/generation_servers.py \
    --servers "kiln serve,llama-server" --kiln-protocols openai-chat --artifact "$PEERS/art-$shape" \
    --gguf "$PEERS/models/$shape-random/$shape-random.Q4_K_M.gguf" --modes greedy,sampled --concurrency 1,16 \
    --rounds "$ROUNDS" --max-inputs 32 --out "$OUT/served-$shape"
done

# each goal beside its figures (amx_goals.py reads the files above; a missing one is named, never filled in)
"$PY" benchmarks/cpu/amx_goals.py "$OUT" --write "$OUT/goals.txt"
grep -h "^== .*: exit" "$OUT"/*.txt
echo "done: $OUT"
