"""One load step: the load generators (``generators.py``: closed loop at a concurrency, open loop
at a rate) run while measurement windows are taken, until the stability rule is met.

A step runs warm-up (discarded), then windows of ``window_s`` until the last ``stable_windows``
agree (max/min of throughput and of p95 within ``1 + stability``, perf_analyzer's rule) or
``max_windows`` is reached (reported as unstable). The server's /metrics are scraped around the
measured windows (breakdown) and around the whole step while idle (exact request counts)."""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import KilnError
from . import server_metrics, streaming
from .client import fetch, parse_url
from .generators import ClosedLoop, open_loop, watchdog
from .records import MID_STREAM_CODE, StepState, status_name
from .streaming import is_generation

if TYPE_CHECKING:
    from .check import Checker


@dataclass(frozen=True)
class Load:
    mode: str  # "concurrency" (closed loop) | "rate" (open loop, requests/s)
    value: float

    @property
    def label(self) -> str:
        return f"c={int(self.value)}" if self.mode == "concurrency" else f"rate={self.value:g}/s"


def parse_levels(spec: str, option: str) -> list[float]:
    """``4`` | ``1,2,8`` | ``1:64:x2`` (geometric) | ``10:100:+30`` (arithmetic; the end included)."""
    spec = spec.strip()
    try:
        m = re.fullmatch(r"([\d.]+):([\d.]+)(?::([x*+])([\d.]+))?", spec)
        if m:
            start, stop = float(m.group(1)), float(m.group(2))
            op, step = m.group(3) or "x", float(m.group(4) or 2)
            if start <= 0 or stop < start or (op in "x*" and step <= 1) or (op == "+" and step <= 0):
                raise ValueError
            values, v = [], start
            while v <= stop * (1 + 1e-9):
                values.append(v)
                v = v * step if op in "x*" else v + step
            return values
        values = [float(v) for v in spec.split(",") if v.strip()]
        if not values or any(v <= 0 for v in values):
            raise ValueError
        return values
    except ValueError:
        raise KilnError(f"{option} takes N, N,M,..., START:STOP:xF or START:STOP:+D with positive numbers; "
                        f"got '{spec}'") from None


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """How each load step is measured: declared once, for RunConfig and for LoadtestOptions."""

    warmup_s: float = 1.0
    window_s: float = 2.0
    stability: float = 0.10
    stable_windows: int = 3
    max_windows: int = 10
    timeout_s: float = 30.0
    max_connections: int = 256  # open loop: the most requests outstanding at once
    seed: int = 0
    headers: tuple[tuple[str, str], ...] = ()  # sent with metadata and /metrics requests too

    def measurement(self) -> dict[str, Any]:
        """These settings alone, to build another Measurement subclass from."""
        return {f.name: getattr(self, f.name) for f in fields(Measurement)}


@dataclass(frozen=True, kw_only=True)
class RunConfig(Measurement):
    url: str
    model: str
    metrics_url: str | None = None  # None: no server breakdown
    route: str | None = None  # kiln serve route label to count (infer | predict)
    grpc_target: str | None = None  # host:port: requests are gRPC ModelInfer calls (grpc_load)
    protocol: str = ""  # a generation protocol (streaming.GENERATION_PROTOCOLS): requests are streams


@dataclass
class Latency:
    """Milliseconds, of successful requests."""

    mean: float
    p50: float
    p90: float
    p95: float
    p99: float
    max: float

    @classmethod
    def of(cls, seconds: np.ndarray) -> Latency | None:
        if seconds.size == 0:
            return None
        ms = seconds * 1e3
        p50, p90, p95, p99 = np.percentile(ms, [50, 90, 95, 99])
        return cls(float(ms.mean()), float(p50), float(p90), float(p95), float(p99), float(ms.max()))


