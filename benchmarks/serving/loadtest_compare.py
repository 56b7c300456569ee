"""Is ``kiln loadtest`` a fast enough client? Run it, ``wrk`` and ``hey`` against the same server with
the same request bodies, interleaved, and print throughput and latency side by side.

    kiln serve ARTIFACT --port 8000 &
    python benchmarks/serving/loadtest_compare.py http://127.0.0.1:8000 --model NAME --concurrency 1,4,16 \\
        --inputs sts --seconds 10 --rounds 3

- kiln vs wrk: every request body (wrk cycles them with a Lua script, as kiln does);
- kiln vs hey: hey sends one body, so kiln runs again with ``--max-inputs 1`` for that pair.
Rounds alternate the tools so background load on the machine hits them alike; the median round
is reported, and the median of the per-round ratios (each kiln run against the other tool's run
right after it: on a shared VM throughput drifts by 10-20% between minutes, and pairing takes
the drift out). The claim the README makes: kiln's throughput and p50 within 10% of wrk/hey.
On a small machine the client and the server share the cores: a client that burns more CPU
per request steals it from the server, which is exactly what this comparison exposes."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import statistics
import subprocess
import tempfile
from dataclasses import replace
from pathlib import Path

from modelkiln.loadtest.api import LoadtestOptions, prepare, run_loadtest
from modelkiln.loadtest.runner import Load

LUA = r"""
local bodies = {%s}
local headers = {%s}
local path = "%s"
local i = 0
init = function(args) i = math.random(#bodies) - 1 end
request = function()
  i = i %% #bodies + 1
  return wrk.format("POST", path, headers[i], bodies[i])
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("RESULT %%d %%d %%f %%f %%f %%d\n", summary.requests, summary.duration,
    latency:percentile(50), latency:percentile(95), latency:percentile(99),
    e.connect + e.read + e.write + e.status + e.timeout))
