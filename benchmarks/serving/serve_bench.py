"""Load-test ``kiln serve`` with wrk, driving STS-B sentences (packaged with modelkiln), and compare with the
in-process batch-1 latency of the same artifact.

    python benchmarks/serving/serve_bench.py --artifact artifacts/all-MiniLM-L6-v2 --duration 20 --rounds 3

Each round measures the in-process baseline (the whole pipeline, tokenizer to pooled answer, at
batch 1 with every core: what ``kiln bench`` times), then starts a fresh server and runs wrk at
each concurrency. Timings on a small VM drift between minutes and between process starts, so
the rounds are interleaved and the report gives every round and the median of them.
Then, with the same server, ``--pairs`` short windows alternate the in-process baseline and wrk
at concurrency 1: the median of those paired differences is the server's own cost for a lone
request with the drift taken out (the long runs' medians can differ by a millisecond between
two runs of this script).
Prints one JSON document and a Markdown table for the README. Needs ``wrk`` (apt-get install wrk).
Acceptance targets (2 CPU cores): concurrency 1 p50 <= in-process batch-1 latency + 0.5 ms;
concurrency 16 >= 800 requests/s with zero errors."""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from modelkiln.data import sts_sentences
from modelkiln.tune.sweep import ServeProcess
from wrk_load import median_runs, print_table, run_wrk, write_script

class InProcess:
    """The full pipeline (tokenize + model + postprocess) at batch 1, in this process."""

    def __init__(self, artifact: str, sentences: list[str], threads: int | None):
        from modelkiln.runtime.pipeline import load_pipeline

        self.pipe = load_pipeline(artifact, threads=threads)
        self.sentences = sentences
        self.next = 0
        for s in sentences[:20]:
            self.pipe([s])

    def median_ms(self, seconds: float) -> float:
        """Median ms per call over ``seconds``, going on through the sentences where it stopped."""
        times, end = [], time.perf_counter() + seconds
        while time.perf_counter() < end:
            text = self.sentences[self.next % len(self.sentences)]
            self.next += 1
            t = time.perf_counter()
            self.pipe([text])
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1000