@dataclass
class GenerationStats:
    """A generation step, as genai-perf reports one. TTFT and request latency are those of the
    streams that ended in the measured windows; ITL are all gaps between consecutive token chunks
    of those streams; output tokens/s counts the tokens that *arrived* in the measured windows,
    from every stream (also those that began before or ended after), so that a window shorter
    than a few requests still counts what the server produced in it."""

    ttft: Latency | None
    itl: Latency | None
    output_tokens_per_s: float
    output_tokens_per_request: float  # mean, of the streams that ended in the measured windows
    tokens_from: str | None  # "usage" (the server's final count) | "chunks" (text events counted) | "mixed" | None (none ended)


@dataclass
class StepResult:
    mode: str
    value: float
    throughput: float  # successful requests/s over the measured windows
    inputs_per_s: float  # throughput × inputs per request
    requests: int  # successful requests in the measured windows
    latency: Latency | None
    errors: dict[str, int]  # measured windows: failed requests by HTTP status / connection / timeout
    windows: int  # windows run (warm-up excluded)
    stable: bool
    measured_s: float
    sent: int  # whole step (warm-up and drain included): requests sent ...
    answered: dict[str, int]  # ... and their outcomes by status; compare with the server's counters
    late_fraction: float | None = None  # open loop: arrivals sent >1 ms late because every connection was busy
    server: server_metrics.ServerBreakdown | None = None  # measured windows
    server_total: server_metrics.ServerBreakdown | None = None  # whole step, scraped while idle
    generation: GenerationStats | None = None  # generation protocols
    checked: int | None = None  # --check: answers compared with their reference (whole step) ...
    mismatches: int | None = None  # ... those that differed ...
    mismatch_kinds: dict[str, int] | None = None  # ... by kind (check.py)
    stream_errors: int | None = None  # generation: streams that began and then failed (whole step)
    window_s: float | None = None  # the length of each measurement window (generation: adapted to the requests)

    @property
    def load(self) -> Load:
        return Load(self.mode, self.value)


@dataclass
class RunResult:
    label: str
    url: str
    model: str
    protocol: str
    inputs: str
    batch: int
    started: str
    steps: list[StepResult] = field(default_factory=list)
    max_tokens: int | None = None  # generation
    ignore_eos: bool | None = None  # generation
    sampled: bool | None = None  # generation: sampled (streaming.SAMPLED) rather than greedy
    check: bool = False
    mismatch_examples: list[str] = field(default_factory=list)  # --check: the first few, in words


async def _scrape(url: str | None, headers: Sequence[tuple[str, str]] = ()) -> server_metrics.Snapshot | None:
    if url is None:
        return None
    try:
        status, body = await fetch(url, timeout=10.0, headers=headers)
    except KilnError:
        return None
    return server_metrics.parse(body.decode("utf-8", "replace")) if status == 200 else None


def _stable(tputs: list[float], p95s: list[float], tolerance: float) -> bool:
    def close(values: list[float]) -> bool:
        return min(values) > 0 and max(values) / min(values) <= 1 + tolerance

    return close(tputs) and close(p95s)


