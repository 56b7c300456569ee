"""Where gRPC's requests/s go on a 2-core machine: server CPU per request of each transport, with one
C load generator (h2load, nghttp2) for both, so the client's cost is the same small one on each side.

    python benchmarks/serving/grpc_transport_cost.py --artifact artifacts/all-MiniLM-L6-v2 --rounds 3

Two parts, each in interleaved rounds (the order flips every round):

1. The transport floor: a handler that does nothing, served by uvicorn (httptools, uvloop: what
   kiln serve's HTTP runs on) and by grpc.aio (what its gRPC runs on), 16 connections.
2. kiln serve itself, one process with both transports: ``POST /v2/models/m/infer`` with the binary
   tensor extension (h2load --h1, keep-alive) against gRPC ModelInfer (h2load over HTTP/2, one stream
   per connection), at 1 and 16 connections, one STS-B sentence per request (h2load sends one body).

h2load counts HTTP/2 200s; a gRPC error is also a 200 (its status travels in the trailers), so the
gRPC rows are checked against kiln's own counter (``kiln_requests_total{protocol="grpc",status="OK"}``).
Needs ``h2load`` on PATH (Debian/Ubuntu: apt-get install nghttp2-client)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import shutil
import statistics
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from modelkiln.loadtest.inputs import load_items
from modelkiln.loadtest.protocols import InputLayout, OipBinary
from modelkiln.net import free_port
from modelkiln.tune.sweep import ServeProcess

TICK = os.sysconf("SC_CLK_TCK")
GRPC_PATH = "/inference.GRPCInferenceService/ModelInfer"
SETTINGS = {"instances": 2, "threads": 1, "max_batch_size": 32, "max_queue_delay_ms": 0.0}


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds (utime + stime) of each thread of a process by role: the main (event loop)
    thread, and every other thread by its name (engine threads, grpc's poller and EventEngine)."""
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            name = "main" if tid == str(pid) else stat[stat.index("(") + 1:stat.rindex(")")]
            fields = stat.rsplit(")", 1)[1].split()
            out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / TICK
    return out


def wait_for_port(port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"nothing listens on port {port}")
        time.sleep(0.2)


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def h2load(url: str, body: Path, headers: list[str], connections: int, seconds: int, http1: bool) -> dict:
    cmd = ["h2load", "-c", str(connections), "-D", str(seconds), "--warm-up-time", "1", "-d", str(body)]
    cmd += ["--h1"] if http1 else ["-m", "1"]
    for h in headers:
        cmd += ["-H", h]
    cpu0 = children_cpu_s()
    out = subprocess.run(cmd + [url], capture_output=True, text=True, check=True).stdout
    cpu = children_cpu_s() - cpu0
    done = int(re.search(r"requests: \d+ total, \d+ started, (\d+) done", out).group(1))
    ok = min(done, int(re.search(r"status codes: (\d+) 2xx", out).group(1)))  # its 2xx count can include warm-up
    mean_ms = re.search(r"time for request:\s+\S+\s+\S+\s+(\S+)", out).group(1)
    mean_ms = float(mean_ms[:-2]) if mean_ms.endswith("ms") else float(mean_ms[:-2]) / 1e3  # "ms" or "us"
    return {"requests": done, "ok": ok, "requests_per_s": float(re.search(r"([\d.]+) req/s", out).group(1)),
            "mean_ms": mean_ms, "h2load_cpu_ms": cpu / max(done, 1) * 1e3}


def grpc_ok_count(metrics_url: str) -> float:
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kiln_requests_total{") and 'protocol="grpc"' in line and 'status="OK"' in line
               and 'route="infer"' in line)


def measure(pid: int, run) -> dict:
    before = thread_cpu_s(pid)
    result = run()
    after = thread_cpu_s(pid)
    n = max(result["requests"], 1)  # warm-up requests are not counted by h2load: a slight overestimate, both sides
    per_thread = {k: (after[k] - before.get(k, 0.0)) / n * 1e3 for k in after if after[k] > before.get(k, 0.0)}
    return {**result, "server_cpu_ms": sum(per_thread.values()), "server_cpu_ms_by_thread": per_thread}


