"""Seconds from starting `kiln serve MODEL` to /v2/health/ready answering 200, for each MODEL in turn, ROUNDS times
(the models interleaved, so that load from elsewhere hits each alike); each server is stopped before the next starts.

    KILN_CACHE=/tmp/kiln-cache python benchmarks/serving/ready_time.py "$(python -m modelkiln.embedded SmolLM2-135M-Instruct)" \\
        /tmp/kiln-cache/models/SmolLM2-135M-Instruct.Q4_1-<key> --rounds 3

With a model file whose conversion is in the cache (run `kiln convert MODEL` or any command on it once first),
this is the second start of docs/model-cache.md; the artifact folder itself is the baseline.
"""

from __future__ import annotations

import argparse
import platform
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
from modelkiln.machine import cpu_description  # noqa: E402
from modelkiln.net import free_port  # noqa: E402


def ready_seconds(model: str, log: Path) -> float:
    port = free_port()
    started = time.perf_counter()
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "modelkiln", "serve", model, "--port", str(port),
                                 "--grpc-port", "0"], stdout=subprocess.DEVNULL, stderr=err)
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"kiln serve {model} exited with {proc.returncode}: {log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=1) as reply:
                    if reply.status == 200:
                        return time.perf_counter() - started
            except OSError:
                pass
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"{cpu_description()}; {platform.node()}; {time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(1, args.rounds + 1):
            for i, model in enumerate(args.models):
                seconds = ready_seconds(model, Path(tmp) / f"serve-{i}.log")
                first = (Path(tmp) / f"serve-{i}.log").read_text().splitlines()[:1]
                print(f"round {round_}: {model}: ready in {seconds:.2f} s ({first[0] if first else ''})", flush=True)


if __name__ == "__main__":
    main()