async def run_step(cfg: RunConfig, load: Load, requests: Sequence[bytes], inputs_per_request: int,
                   on_window: Callable[[int, float, float], None] | None = None,
                   checker: Checker | None = None) -> StepResult:
    host, port, _ = parse_url(cfg.url)
    rate = load.value if load.mode == "rate" else None
    state = StepState(requests, rate, cfg.seed, checker, cfg.protocol)
    generation = is_generation(cfg.protocol)
    idle_before = await _scrape(cfg.metrics_url, cfg.headers)
    guard = None
    if cfg.grpc_target is not None:  # gRPC's own deadlines bound each call: no watchdog
        from . import grpc_load

        if rate is None:
            workers = [asyncio.create_task(grpc_load.closed_loop(state, cfg.grpc_target, cfg.headers, cfg.timeout_s))
                       for _ in range(int(load.value))]
        else:
            state.next_t = time.perf_counter()
            in_flight: set[asyncio.Task[None]] = set()
            workers = [asyncio.create_task(grpc_load.open_loop(state, cfg.grpc_target, cfg.headers, cfg.timeout_s,
                                                               cfg.max_connections, in_flight))]
    elif generation:  # streams: each waits for its own answer (seconds), no callback chain needed
        if rate is None:
            workers = [asyncio.create_task(streaming.closed_loop(state, host, port, cfg.timeout_s))
                       for _ in range(int(load.value))]
        else:
            state.next_t = time.perf_counter()
            in_flight = set()
            workers = [asyncio.create_task(open_loop(state, host, port, cfg.timeout_s, cfg.max_connections,
                                                     in_flight, send=streaming.send_stream))]
    elif rate is None:
        loops = [ClosedLoop(state, host, port, cfg.timeout_s) for _ in range(int(load.value))]
        workers = [asyncio.create_task(c.run()) for c in loops]
        guard = asyncio.create_task(watchdog(loops, cfg.timeout_s))
    else:
        state.next_t = time.perf_counter()
        in_flight = set()
        workers = [asyncio.create_task(open_loop(state, host, port, cfg.timeout_s, cfg.max_connections, in_flight))]
    try:
        await asyncio.sleep(cfg.warmup_s)
        window_s = await _generation_window(cfg, load, state) if generation else cfg.window_s
        measure_before = await _scrape(cfg.metrics_url, cfg.headers)
        marks = [(time.perf_counter(), len(state.codes), len(state.lags))]
        tputs: list[float] = []
        p95s: list[float] = []
        stable = False
        while len(marks) - 1 < cfg.max_windows:
            await asyncio.sleep(window_s)
            marks.append((time.perf_counter(), len(state.codes), len(state.lags)))
            (t0, i0, _), (t1, i1, _) = marks[-2], marks[-1]
            codes = np.asarray(state.codes[i0:i1])
            ok = np.asarray(state.latencies[i0:i1])[(codes >= 200) & (codes < 300)]
            tputs.append(ok.size / (t1 - t0))
            p95s.append(float(np.percentile(ok, 95)) if ok.size else math.inf)
            if on_window is not None:
                on_window(len(tputs), tputs[-1], p95s[-1] * 1e3)
            if len(tputs) >= cfg.stable_windows and _stable(tputs[-cfg.stable_windows:], p95s[-cfg.stable_windows:],
                                                            cfg.stability):
                stable = True
                break
        measure_after = await _scrape(cfg.metrics_url, cfg.headers)
    finally:
        state.stop = True
        if rate is not None:
            workers[0].cancel()  # the dispatcher: asleep until its next arrival, or waiting for a connection
        done, pending = await asyncio.wait(workers, timeout=cfg.timeout_s + 5)
        for task in pending:  # only a server that ignores its own timeouts gets here
            task.cancel()
        if guard is not None:
            guard.cancel()
    idle_after = await _scrape(cfg.metrics_url, cfg.headers)

    k = min(cfg.stable_windows, len(marks) - 1)
    (t0, i0, l0), (t1, i1, l1) = marks[-1 - k], marks[-1]
    codes = np.asarray(state.codes[i0:i1], dtype=np.int64)
    success = (codes >= 200) & (codes < 300)
    latencies = np.asarray(state.latencies[i0:i1])[success]
    errors = Counter(status_name(int(c)) for c in codes[~success])
    lags = np.asarray(state.lags[l0:l1])
    measured = t1 - t0
    requests_ok = int(success.sum())
    route = cfg.route
    all_codes = np.asarray(state.codes, dtype=np.int64)
    checked = [p for c, p in zip(state.codes, state.problems) if 200 <= c < 300 or c == MID_STREAM_CODE]
    return StepResult(
        mode=load.mode, value=load.value, throughput=requests_ok / measured,
        inputs_per_s=requests_ok * inputs_per_request / measured, requests=requests_ok,
        latency=Latency.of(latencies), errors=dict(errors), windows=len(marks) - 1, stable=stable,
        measured_s=measured, sent=state.sent, answered=dict(Counter(status_name(c) for c in state.codes)),
        late_fraction=float((lags > 1e-3).mean()) if rate is not None and lags.size else None,
        server=(server_metrics.breakdown(measure_before, measure_after, cfg.model, route)
                if measure_before is not None and measure_after is not None else None),
        server_total=(server_metrics.breakdown(idle_before, idle_after, cfg.model, route)
                      if idle_before is not None and idle_after is not None else None),
        generation=_generation_stats(state, i0, i1, t0, t1) if generation else None,
        checked=len(checked) if checker is not None else None,
        mismatches=sum(p is not None for p in checked) if checker is not None else None,
        mismatch_kinds=dict(Counter(p for p in checked if p is not None)) if checker is not None else None,
        stream_errors=int((all_codes == MID_STREAM_CODE).sum()) if generation else None,
        window_s=window_s,
    )


