"""Load-test the Triton ensemble that ``kiln triton --model-backend python`` writes, on the
tritonserver bundled in nvidia-pytriton (python backend, CPU), with the same load generator (wrk),
sentences (STS-B dev, packaged with modelkiln) and concurrency levels as ``benchmarks/serve_bench.py``
uses for ``kiln serve``, so the two tables sit side by side in the README.

    python benchmarks/triton_bench.py --artifact /tmp/triton-art/all-MiniLM-L6-v2 --duration 20

Requests are KServe v2 JSON (POST /v2/models/<name>/infer, one sentence each, the EMBEDDING
output as JSON), like kiln serve's JSON answers. Prints one JSON document and a Markdown table.
Needs ``wrk`` (apt-get install wrk)."""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

from modelkiln.data import sts_sentences
from modelkiln.manifest import Manifest
from modelkiln.runtime.pipeline import load_pipeline
from modelkiln.tasks import tensors as names
from modelkiln.triton import server
from modelkiln.triton.config import Options
from modelkiln.triton.repository import model_name, write_repository
from wrk_load import print_table, run_wrk, write_script

def request_body(sentence: str, output: str) -> str:
    return json.dumps({"inputs": [{"name": names.TEXT, "shape": [1, 1], "datatype": "BYTES", "data": [sentence]}],
                       "outputs": [{"name": output}]})


def check_answer(url: str, name: str, artifact: str, sentence: str) -> float:
    """One request by hand: the ensemble's embedding vs the pipeline's (max abs difference)."""
    req = urllib.request.Request(f"http://{url}/v2/models/{name}/infer", data=request_body(sentence, names.EMBEDDINGS).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        got = np.array(json.loads(r.read())["outputs"][0]["data"], dtype=np.float32)
    want = load_pipeline(artifact, threads=1)([sentence])[0]
    return float(np.abs(got - want).max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", required=True, help="a sentence-embeddings artifact (e.g. all-MiniLM-L6-v2)")
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--duration", type=int, default=20, help="seconds per wrk run")
    ap.add_argument("--warmup", type=int, default=3, help="seconds of load before measuring")
    ap.add_argument("--max-batch-size", type=int, default=32)
    ap.add_argument("--max-queue-delay-us", type=int, default=500)
    ap.add_argument("--instances", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="onnxruntime intra-op threads per model instance (0: default)")
    ap.add_argument("--variant", default=None)
    ap.add_argument("--json", type=Path, help="also write results here")
    args = ap.parse_args()

    manifest = Manifest.load(args.artifact)
    if manifest.task != "sentence-embeddings":
        raise SystemExit("this benchmark drives STS-B sentences: give it a sentence-embeddings artifact")
    sentences = sts_sentences()
    opts = Options(model_backend="python", max_batch_size=args.max_batch_size, max_queue_delay_us=args.max_queue_delay_us,
                   instances=args.instances, threads=args.threads)
    with tempfile.TemporaryDirectory(prefix="kiln-triton-bench-") as tmp:
        repo = write_repository(args.artifact, Path(tmp) / "repo", opts, variant=args.variant)
        name = model_name(manifest)
        started = time.perf_counter()
        with server.start(repo) as srv:
            startup = time.perf_counter() - started
            diff = check_answer(srv.url, name, args.artifact, sentences[0])
            script = write_script(Path(tmp), f"/v2/models/{name}/infer",
                                  [request_body(s, names.EMBEDDINGS) for s in sentences])
            base = f"http://{srv.url}"
            results = []
            for c in (int(x) for x in args.concurrency.split(",")):
                if args.warmup:
                    run_wrk(base, script, c, args.warmup, threads=1)
                results.append(run_wrk(base, script, c, args.duration, threads=1))
            stats = json.loads(urllib.request.urlopen(f"{base}/v2/models/{name}_model/stats").read())
            model_stats = stats["model_stats"][0]
    report = {
        "server": "tritonserver 2.51 (nvidia-pytriton), python backend + onnxruntime",
        "artifact": str(args.artifact), "variant": args.variant or manifest.fastest_variant("cpu").name,
        "options": vars(opts), "startup_s": round(startup, 2), "max_abs_diff_vs_pipeline": diff,
        "sentences": len(sentences), "model_executions": int(model_stats["execution_count"]),
        "model_inferences": int(model_stats["inference_count"]), "results": results,
    }
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    print()
    print_table(results, server="Triton (python backend)")


if __name__ == "__main__":
    main()
