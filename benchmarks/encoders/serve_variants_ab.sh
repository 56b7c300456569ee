#!/bin/bash
# Two variants of one encoder artifact served by `kiln serve`, in interleaved fresh-server rounds:
#   - STS-B sentences (short), /predict, wrk at concurrency 1 and 16 (benchmarks/serving/serve_bench.py);
#   - SQuAD paragraphs (the longer half), kiln loadtest at concurrency 16 with --check (every answer under
#     load compared with the same request alone).
# Usage: bash benchmarks/encoders/serve_variants_ab.sh ARTIFACT OUT [VARIANTS] [ROUNDS]
#   e.g. bash benchmarks/encoders/serve_variants_ab.sh artifacts/all-MiniLM-L6-v2 \
#            benchmarks/results/serve-minilm-openvino-int8 "int8 openvino-int8" 3
set -euo pipefail
ARTIFACT=$1 OUT=$2 VARIANTS=${3:-"int8 openvino-int8"} ROUNDS=${4:-3}
PY=${PYTHON:-.venv/bin/python} KILN=${KILN:-.venv/bin/kiln} PORT=${PORT:-8123}
NAME=$(basename "$ARTIFACT")
mkdir -p "$OUT"
"$PY" -c "from modelkiln.machine import cpu_description; print(cpu_description())" > "$OUT/cpu.txt"
for r in $(seq "$ROUNDS"); do
  for v in $VARIANTS; do
    "$PY" benchmarks/serving/serve_bench.py --artifact "$ARTIFACT" --concurrency 1,16 --duration 15 --rounds 1 \
      --pairs 0 --server-args "--variant $v" --json "$OUT/$v-round$r.json" > "$OUT/$v-round$r.txt" 2>&1
    echo "round $r $v: STS-B done"
  done
done
for r in $(seq "$ROUNDS"); do
  for v in $VARIANTS; do
    "$KILN" serve "$ARTIFACT" --port "$PORT" --variant "$v" > "$OUT/serve-$v.log" 2>&1 &
    pid=$!
    for _ in $(seq 60); do curl -sf "localhost:$PORT/v2/health/ready" > /dev/null && break; sleep 1; done
    "$KILN" loadtest "http://127.0.0.1:$PORT" -m "$NAME" --protocol task --inputs squad --length long \
      --concurrency 16 --check --json "$OUT/squad-long-$v-round$r.json" > "$OUT/squad-long-$v-round$r.txt" 2>&1
    kill -TERM "$pid"; wait "$pid" || true
    echo "round $r $v: SQuAD done"
  done
done
