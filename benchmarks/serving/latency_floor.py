"""What a lone request costs on this machine before any server code runs: the floor under
``kiln serve``'s concurrency-1 latency, measured rather than assumed.

    python benchmarks/serving/latency_floor.py --artifact artifacts/all-MiniLM-L6-v2 --rounds 5

A request at concurrency 1 crosses four wake-ups that the in-process baseline never pays:
client → server and back (two processes, any HTTP server has them) and event loop → engine
thread and back (the issue puts tokenizing and the model off the event loop). It also finds the
model idle: between two requests onnxruntime's worker threads stop spinning and sleep, and the
next run starts by waking them, where a tight benchmark loop finds them spinning. This script
times each piece on the machine it runs on:

- thread round trip: two Python threads handing a turn back and forth on a Condition;
- loop round trip: an asyncio (uvloop) loop queues work for a thread, which answers with
  ``call_soon_threadsafe`` (the server's path, with no work in between);
- process round trip: two processes over a pair of pipes (the client/server boundary);
- the artifact's full pipeline at batch 1 (STS-B sentences, every core), in a tight loop and
  with 1 ms idle between calls, rounds interleaved (timings on a small VM drift minute to minute).

Prints one JSON document and a Markdown table."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import threading
import time
from collections.abc import Callable


def thread_round_trip_us(n: int) -> float:
    cond = threading.Condition()
    turn = [0]

    def other() -> None:
        for _ in range(n):
            with cond:
                while turn[0] != 1:
                    cond.wait()
                turn[0] = 0
                cond.notify()

    t = threading.Thread(target=other)
    t.start()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        with cond:
            turn[0] = 1
            cond.notify()
            while turn[0] != 0:
                cond.wait()
        times.append(time.perf_counter() - start)
    t.join()
    return statistics.median(times) * 1e6


def loop_round_trip_us(n: int) -> float:
    async def run() -> float:
        loop = asyncio.get_running_loop()
        queue: list[asyncio.Future | None] = []
        cond = threading.Condition()

        def worker() -> None:
            while True:
                with cond:
                    while not queue:
                        cond.wait()
                    fut = queue.pop()
                if fut is None:
                    return
                loop.call_soon_threadsafe(fut.set_result, None)

        t = threading.Thread(target=worker)
        t.start()
        times = []
        for _ in range(n):
            start = time.perf_counter()
            fut = loop.create_future()
            with cond:
                queue.append(fut)
                cond.notify()
            await fut
            times.append(time.perf_counter() - start)
        with cond:
            queue.append(None)
            cond.notify()
        t.join()
        return statistics.median(times) * 1e6

    try:
        import uvloop

        return uvloop.run(run())
    except ImportError:
        return asyncio.run(run())


def process_round_trip_us(n: int) -> float:
    to_child, from_parent = os.pipe()
    from_child, to_parent = os.pipe()
    pid = os.fork()
    if pid == 0:
        for _ in range(n):
            os.read(to_child, 1)
            os.write(to_parent, b"x")
        os._exit(0)
    times = []
    for _ in range(n):
        start = time.perf_counter()
        os.write(from_parent, b"x")
        os.read(from_child, 1)
        times.append(time.perf_counter() - start)
    os.waitpid(pid, 0)
    return statistics.median(times) * 1e6


def pipeline_ms(artifact: str, calls: int, rounds: int) -> dict[str, list[float]]:
    """Median ms per call, per round, in a tight loop and with 1 ms of idle before each call."""
    from modelkiln.data import sts_sentences
    from modelkiln.runtime.pipeline import load_pipeline

    sentences = sts_sentences()
    random.Random(0).shuffle(sentences)
    pipe = load_pipeline(artifact, threads=os.cpu_count())
    for s in sentences[:50]:
        pipe([s])

    def timed(pause: Callable[[], None], offset: int) -> float:
        times = []
        for k in range(calls):
            pause()
            text = sentences[(offset + k) % len(sentences)]
            start = time.perf_counter()
            pipe([text])
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1000

    out: dict[str, list[float]] = {"tight": [], "idle_1ms": []}
    for r in range(rounds):
        out["tight"].append(timed(lambda: None, r * calls))
        out["idle_1ms"].append(timed(lambda: time.sleep(0.001), r * calls))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=400, help="pipeline calls per round and mode")
    ap.add_argument("--trips", type=int, default=3000, help="round trips per wake-up measurement")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    wake = {"thread_round_trip_us": [], "loop_round_trip_us": [], "process_round_trip_us": []}
    for _ in range(args.rounds):
        wake["thread_round_trip_us"].append(thread_round_trip_us(args.trips))
        wake["loop_round_trip_us"].append(loop_round_trip_us(args.trips))
        wake["process_round_trip_us"].append(process_round_trip_us(args.trips))
    model = pipeline_ms(args.artifact, args.calls, args.rounds)
    median = {k: statistics.median(v) for k, v in {**wake, **model}.items()}
    report = {"cpus": os.cpu_count(), "rounds": args.rounds, "per_round": {**wake, **model}, "median": median}
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            f.write(json.dumps(report, indent=2) + "\n")
    hops = median["loop_round_trip_us"] + median["process_round_trip_us"]
    idle = (median["idle_1ms"] - median["tight"]) * 1000
    print(f"\nmedians of {args.rounds} rounds, {os.cpu_count()} CPUs\n")
    print("| what | median |\n|---|---:|")
    print(f"| thread round trip (Condition) | {median['thread_round_trip_us']:.0f} µs |")
    print(f"| event loop → thread → event loop | {median['loop_round_trip_us']:.0f} µs |")
    print(f"| process round trip (pipes) | {median['process_round_trip_us']:.0f} µs |")
    print(f"| pipeline, batch 1, tight loop | {median['tight']:.2f} ms |")
    print(f"| pipeline, batch 1, 1 ms idle before each call | {median['idle_1ms']:.2f} ms |")
    print(f"\nwake-ups of a lone request (loop + process round trip): {hops:.0f} µs; "
          f"model after idle: {idle:+.0f} µs; together {hops + idle:.0f} µs of the 500 µs allowance")


if __name__ == "__main__":
    main()
