"""The sweep: one ``kiln serve`` process per combination of settings, a short closed-loop load test
on each, and, for encoders, a ranking against a p99 budget (Model Analyzer's way: the best
throughput whose p99 stays within budget; a combination that never meets it ranks below every one
that does). Text generation is judged by its own limits (``generation.py``) on the same runs.

Each combination runs in a fresh server process, so one setting's thread pools, arena growth or
queue state cannot leak into the next measurement; the server's peak resident memory (VmHWM)
is read from /proc before it is stopped."""

from __future__ import annotations

import itertools
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import KilnError
from ..loadtest.api import LoadtestOptions, run_loadtest
from ..loadtest.runner import RunResult, StepResult
from ..net import child_environment, free_port, stop_child, wait_until_ready



def sweepable_flags(kind: str | None = None) -> dict[str, str]:
    """The settings ``kiln tune`` may sweep for a model of ``kind`` (None: any), as ServeSettings
    field names → the ``kiln serve`` flag that sets each: whatever the declaration marks with
    ``sweep=`` (serve/settings.py)."""
    from ..serve.settings import cli_flag, sweepable

    return {name: cli_flag(name) for name in sweepable(kind)}


@dataclass(frozen=True)
class Grid:
    """The values to try per sweepable setting (ServeSettings field names → values; None: the
    server's default) for a model of ``kind``. A sweepable setting left out runs at the server's
    default."""

    values: Mapping[str, Sequence[Any]]
    kind: str = "encoder"

    def combinations(self) -> list[dict[str, Any]]:
        """Every combination once, each a valid ServeSettings (checked here, before any server
        starts: a bad value or a rule across settings is a KilnError). A setting with no effect
        beside the others (``applies``: draft tokens where speculation is off) is left to the
        server's default, so combinations that differ only in it are one configuration, not
        several runs of the same server."""
        from ..serve.settings import ServeSettings, applies

        keys = tuple(sweepable_flags(self.kind))
        unknown = sorted(set(self.values) - set(keys))
        if unknown:
            raise KilnError(f"not sweepable for {self.kind} models: {', '.join(unknown)} "
                            f"(sweepable: {', '.join(keys)})")
        axes = [tuple(self.values.get(k) or (None,)) for k in keys]
        combos: list[dict[str, Any]] = []
        for combo in itertools.product(*axes):
            given = dict(zip(keys, combo))
            settings = {k: v if applies(k, given) else None for k, v in given.items()}
            if settings not in combos:
                combos.append(settings)
        defaults = ServeSettings()
        for settings in combos:
            defaults.replace(**{k: v for k, v in settings.items() if v is not None}).check()
        return combos


@dataclass
class Trial:
    settings: dict[str, Any]
    run: RunResult | None = None
    best: StepResult | None = None  # the highest-throughput step within budget (or the lowest p99 if none)
    within_budget: bool = False
    peak_rss_mb: float | None = None
    error: str | None = None  # the server did not start, or the load test failed

    @property
    def throughput(self) -> float:
        return self.best.throughput if self.best else 0.0

    @property
    def p99_ms(self) -> float | None:
        return self.best.latency.p99 if self.best and self.best.latency else None


@dataclass
class TuneResult:
    artifact: str
    model: str
    p99_budget_ms: float | None
    trials: list[Trial] = field(default_factory=list)

    def ranked(self) -> list[Trial]:
        def key(t: Trial) -> tuple:
            return (t.error is not None, not t.within_budget, -t.throughput, t.p99_ms or float("inf"))

        return sorted(self.trials, key=key)

    def best(self) -> Trial | None:
        ranked = [t for t in self.ranked() if t.error is None and t.best is not None]
        return ranked[0] if ranked else None


def process_memory_mb(pid: int, field: str) -> float | None:
    """A memory figure of a process from /proc (Linux: VmRSS now, VmHWM peak), in MiB; None if unknown."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it (Linux: /proc/PID/task/*/children); [pid] elsewhere."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return found


def server_memory_mb(pid: int, field: str) -> float | None:
    """``process_memory_mb`` added up over a server and its child processes (``kiln serve
    --workers N``: the workers hold the models). Of VmHWM, the sum of each process's peak."""
    values = [process_memory_mb(p, field) for p in process_tree(pid)]
    known = [v for v in values if v is not None]
    return sum(known) if known else None


