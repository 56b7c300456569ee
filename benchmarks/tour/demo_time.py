"""How long `make demo` takes after the install, command by command and step by step.

The commands are the Makefile's own (``make -n demo``, the install marked done), so this cannot
drift from what a user runs. For each command: wall seconds and CPU seconds (its processes' user +
system time, from getrusage); for each ``✓ step (Ns)`` line it prints: the step's wall time and the
CPU its process tree used since the previous line (read from /proc). On a machine shared with
other work, wall time grows with the load while CPU time mostly does not, so both are recorded,
with the load average before and after each command.

    python benchmarks/tour/demo_time.py --out /tmp/demo-artifacts --venv /work/main/.venv \\
        --log benchmarks/results/demo-time.txt
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

STEP = re.compile(r"✓ (?P<what>.*?) \((?P<wall>[\d.]+)s\)\s*$")
TICK = os.sysconf("SC_CLK_TCK")


def demo_commands(venv: str, out: Path) -> list[str]:
    """The commands of `make demo` after its install step, with the artifacts under ``out``."""
    make = ["make", "-s", "-n", "demo", f"VENV={venv}", "-o", f"{venv}/.installed",
            f"ARTIFACT={out}/all-MiniLM-L6-v2", f"LLM_ARTIFACT={out}/smollm2"]
    listed = subprocess.run(make, check=True, capture_output=True, text=True, cwd=Path(__file__).parents[2]).stdout
    return [line for line in listed.splitlines() if line.strip()]


def tree_cpu(pid: int) -> float:
    """CPU seconds of ``pid`` and its living descendants, plus what their finished children used."""
    total, stack = 0.0, [pid]
    while stack:
        p = stack.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += sum(int(v) for v in fields[11:15]) / TICK  # utime, stime, cutime, cstime
            for task in Path(f"/proc/{p}/task").iterdir():
                stack += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue
    return total


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(command: str, venv: str, log) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    short = re.sub(r"\"\$\(.*?\)\"", "…", command).replace(f"{venv}/bin/", "")  # `kiln convert "…" ...`
    log(f"$ {short}")
    log(f"  load before: {load()}")
    cpu0, started = children_cpu(), time.perf_counter()
    proc = subprocess.Popen(["bash", "-c", command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "COLUMNS": "160"})
    last_cpu = 0.0
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
        step = STEP.search(line)
        if step:
            cpu = tree_cpu(proc.pid)
            log(f"  step {float(step['wall']):7.1f} s wall {cpu - last_cpu:7.1f} s CPU  {step['what']}")
            last_cpu = cpu
    if proc.wait() != 0:
        raise SystemExit(f"{short} failed with exit code {proc.returncode}")
    wall, cpu = time.perf_counter() - started, children_cpu() - cpu0
    log(f"  command {wall:7.1f} s wall {cpu:7.1f} s CPU; load after: {load()}")
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the two artifacts")
    parser.add_argument("--venv", default=".venv", help="the installed venv (make demo's VENV)")
    parser.add_argument("--log", type=Path, help="append the timings to this file too")
    parser.add_argument("--label", default="", help="a line saying what is measured (branch, machine)")
    parser.add_argument("--commands", help="run only these of the demo's commands (1-based, e.g. 3,4,5)")
    args = parser.parse_args()
    lines: list[str] = []

    def log(text: str) -> None:
        print(f"[demo-time] {text}", flush=True)
        lines.append(text)

    log(f"# python benchmarks/tour/demo_time.py --out {args.out} --venv {args.venv}  {args.label}".rstrip())
    log(f"# {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, {os.cpu_count()} CPUs, load {load()}")
    total_wall = total_cpu = 0.0
    commands = demo_commands(args.venv, args.out)
    if args.commands:
        commands = [commands[int(i) - 1] for i in args.commands.split(",")]
    for command in commands:
        wall, cpu = run(command, args.venv, log)
        total_wall, total_cpu = total_wall + wall, total_cpu + cpu
    what = f"commands {args.commands} of make demo" if args.commands else "make demo after the install"
    log(f"{what}: {total_wall:.1f} s wall ({total_wall / 60:.1f} min), {total_cpu:.1f} s CPU; "
        f"load at the end: {load()}")
    if args.log:
        with args.log.open("a") as f:
            f.write("\n".join(lines) + "\n\n")


if __name__ == "__main__":
    main()