def in_process_latency(artifact: str, sentences: list[str], threads: int | None, seconds: float) -> float:
    """Median ms of a freshly loaded pipeline at batch 1 over ``seconds``."""
    return InProcess(artifact, sentences, threads).median_ms(seconds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", required=True, help="artifact folder (e.g. a converted all-MiniLM-L6-v2)")
    ap.add_argument("--route", default="predict", choices=["predict", "infer", "embeddings"])
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--duration", type=int, default=20, help="seconds per wrk run")
    ap.add_argument("--warmup", type=int, default=3, help="seconds of load before measuring")
    ap.add_argument("--threads", type=int, default=None, help="server onnxruntime threads per instance (kiln serve --threads)")
    ap.add_argument("--baseline-threads", type=int, default=None,
                    help="in-process baseline threads (default: every core, as kiln bench)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved baseline + fresh-server rounds")
    ap.add_argument("--pairs", type=int, default=10,
                    help="alternating baseline / concurrency-1 windows per round (0: none)")
    ap.add_argument("--pair-seconds", type=int, default=2, help="seconds per window of a pair")
    ap.add_argument("--server-args", default="", help="extra `kiln serve` flags, e.g. '--max-batch-size 64'")
    ap.add_argument("--json", type=Path, help="also write results here")
    args = ap.parse_args()
    if not shutil.which("wrk"):
        raise SystemExit("wrk not found: apt-get install -y wrk")

    # Shuffled (seeded): the file is ordered by genre with very different lengths, and the
    # in-process baseline only gets through part of it in its few seconds.
    sentences = sts_sentences()
    random.Random(0).shuffle(sentences)
    name = "bench"
    if args.route == "predict":
        path, bodies = f"/v2/models/{name}/predict", [json.dumps({"inputs": s}) for s in sentences]
    elif args.route == "embeddings":
        path, bodies = "/v1/embeddings", [json.dumps({"model": name, "input": s}) for s in sentences]
    else:
        path = f"/v2/models/{name}/infer"
        bodies = [json.dumps({"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1], "data": [s]}]})
                  for s in sentences]
    script = write_script(Path(tempfile.mkdtemp()), path, bodies)

    rounds = []
    threads = args.baseline_threads or os.cpu_count()
    for r in range(args.rounds):
        baseline = in_process_latency(args.artifact, sentences, threads, seconds=5)
        runs, pairs, rss_mb, code = serve_round(args, name, script, sentences, threads)
        rounds.append({"in_process_batch1_ms": baseline, "server_rss_mb": rss_mb, "server_exit": code, "runs": runs,
                       "pairs": pairs})
        print(f"round {r + 1}: in-process batch-1 {baseline:.2f} ms; " + "; ".join(
            f"c={x['concurrency']} {x['rps']:.0f} req/s p50 {x['p50_ms']:.2f} ms" for x in runs), flush=True)
        if pairs:
            print("  paired c=1 - in-process: " + ", ".join(f"{p['delta_ms']:+.2f}" for p in pairs), flush=True)
    median = summarize(rounds)
    report = {"artifact": args.artifact, "route": args.route, "sentences": len(sentences), "cpus": os.cpu_count(),
              "baseline_threads": args.baseline_threads, "server_args": args.server_args, "rounds": rounds,
              "median": median}
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nmedians of {len(rounds)} rounds: in-process batch-1 latency {median['in_process_batch1_ms']:.2f} ms; "
          f"server RSS {median['server_rss_mb']:.0f} MB")
    if "paired" in median:
        p = median["paired"]
        print(f"paired windows ({p['count']} of {args.pair_seconds} s each side): c=1 p50 {p['server_p50_ms']:.2f} ms "
              f"vs in-process {p['in_process_ms']:.2f} ms; median difference {p['delta_ms']:+.2f} ms "
              f"(quartiles {p['delta_q1_ms']:+.2f} / {p['delta_q3_ms']:+.2f})")
    print()
    print_table(median["runs"])


def serve_round(args: argparse.Namespace, name: str, script: Path, sentences: list[str], threads: int
                ) -> tuple[list[dict], list[dict], float, int]:
    """Start a fresh server, warm it, run wrk at each concurrency, then the paired windows;
    returns (runs, pairs, RSS MB, exit code)."""
    srv = ServeProcess(Path(args.artifact), name, {"threads": args.threads}, extra_args=args.server_args.split())
    try:
        if args.warmup:
            run_wrk(srv.url, script, 16, args.warmup, 1)
        runs = [run_wrk(srv.url, script, c, args.duration, threads=1 if c == 1 else 2)
                for c in (int(x) for x in args.concurrency.split(","))]
        rss_mb = srv.memory_mb("VmRSS") or 0.0
        pairs = []
        if args.pairs:
            local = InProcess(args.artifact, sentences, threads)
            for _ in range(args.pairs):
                base = local.median_ms(args.pair_seconds)
                served = run_wrk(srv.url, script, 1, args.pair_seconds, threads=1)["p50_ms"]
                pairs.append({"in_process_ms": base, "server_p50_ms": served, "delta_ms": served - base})
    finally:
        code = srv.stop(60)
    return runs, pairs, rss_mb, code


def summarize(rounds: list[dict]) -> dict:
    """Per concurrency, the median of each figure over the rounds (errors: the sum)."""
    runs = median_runs([r["runs"] for r in rounds])
    out = {"in_process_batch1_ms": statistics.median(r["in_process_batch1_ms"] for r in rounds),
           "server_rss_mb": statistics.median(r["server_rss_mb"] for r in rounds), "runs": runs}
    pairs = [p for r in rounds for p in r.get("pairs", [])]
    if pairs:
        deltas = [p["delta_ms"] for p in pairs]
        q1, _, q3 = statistics.quantiles(deltas, n=4) if len(deltas) > 1 else (deltas[0],) * 3
        out["paired"] = {"count": len(pairs), "delta_ms": statistics.median(deltas), "delta_q1_ms": q1,
                         "delta_q3_ms": q3, "in_process_ms": statistics.median(p["in_process_ms"] for p in pairs),
                         "server_p50_ms": statistics.median(p["server_p50_ms"] for p in pairs)}
    return out


if __name__ == "__main__":
    main()