# -- part 1: do-nothing servers -----------------------------------------------------------------------------
def floor_server(kind: str, port: int) -> None:
    if kind == "http":
        import uvicorn

        async def app(scope, receive, send):
            if scope["type"] != "http":
                return
            while (await receive()).get("more_body"):
                pass
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"x" * 1536})

        uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", loop="uvloop", http="httptools")
    else:
        import asyncio

        import grpc

        async def handler(request: bytes, context) -> bytes:
            return b"x" * 1536

        async def main() -> None:
            server = grpc.aio.server()
            server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
                "inference.GRPCInferenceService", {"ModelInfer": grpc.unary_unary_rpc_method_handler(handler)}),))
            server.add_insecure_port(f"127.0.0.1:{port}")
            await server.start()
            await server.wait_for_termination()

        import uvloop

        uvloop.install()
        asyncio.run(main())


def report(rows: list[dict], rounds: int) -> str:
    """Medians per (part, connections, protocol), then the per-round gRPC/HTTP ratios."""
    lines = ["| part | connections | protocol | requests/s (median) | mean latency ms (median) | server CPU ms/request "
             "(median) | server main thread | h2load CPU ms/request | rounds (req/s) | failed |", "|---|---|---|---|---|---|---|---|---|---|"]
    for part, levels in (("floor", (16,)), ("kiln", (1, 16))):
        for c in levels:
            for kind in ("http", "grpc"):
                mine = [x for x in rows if x["part"] == part and x["connections"] == c and x["protocol"] == kind]
                med = {k: statistics.median(x[k] for x in mine)
                       for k in ("requests_per_s", "mean_ms", "server_cpu_ms", "h2load_cpu_ms")}
                main_thread = statistics.median(x["server_cpu_ms_by_thread"].get("main", 0.0) for x in mine)
                lines.append(f"| {part} | {c} | {kind} | {med['requests_per_s']:.1f} | {med['mean_ms']:.2f} | "
                             f"{med['server_cpu_ms']:.3f} | {main_thread:.3f} | {med['h2load_cpu_ms']:.3f} | "
                             + ", ".join(f"{x['requests_per_s']:.0f}" for x in mine)
                             + f" | {sum(x['requests'] - x['ok'] for x in mine)} |")
    lines += ["", "| part | connections | gRPC / HTTP requests/s per round | median | server CPU per request per round "
              "| median |", "|---|---|---|---|---|---|"]
    for part, levels in (("floor", (16,)), ("kiln", (1, 16))):
        for c in levels:
            pick = {(x["round"], x["protocol"]): x for x in rows if x["part"] == part and x["connections"] == c}
            tput = [pick[(r + 1, "grpc")]["requests_per_s"] / pick[(r + 1, "http")]["requests_per_s"]
                    for r in range(rounds)]
            cpu = [pick[(r + 1, "grpc")]["server_cpu_ms"] / pick[(r + 1, "http")]["server_cpu_ms"]
                   for r in range(rounds)]
            lines.append(f"| {part} | {c} | " + ", ".join(f"{v:.2f}" for v in tput) + f" | {statistics.median(tput):.2f} | "
                         + ", ".join(f"{v:.2f}" for v in cpu) + f" | {statistics.median(cpu):.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=int, default=6)
    ap.add_argument("--out", type=Path, default=Path(__file__).parents[1] / "results" / "grpc-transport-cost")
    ap.add_argument("--report", type=Path, help="only print the tables of a saved .json run")
    ap.add_argument("--floor-server", nargs=2, help=argparse.SUPPRESS)  # internal: KIND PORT
    args = ap.parse_args()
    if args.floor_server:
        floor_server(args.floor_server[0], int(args.floor_server[1]))
        return
    if args.report:
        saved = json.loads(args.report.read_text())
        for row in saved["rows"]:  # runs saved before h2load's 2xx count was clamped to the requests done
            row["ok"] = min(row["ok"], row["requests"])
        print(report(saved["rows"], max(row["round"] for row in saved["rows"])))
        return
    if shutil.which("h2load") is None:
        sys.exit("h2load not found: apt-get install nghttp2-client")
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"grpc-transport-cost-{os.getpid()}"
    tmp.mkdir(exist_ok=True)

    from tritonclient.grpc import service_pb2  # the loadtest extra: a protocol implementation not the server's

    text = next(t if isinstance(t, str) else t[0] for t in load_items("sts"))
    rest = OipBinary("minilm", InputLayout()).build([text])
    (tmp / "http.bin").write_bytes(rest.body)
    message = service_pb2.ModelInferRequest(model_name="minilm")
    message.inputs.add(name="TEXT", datatype="BYTES", shape=[1])
    message.raw_input_contents.append(len(text.encode()).to_bytes(4, "little") + text.encode())
    serialized = message.SerializeToString()
    (tmp / "grpc.bin").write_bytes(b"\0" + len(serialized).to_bytes(4, "big") + serialized)  # gRPC framing
    http_headers = [f"{k}: {v}" for k, v in rest.headers]
    grpc_headers = ["content-type: application/grpc", "te: trailers"]
    rows: list[dict] = []

    def record(part: str, r: int, c: int, protocol: str, m: dict) -> None:
        rows.append({"part": part, "round": r + 1, "connections": c, "protocol": protocol, **m})
        threads = ", ".join(f"{k} {v:.3f}" for k, v in sorted(m["server_cpu_ms_by_thread"].items(), key=lambda kv: -kv[1]))
        print(f"{part} round {r + 1} c={c:<3} {protocol:<5} {m['requests_per_s']:8.1f} req/s  mean {m['mean_ms']:7.2f} ms  "
              f"server CPU {m['server_cpu_ms']:.3f} ms/request ({threads})  h2load CPU {m['h2load_cpu_ms']:.3f} ms/request"
              f"  ok {m['ok']}/{m['requests']}", flush=True)

    # part 1
    ports = {"http": free_port(), "grpc": free_port()}
    floors = {k: subprocess.Popen([sys.executable, __file__, "--artifact", str(args.artifact), "--floor-server", k,
                                   str(p)]) for k, p in ports.items()}
    try:
        for port in ports.values():
            wait_for_port(port)
        for r in range(args.rounds):
            for kind in ("http", "grpc") if r % 2 == 0 else ("grpc", "http"):
                url = (f"http://127.0.0.1:{ports[kind]}" + ("/v2/models/minilm/infer" if kind == "http" else GRPC_PATH))
                body, headers = (tmp / f"{kind}.bin", http_headers if kind == "http" else grpc_headers)
                record("floor", r, 16, kind, measure(floors[kind].pid, lambda: h2load(
                    url, body, headers, 16, args.seconds, http1=kind == "http")))
    finally:
        for p in floors.values():
            p.kill()
            p.wait()

    # part 2
    with ServeProcess(args.artifact.resolve(), "minilm", SETTINGS, grpc=True) as kiln:
        pid = kiln.proc.pid
        for r in range(args.rounds):
            for c in (1, 16):
                for kind in ("http", "grpc") if r % 2 == 0 else ("grpc", "http"):
                    if kind == "http":
                        m = measure(pid, lambda: h2load(f"{kiln.url}/v2/models/minilm/infer", tmp / "http.bin",
                                                        http_headers, c, args.seconds, http1=True))
                    else:
                        ok0 = grpc_ok_count(f"{kiln.url}/metrics")
                        m = measure(pid, lambda: h2load(f"http://{kiln.grpc_url}{GRPC_PATH}", tmp / "grpc.bin",
                                                        grpc_headers, c, args.seconds, http1=False))
                        # warm-up requests are answered too: OK answers ≥ requests done means none failed
                        m["ok"] = min(m["requests"], int(grpc_ok_count(f"{kiln.url}/metrics") - ok0))
                    record("kiln", r, c, kind, m)
    load = Path("/proc/loadavg").read_text().split()[:3]

    table = report(rows, args.rounds)
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"rows": rows, "settings": SETTINGS, "text": text,
                                                         "loadavg_before": load_before, "loadavg_after": load}, indent=1))
    args.out.with_suffix(".txt").write_text(
        f"python benchmarks/serving/grpc_transport_cost.py --artifact {args.artifact} --rounds {args.rounds} --seconds {args.seconds}\n"
        f"h2load (nghttp2) for both transports; kiln serve {SETTINGS}; load average before: {' '.join(load_before)}, "
        f"after: {' '.join(load)}\n\n{table}\n")


if __name__ == "__main__":
    main()
