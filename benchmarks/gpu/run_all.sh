#!/usr/bin/env bash
# The GPU run that docs/gpu.md describes, on a machine with a CUDA GPU, in two commands of at most 8 minutes
# each (a lent GPU's calls are limited to 10), or in one:
#
#   PART=1 bash benchmarks/gpu/run_all.sh OUT [ENCODER_FOLDER DECODER_FOLDER]   # tests, conversion, invariance, profile
#   PART=2 bash benchmarks/gpu/run_all.sh OUT [ENCODER_FOLDER DECODER_FOLDER]   # speed against PyTorch, kiln serve
#   bash benchmarks/gpu/run_all.sh OUT [...]                                    # both
#
# OUT receives each step's output. The model folders default to all-MiniLM-L6-v2 and SmolLM2-135M-Instruct
# when installed; a folder with a configuration and tokenizer but no weights is run with random weights
# (speed and batch invariance do not depend on the weights' values). Each step has its own time limit
# (seconds, from the environment) so that one slow step leaves the others their time; the most telling
# come first. PYTHON picks the interpreter (default python3). DEVICE=cpu TINY=--tiny checks the script on a CPU
# (its figures mean nothing).
set -u
out=${1:?usage: run_all.sh OUT [ENCODER_FOLDER DECODER_FOLDER]}
py=${PYTHON:-python3}
part=${PART:-all}
device=${DEVICE:-cuda}
tiny=(${TINY:-})
mkdir -p "$out"
work=$(mktemp -d)
models=()
[ $# -ge 3 ] && models=(--encoder "$2" --decoder "$3")

step() {  # step PART NAME LIMIT COMMAND...: in that part, with a time limit, output to OUT/NAME.txt, say how it ended
    [ "$part" = all ] || [ "$part" = "$1" ] || return 0
    local name=$2 limit=$3; shift 3
    local started=$SECONDS
    # SIGABRT at the limit: Python's fault handler then prints where each thread was
    PYTHONFAULTHANDLER=1 timeout -s ABRT -k 5 "$limit" "$@" >"$out/$name.txt" 2>&1
    echo "$name: exit $? after $((SECONDS - started)) s (limit $limit s)" | tee -a "$out/steps.txt"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >"$out/gpu.txt" 2>&1
"$py" -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)' >>"$out/gpu.txt" 2>&1
cat "$out/gpu.txt"

step "$part" models "${MODELS_S:-60}" "$py" benchmarks/gpu/torch_engines.py "${models[@]}" "${tiny[@]}" --models-only "$work"
decoder=$(tail -n 1 "$out/models.txt" | cut -d: -f1)  # its last line: "FOLDER: what it holds"

# 1. the torch engines' tests under this machine's torch (the kernels' tests compare the Triton kernels on CUDA too;
#    not their interpreter check, which CI runs: triton 3.6's interpreter fails under numpy 2.5, where int() of a
#    one-element array is an error, before any kernel runs)
step 1 tests "${TESTS_S:-100}" "$py" -m pytest -q -x -p no:cacheprovider tests/generation/engines/test_torch_engine.py tests/generation/engines/torch tests/serve/test_torch_serving.py \
    --deselect tests/generation/engines/torch/test_kernels.py::test_the_triton_kernels_under_the_interpreter
# 2. conversion on the GPU: the gate checks greedy tokens against PyTorch and alone = batched, per precision
step 1 convert "${CONVERT_S:-120}" "$py" -m modelkiln convert "$decoder" --task text-generation --engine torch \
    --device "$device" --precision fp32,bf16 --out "$work/decoder-cuda"
# 3. batch invariance bit for bit: cuBLAS alone, then the engine with the invariant kernels on and off
step 1 batch-invariance "${INVARIANCE_S:-100}" "$py" experiments/torch_batch_invariance/measure.py \
    --artifact "$work/decoder-cuda" --device "$device" ${INVARIANCE_ARGS:---rows 16 --batches 1,16,64}
# 4. where a step's time goes (host or device), decode at 1 and 64 rows and a 2048-token prompt
step 1 profile "${PROFILE_S:-80}" "$py" benchmarks/gpu/profile_steps.py --artifact "$work/decoder-cuda" --device "$device"
# 5. speed against eager and compiled PyTorch, and kiln serve over HTTP
step 2 engines "${ENGINES_S:-420}" "$py" benchmarks/gpu/torch_engines.py --device "$device" "${tiny[@]}" "${models[@]}" \
    --rounds "${ROUNDS:-2}" ${ENGINES_ARGS:-} --out "$out/gpu-torch-engines.json"
rm -rf "$work"
