"""wrk as the load generator for the server benchmarks: one request body per real sentence,
rotated per request by a Lua script; the script prints one parseable RESULT line."""

from __future__ import annotations

import re
import statistics
import subprocess
from pathlib import Path

_LUA = r"""
local bodies = {%s}
local i = 0
local path = "%s"
init = function(args) i = math.random(#bodies) end
request = function()
  i = i %% #bodies + 1
  return wrk.format("POST", path, {["Content-Type"] = "application/json"}, bodies[i])
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("RESULT %%d %%d %%d %%d %%f %%f %%f %%f\n", summary.requests, summary.duration,
    e.connect + e.read + e.write + e.timeout, e.status,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.mean))
end
"""


def _lua_string(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def write_script(folder: Path, path: str, bodies: list[str]) -> Path:
    """A wrk script POSTing ``bodies`` (JSON strings) in turn to ``path``."""
    script = Path(folder) / "load.lua"
    script.write_text(_LUA % (",".join(_lua_string(b) for b in bodies), path))
    return script


def print_table(results: list[dict], server: str | None = None, header: bool = True) -> None:
    """wrk results as the Markdown table the README quotes (a server column when comparing;
    ``header=False`` continues the previous table with another server's rows)."""
    lead = "| server " if server else ""
    if header:
        print(f"{lead}| concurrency | requests/s | p50 ms | p90 ms | p99 ms | errors |")
        print(("|---" if server else "") + "|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"{f'| {server} ' if server else ''}| {r['concurrency']} | {r['rps']:.0f} | {r['p50_ms']:.2f} "
              f"| {r['p90_ms']:.2f} | {r['p99_ms']:.2f} | {r['errors']} |")


def run_wrk(url: str, script: Path, connections: int, seconds: int, threads: int, prefix: list[str] | None = None
            ) -> dict:
    """``prefix``: a command wrk runs under (``taskset -c 2-15``: off the server's cores)."""
    out = subprocess.run([*(prefix or []), "wrk", "-t", str(threads), "-c", str(connections), "-d", f"{seconds}s", "--latency",
                          "-s", str(script), url], capture_output=True, text=True, check=True).stdout
    m = re.search(r"RESULT (\S+) (\S+) (\S+) (\S+) (\S+) (\S+) (\S+) (\S+)", out)
    if not m:
        raise SystemExit(f"cannot parse wrk output:\n{out}")
    requests, duration_us, socket_errors, status_errors = (int(m.group(i)) for i in range(1, 5))
    p50, p90, p99, mean = (float(m.group(i)) / 1000 for i in range(5, 9))
    return {"concurrency": connections, "requests": requests, "seconds": duration_us / 1e6,
            "rps": requests / (duration_us / 1e6), "errors": socket_errors + status_errors,
            "p50_ms": p50, "p90_ms": p90, "p99_ms": p99, "mean_ms": mean}


def median_runs(rounds: list[list[dict]]) -> list[dict]:
    """Rounds of ``run_wrk`` results (the same concurrencies in each) → per concurrency, the median
    of every figure over the rounds (errors: the sum)."""
    out = []
    for k, first in enumerate(rounds[0]):
        same = [runs[k] for runs in rounds]
        row = {key: statistics.median(x[key] for x in same) for key in first if key not in ("concurrency", "errors")}
        out.append({"concurrency": first["concurrency"], **row, "errors": sum(x["errors"] for x in same)})
    return out
