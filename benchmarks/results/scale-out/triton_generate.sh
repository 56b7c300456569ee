set -e
cd "$(dirname "$0")/../../.."; export PYTHONPATH=$PWD/src; PY=${PYTHON:-python}
echo '$ kiln triton /work/main/artifacts/smollm2 /tmp/scaleout/smol-repo --threads 2'
$PY -m modelkiln triton /work/main/artifacts/smollm2 /tmp/scaleout/smol-repo --threads 2 --force
echo '$ cat /tmp/scaleout/smol-repo/smollm2/config.pbtxt'
cat /tmp/scaleout/smol-repo/smollm2/config.pbtxt
echo '$ kiln generate /work/main/artifacts/smollm2 "The capital of France is" -n 16 --temperature 0 --json'
$PY -m modelkiln generate /work/main/artifacts/smollm2 "The capital of France is" -n 16 --temperature 0 --json
$PY - <<'PY'
import json, time, httpx
from modelkiln.triton import server
srv = server.start("/tmp/scaleout/smol-repo", timeout=600)
try:
    url = f"http://{srv.url}/v2/models/smollm2"
    body = {"text_input": "The capital of France is", "max_tokens": 16, "temperature": 0.0}
    print(f"$ curl -s {url}/generate -d '{json.dumps(body)}'")
    t = time.perf_counter(); r = httpx.post(url + "/generate", json=body, timeout=300)
    print(r.status_code, r.text, f"  ({time.perf_counter() - t:.2f}s)")
    body["stream"] = True
    print(f"$ curl -sN {url}/generate_stream -d '{json.dumps(body)}'")
    with httpx.stream("POST", url + "/generate_stream", json=body, timeout=300) as s:
        for line in s.iter_lines():
            if line:
                print(line)
finally:
    srv.stop()
PY
