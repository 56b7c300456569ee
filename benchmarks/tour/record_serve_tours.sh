#!/usr/bin/env bash
# Re-record the README's `kiln loadtest` and `kiln tune` tours against the current code:
# a fresh `kiln serve` of the converted all-MiniLM-L6-v2 on port 8000, real text packaged with modelkiln.
#   bash benchmarks/tour/record_serve_tours.sh [artifacts/all-MiniLM-L6-v2]
set -euo pipefail
art=${1:-artifacts/all-MiniLM-L6-v2}
out=benchmarks/results/tour
mkdir -p "$out"
kiln serve "$art" --port 8000 > "$out/serve-log.txt" 2>&1 &
server=$!
trap 'kill -TERM $server 2>/dev/null || true' EXIT
for _ in $(seq 1 240); do curl -sf localhost:8000/v2/health/ready > /dev/null && break; sleep 0.5; done

run() {  # print the command as the README shows it, then its output
  echo "\$ $1"
  shift
  "$@" 2>&1
}
{
  run "kiln loadtest http://127.0.0.1:8000 --model all-MiniLM-L6-v2 --concurrency 1:16:x4 --inputs sts --length short --protocol oip-binary --csv $out/loadtest-sts.csv --json $out/loadtest-sts.json --plot $out/loadtest-sts.png" \
    kiln loadtest http://127.0.0.1:8000 --model all-MiniLM-L6-v2 --concurrency 1:16:x4 --inputs sts --length short \
      --protocol oip-binary --csv "$out/loadtest-sts.csv" --json "$out/loadtest-sts.json" --plot "$out/loadtest-sts.png"
  echo
  run "kiln loadtest http://127.0.0.1:8000 --model all-MiniLM-L6-v2 --rate 20:60:+20 --inputs squad --length long --protocol task" \
    kiln loadtest http://127.0.0.1:8000 --model all-MiniLM-L6-v2 --rate 20:60:+20 --inputs squad --length long --protocol task
} | tee "$out/loadtest.txt"
kill -TERM $server; wait $server || true
trap - EXIT

run "kiln tune $art --p99-ms 60 --variants int8,openvino-int8 --instances 1,2 --max-queue-delay-ms 0 --alone-threads auto,0 --concurrency 1:16:x4 --inputs sts -o $out/kiln-serve.json" \
  kiln tune "$art" --p99-ms 60 --variants int8,openvino-int8 --instances 1,2 --max-queue-delay-ms 0 --alone-threads auto,0 --concurrency 1:16:x4 \
    --inputs sts -o "$out/kiln-serve.json" | tee "$out/tune.txt"
