"""What a `kiln serve` of each artifact holds in memory once it has answered real text: fresh servers in
interleaved rounds, each sent the first N STS-B sentences (one a request, ``/predict``), then its
processes' memory read from /proc: VmRSS, RssAnon (its own memory), RssFile (mapped files, e.g. an ONNX
variant's external weights) and Pss (each page divided among what maps it: a file page that three
sessions map counts once; VmRSS counts it three times).

    python benchmarks/serving/server_memory.py ARTIFACT [ARTIFACT ...] [--variant int8] [--rounds 3] \\
        [--requests 1500] [--server-args "--workers 2"] [--out benchmarks/results/serve-memory]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import httpx

from modelkiln.data import sts_sentences
from modelkiln.machine import cpu_description
from modelkiln.tune.sweep import ServeProcess, process_tree, server_memory_mb

FIELDS = ("VmRSS", "RssAnon", "RssFile", "Pss")


def pss_mb(pid: int) -> float:
    """A process's Pss from /proc/PID/smaps_rollup, in MiB (0 where it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def memory_mb(pid: int) -> dict[str, float]:
    """The fields above, summed over the server's processes (``kiln serve --workers N``), in MiB."""
    status = {field: server_memory_mb(pid, field) or 0.0 for field in FIELDS if field != "Pss"}
    return {**status, "Pss": sum(pss_mb(p) for p in process_tree(pid))}


def one_round(artifact: Path, variant: str | None, requests: int, server_args: list[str]) -> dict[str, float]:
    extra = [*(["--variant", variant] if variant else []), *server_args]
    server = ServeProcess(artifact, "m", {}, extra_args=extra)
    try:
        with httpx.Client(timeout=60) as client:
            for text in list(sts_sentences())[:requests]:
                client.post(f"{server.url}/v2/models/m/predict", json={"inputs": text}).raise_for_status()
        return memory_mb(server.proc.pid)
    finally:
        server.stop(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifacts", nargs="+", type=Path)
    parser.add_argument("--variant")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--server-args", default="")
    parser.add_argument("--out", type=Path, help="write OUT.txt and OUT.json")
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {str(a): [] for a in args.artifacts}
    for r in range(args.rounds):
        order = args.artifacts if r % 2 == 0 else list(reversed(args.artifacts))
        for artifact in order:
            results[str(artifact)].append(one_round(artifact, args.variant, args.requests, args.server_args.split()))
            print(f"round {r + 1} {artifact}: " + ", ".join(f"{k} {v:.0f}" for k, v in results[str(artifact)][-1].items()),
                  flush=True)
    cpu = cpu_description()
    lines = [f"kiln serve memory after {args.requests} STS-B requests, MiB ({cpu['cpu']}, {cpu['isa']}, "
             f"{cpu['cores']} cores; variant {args.variant or 'default'}; server args '{args.server_args}'; "
             f"{args.rounds} rounds, median (per round)", ""]
    for artifact, rounds in results.items():
        cells = [f"{k} {statistics.median(r[k] for r in rounds):.0f} ({', '.join(f'{r[k]:.0f}' for r in rounds)})"
                 for k in FIELDS]
        lines.append(f"{artifact}: " + "; ".join(cells))
    print("\n".join(lines))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".txt").write_text("\n".join(lines) + "\n")
        args.out.with_suffix(".json").write_text(json.dumps({"cpu": cpu, "variant": args.variant, "requests": args.requests,
                                                             "server_args": args.server_args, "rounds": results}, indent=1))


if __name__ == "__main__":
    main()