end
"""


def lua_string(data: bytes) -> str:
    return '"' + "".join(f"\\{b:03d}" if b < 32 or b > 126 or b in (34, 92) else chr(b) for b in data) + '"'


def write_lua(prepared, path: Path) -> None:  # type: ignore[no-untyped-def]
    bodies = ",".join(lua_string(p.body) for p in prepared)
    headers = ",".join("{" + ",".join(f'[{lua_string(k.encode())}]={lua_string(v.encode())}' for k, v in p.headers)
                       + "}" for p in prepared)
    path.write_text(LUA % (bodies, headers, prepared[0].path), encoding="utf-8")


def run_wrk(url: str, script: Path, c: int, seconds: float) -> dict:
    out = subprocess.run(["wrk", "-t", "1", "-c", str(c), "-d", f"{seconds:g}s", "-s", str(script), url],
                         capture_output=True, text=True, check=True).stdout
    m = re.search(r"RESULT (\d+) (\d+) ([\d.]+) ([\d.]+) ([\d.]+) (\d+)", out)
    if not m:
        raise SystemExit(f"cannot parse wrk output:\n{out}")
    n, us = int(m.group(1)), int(m.group(2))
    return {"rps": n / (us / 1e6), "p50": float(m.group(3)) / 1e3, "p95": float(m.group(4)) / 1e3,
            "p99": float(m.group(5)) / 1e3, "errors": int(m.group(6))}


def run_hey(url: str, body: Path, headers, c: int, seconds: float) -> dict:  # type: ignore[no-untyped-def]
    cmd = ["hey", "-z", f"{seconds:g}s", "-c", str(c), "-m", "POST", "-D", str(body)]
    for k, v in headers:
        cmd += ["-T", v] if k.lower() == "content-type" else ["-H", f"{k}: {v}"]
    out = subprocess.run([*cmd, url], capture_output=True, text=True, check=True).stdout
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    pct = {int(p): float(v) * 1e3 for p, v in re.findall(r"\s(\d+)%+ in ([\d.]+) secs", out)}
    if not rps or 50 not in pct:
        raise SystemExit(f"cannot parse hey output:\n{out}")
    status_part = out.split("Status code distribution:", 1)[-1].split("Error distribution:", 1)[0]
    codes = {k: int(v) for k, v in re.findall(r"\[(\d+)\][ \t]+(\d+) responses", status_part)}
    error_part = out.split("Error distribution:", 1)[1] if "Error distribution:" in out else ""
    errors = sum(int(n) for n in re.findall(r"^\s+\[(\d+)\]\s", error_part, re.M))
    return {"rps": float(rps.group(1)), "p50": pct[50], "p95": pct.get(95), "p99": pct.get(99),
            "errors": sum(v for k, v in codes.items() if k != "200") + errors}


def run_kiln(opts: LoadtestOptions, c: int, seconds: float) -> dict:
    # one window of the same length as the other tools' runs; a short warm-up outside it
    o = replace(opts, loads=(Load("concurrency", float(c)),), warmup_s=0.5, window_s=seconds, stable_windows=1,
                max_windows=1, metrics_url=None)
    s = run_loadtest(o).steps[0]
    assert s.latency is not None
    return {"rps": s.throughput, "p50": s.latency.p50, "p95": s.latency.p95, "p99": s.latency.p99,
            "errors": sum(s.errors.values())}


def median_of(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs if r[k] is not None) for k in ("rps", "p50", "p95", "p99", "errors")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("url")
    ap.add_argument("--model", required=True)
    ap.add_argument("--protocol", default="oip-json")
    ap.add_argument("--inputs", default="samples")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tools", default="wrk,hey")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    tools = [t for t in args.tools.split(",") if t]
    for t in tools:
        if not shutil.which(t):
            raise SystemExit(f"{t} not found: apt-get install -y {t}")
    base = LoadtestOptions(url=args.url, model=args.model, loads=(), protocol=args.protocol, inputs=args.inputs)
    one = replace(base, max_inputs=1)
    prepared_all, _ = asyncio.run(prepare(base))
    prepared_one, _ = asyncio.run(prepare(one))
    url = args.url.rstrip("/") + prepared_all[0].path
    tmp = Path(tempfile.mkdtemp(prefix="kiln-compare-"))
    write_lua(prepared_all, tmp / "bodies.lua")
    (tmp / "body.bin").write_bytes(prepared_one[0].body)

    results = []
    print(f"{'c':>4} {'pair':<10} {'tool':<6} {'req/s':>9} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8} {'err':>4}  "
          f"{'Δ req/s':>8} {'Δ p50':>7}  {'paired Δ req/s':>14} {'paired Δ p50':>12}")
    for c in [int(x) for x in args.concurrency.split(",")]:
        runs: dict[str, list[dict]] = {k: [] for k in ("kiln-all", "wrk", "kiln-one", "hey")}
        for _ in range(args.rounds):
            if "wrk" in tools:
                runs["kiln-all"].append(run_kiln(base, c, args.seconds))
                runs["wrk"].append(run_wrk(url, tmp / "bodies.lua", c, args.seconds))
            if "hey" in tools:
                runs["kiln-one"].append(run_kiln(one, c, args.seconds))
                runs["hey"].append(run_hey(url, tmp / "body.bin", prepared_one[0].headers, c, args.seconds))
        for kiln_key, other in (("kiln-all", "wrk"), ("kiln-one", "hey")):
            if not runs[other]:
                continue
            k, o = median_of(runs[kiln_key]), median_of(runs[other])
            paired = {m: statistics.median(a[m] / b[m] - 1 for a, b in zip(runs[kiln_key], runs[other]))
                      for m in ("rps", "p50")}
            pair = "all bodies" if other == "wrk" else "one body"
            for tool, r in (("kiln", k), (other, o)):
                delta = ("", "", "", "") if tool == other else (
                    f"{(k['rps'] / o['rps'] - 1):+.1%}", f"{(k['p50'] / o['p50'] - 1):+.1%}",
                    f"{paired['rps']:+.1%}", f"{paired['p50']:+.1%}")
                print(f"{c:>4} {pair:<10} {tool:<6} {r['rps']:>9.1f} {r['p50']:>8.2f} {r['p95']:>8.2f} {r['p99']:>8.2f} "
                      f"{int(r['errors']):>4}  {delta[0]:>8} {delta[1]:>7}  {delta[2]:>14} {delta[3]:>12}")
            results.append({"concurrency": c, "pair": pair, "kiln": k, other: o, "paired_delta": paired,
                            "rounds": runs[kiln_key] + runs[other]})
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