WINDOW_REQUESTS = 4  # generation: requests a measurement window should see end, at the least


async def _generation_window(cfg: RunConfig, load: Load, state: StepState) -> float:
    """The window length of a generation step, long enough to see ``max(concurrency, 4)`` requests
    end: a request takes seconds, and a window that sees none or one cannot be compared with the
    next. Closed loop: the warm-up goes on until ``concurrency`` requests have ended (every client
    about one: the streams no longer start together), then the window is
    ``max(--window, mean latency × max(c, 4) / c)``. Open loop: ``max(--window, 4 / rate)``."""
    if load.mode == "rate":
        return max(cfg.window_s, WINDOW_REQUESTS / load.value)
    clients = int(load.value)
    deadline = time.perf_counter() + cfg.timeout_s
    while len(state.codes) < clients and time.perf_counter() < deadline:
        await asyncio.sleep(0.05)
    codes = np.asarray(state.codes)
    ended = np.asarray(state.latencies)[(codes >= 200) & (codes < 300)]
    if not ended.size:
        return cfg.window_s
    return max(cfg.window_s, float(ended.mean()) * max(clients, WINDOW_REQUESTS) / clients)


def _generation_stats(state: StepState, i0: int, i1: int, t0: float, t1: float) -> GenerationStats:
    ended = [r for c, r in zip(state.codes[i0:i1], state.streams[i0:i1]) if c == 200 and r is not None]
    ttft = np.asarray([r.token_times[0] - r.start for r in ended if r.token_times])
    gaps = [np.diff(r.token_times) for r in ended if len(r.token_times) > 1]
    tokens = 0.0
    for code, r in zip(state.codes, state.streams):  # every stream of the step: tokens that arrived in [t0, t1]
        if code == 200 and r is not None and r.token_times:
            times = np.asarray(r.token_times)
            tokens += r.output_tokens / times.size * int(((times >= t0) & (times < t1)).sum())
    sources = {"usage" if r.completion_tokens is not None else "chunks" for r in ended}
    return GenerationStats(
        ttft=Latency.of(ttft), itl=Latency.of(np.concatenate(gaps)) if gaps else None,
        output_tokens_per_s=tokens / (t1 - t0),
        output_tokens_per_request=float(np.mean([r.output_tokens for r in ended])) if ended else 0.0,
        tokens_from=sources.pop() if len(sources) == 1 else ("mixed" if sources else None))


async def model_metadata(url: str, model: str, headers: Sequence[tuple[str, str]] = ()) -> dict | None:
    """``GET /v2/models/{model}`` as a dict, or None when the server has no such route."""
    import json

    status, body = await fetch(f"{url.rstrip('/')}/v2/models/{model}", headers=headers)
    if status == 200:
        try:
            data = json.loads(body)
            return data if isinstance(data, dict) else None
        except ValueError:
            return None
    if status in (401, 403):
        raise KilnError(f"{url} refused the metadata request ({status}): pass --header 'Authorization: Bearer KEY'")
    return None
