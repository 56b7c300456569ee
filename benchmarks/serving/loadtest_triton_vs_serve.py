"""The README comparison: ``kiln serve`` vs the Triton repository from ``kiln triton`` (python
backend, the CPU build of tritonserver bundled in nvidia-pytriton) on the same artifact, measured
with ``kiln loadtest`` (same inputs, same protocol: OIP JSON on /v2/models/{m}/infer), one plot.

    python benchmarks/serving/loadtest_triton_vs_serve.py ARTIFACT --out benchmarks/loadtest_results \\
        --concurrency 1:32:x2 --inputs sts --variant int8 --threads 1 --instances 2

Writes serve.json, triton.json (kiln loadtest --json format), comparison.png and prints both
tables. Settings are matched on purpose: same variant, same instances × intra-op threads, same
max batch size and queue delay, so the difference is the serving stack (Triton's C++ core and
python backend IPC vs kiln serve's single-process asyncio + batcher)."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from rich.console import Console

from modelkiln.loadtest.api import LoadtestOptions, run_loadtest
from modelkiln.loadtest.plot import plot
from modelkiln.loadtest.report import print_table, write_json
from modelkiln.loadtest.runner import Load, parse_levels
from modelkiln.manifest import Manifest
from modelkiln.triton import server as triton_server
from modelkiln.triton.config import Options
from modelkiln.triton.repository import model_name, write_repository
from modelkiln.tune.sweep import ServeProcess


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/loadtest_results"))
    ap.add_argument("--concurrency", default="1:32:x2")
    ap.add_argument("--inputs", default="sts")
    ap.add_argument("--variant", default=None)
    ap.add_argument("--instances", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-batch-size", type=int, default=32)
    ap.add_argument("--queue-delay-ms", type=float, default=0.5)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--window", type=float, default=3.0)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    manifest = Manifest.load(args.artifact)
    variant = args.variant or manifest.fastest_variant("cpu").name
    loads = tuple(Load("concurrency", float(int(c))) for c in parse_levels(args.concurrency, "--concurrency"))
    console = Console(width=160)
    base = LoadtestOptions(url="", model="", loads=loads, inputs=args.inputs, warmup_s=args.warmup,
                           window_s=args.window)
    results = []

    settings = {"variant": variant, "instances": args.instances, "threads": args.threads,
                "max_batch_size": args.max_batch_size, "max_queue_delay_ms": args.queue_delay_ms}
    with ServeProcess(args.artifact.resolve(), manifest.name, settings) as srv:
        opts = LoadtestOptions(**{**base.__dict__, "url": srv.url, "model": manifest.name,
                                  "label": f"kiln serve ({variant}, {args.instances}×{args.threads} threads)"})
        results.append(run_loadtest(opts))
    write_json(args.out / "serve.json", results[-1])

    with tempfile.TemporaryDirectory(prefix="kiln-triton-repo-") as tmp:
        repo = write_repository(args.artifact, Path(tmp) / "repo",
                                Options(model_backend="python", max_batch_size=args.max_batch_size,
                                        max_queue_delay_us=int(args.queue_delay_ms * 1000), instances=args.instances,
                                        threads=args.threads), variant=variant)
        srv_t = triton_server.start(repo, timeout=300, metrics=True)  # metrics: the server-side breakdown
        try:
            name = model_name(manifest)
            opts = LoadtestOptions(**{**base.__dict__, "url": f"http://{srv_t.url}", "model": name,
                                      "metrics_url": f"http://127.0.0.1:{srv_t.metrics_port}/metrics",
                                      "label": f"Triton python backend ({variant}, {args.instances}×{args.threads} threads)"})
            results.append(run_loadtest(opts))
        finally:
            srv_t.stop()
    write_json(args.out / "triton.json", results[-1])

    for r in results:
        print_table(console, r)
    plot(results, args.out / "comparison.png", "p95",
         title=f"{manifest.name}: kiln serve vs Triton (python backend), {args.inputs} inputs")
    print(f"wrote {args.out}/serve.json, triton.json, comparison.png", file=sys.stderr)


if __name__ == "__main__":
    main()