class ServeProcess:
    """``python -m modelkiln serve NAME=ARTIFACT`` with the given settings on a free loopback port."""

    def __init__(self, artifact: Path, name: str, settings: dict[str, Any], timeout: float = 120.0,
                 extra_args: Sequence[str] = (), grpc: bool = False, prefix: Sequence[str] = ()):
        """``prefix``: a command the server runs under (``taskset -c 0``: a pinned server)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # gRPC only when asked: its default port (8001) would collide between servers
        self.grpc_port = free_port() if grpc else 0
        self.grpc_url = f"127.0.0.1:{self.grpc_port}" if grpc else None
        args = [f"{name}={artifact}", "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning",
                "--grpc-port", str(self.grpc_port)]
        flags = sweepable_flags()
        for key, value in settings.items():
            if value is not None:
                args += [flags[key], str(value)]
        self.log = tempfile.NamedTemporaryFile(prefix="kiln-tune-serve-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([*prefix, sys.executable, "-m", "modelkiln", "serve", *args, *extra_args],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=child_environment())
        wait_until_ready(self.proc, self.url, timeout, "kiln serve", self.log_tail, self.stop)

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return Path(self.log.name).read_text(errors="replace")[-chars:].strip()
        except OSError:
            return ""

    def peak_rss_mb(self) -> float | None:
        """Peak resident memory of the server's processes (Linux), in MiB."""
        return self.memory_mb("VmHWM")

    def memory_mb(self, field: str) -> float | None:
        return server_memory_mb(self.proc.pid, field)

    def stop(self, timeout: float = 30.0) -> int:
        returncode = stop_child(self.proc, timeout)
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)
        return returncode

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def pick_best_step(run: RunResult, budget_ms: float | None) -> tuple[StepResult | None, bool]:
    """Highest throughput among error-free steps within the p99 budget; else the lowest-p99 step."""
    steps = [s for s in run.steps if s.latency is not None]
    clean = [s for s in steps if not s.errors]
    within = [s for s in clean if budget_ms is None or _p99(s) <= budget_ms]
    if within:
        return max(within, key=lambda s: s.throughput), True
    pool = clean or steps
    return (min(pool, key=_p99) if pool else None), False


def _p99(step: StepResult) -> float:
    assert step.latency is not None  # pick_best_step's steps are those with latencies
    return step.latency.p99


def serve_and_load(artifact: Path, settings: dict[str, Any], load: LoadtestOptions,
                   start_timeout: float = 120.0) -> tuple[RunResult | None, float | None, str | None]:
    """One trial: ``kiln serve`` with ``settings`` in a fresh process, ``load`` run on it (its url
    and label replaced), and the server's peak memory; or the error that stopped it."""
    label = ", ".join(f"{k}={v}" for k, v in settings.items())
    try:
        with ServeProcess(artifact, load.model, settings, timeout=start_timeout) as server:
            run = run_loadtest(replace(load, url=server.url, label=label))
            return run, server.peak_rss_mb(), None
    except KilnError as exc:
        return None, None, str(exc)


def run_sweep(artifact: Path, grid: Grid, load: LoadtestOptions, budget_ms: float | None,
              on_trial: Callable[[int, int, Trial], None] | None = None, start_timeout: float = 120.0) -> TuneResult:
    """``load`` is the load test to run on each server (its url is replaced; model must be set)."""
    result = TuneResult(str(artifact), load.model, budget_ms)
    combos = grid.combinations()
    load = replace(load, stop_p99_ms=budget_ms if budget_ms is not None else load.stop_p99_ms)
    for i, settings in enumerate(combos, 1):
        trial = Trial(settings)
        trial.run, trial.peak_rss_mb, trial.error = serve_and_load(artifact, settings, load, start_timeout)
        if trial.run is not None:
            trial.best, trial.within_budget = pick_best_step(trial.run, budget_ms)
            if trial.best is None:
                trial.error = "no successful requests"
        result.trials.append(trial)
        if on_trial is not None:
            on_trial(i, len(combos), trial)
    return result
