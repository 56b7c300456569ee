"""Probes about many good clients: misrouting, overload, SIGTERM under load, soak. Every 200 they
receive is checked against the references (``harness.References``)."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from .harness import (Check, Conn, KilnServer, ProbeResult, References, Reply, once, percentile_ms,
                      read_reply, request_bytes)

ROUTES = ("predict", "infer", "embeddings")  # three codecs into the same batcher
# A "fast" 503: issue 15 saw 3.4 s. Most of a refusal's time here is the 160 flooding clients' own
# event loop on the same cores: p99 292 ms on the tiny model at load average 6-9, 666 ms at 17.
FAST_503_MS = 1000


@dataclass
class Workload:
    """Requests of 1..``max_texts`` texts chosen at random from the references, in turn on the
    three routes; ``long_share`` of them carry one long text (a SQuAD paragraph) instead."""

    refs: References
    model: str
    input_name: str  # the OIP input tensor (from the model's metadata)
    short: list[int]  # reference indices of short texts
    long: list[int]  # ... of long ones
    long_share: float = 0.0
    max_texts: int = 4

    def next(self, rng: random.Random, n: int) -> tuple[list[int], bytes, str]:
        if self.long and rng.random() < self.long_share:
            indices = [rng.choice(self.long)]
        else:
            indices = rng.sample(self.short, rng.randint(1, self.max_texts))
        texts = [self.refs.texts[i] for i in indices]
        route = ROUTES[n % len(ROUTES)]
        if route == "predict":
            body = {"inputs": texts}
            path = f"/v2/models/{self.model}/predict"
        elif route == "infer":
            body = {"inputs": [{"name": self.input_name, "datatype": "BYTES", "shape": [len(texts)], "data": texts}]}
            path = f"/v2/models/{self.model}/infer"
        else:
            body = {"model": self.model, "input": texts}
            path = "/v1/embeddings"
        return indices, request_bytes("POST", path, orjson.dumps(body)), route

    def check(self, indices: list[int], route: str, reply: Reply) -> Check:
        answer = reply.json()
        if route == "infer":
            answer = answer["outputs"][0]["data"]
        elif route == "embeddings":
            answer = [d["embedding"] for d in sorted(answer["data"], key=lambda d: d["index"])]
        return self.refs.check(indices, answer)


@dataclass
class Tally:
    """What a set of clients saw: statuses, latencies (with the time each answer came), answers checked."""

    statuses: Counter = field(default_factory=Counter)
    latencies: list[tuple[float, float]] = field(default_factory=list)  # (finished at, seconds)
    check: Check = field(default_factory=Check)
    failures: Counter = field(default_factory=Counter)  # no answer: closed, timeout, refused

    @property
    def requests(self) -> int:
        return sum(self.statuses.values()) + sum(self.failures.values())

    def non_200(self) -> int:
        return self.requests - self.statuses[200]

    def as_dict(self) -> dict[str, Any]:
        seconds = [s for _, s in self.latencies]
        return {"requests": self.requests, "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
                "no_answer": dict(self.failures), **self.check.as_dict(),
                "p50_ms": percentile_ms(seconds, 50), "p99_ms": percentile_ms(seconds, 99)}


async def client(port: int, work: Workload, tally: Tally, stop: asyncio.Event, seed: int) -> None:
    """One keep-alive client sending requests back to back until ``stop``."""
    rng = random.Random(seed)
    conn = Conn(port)
    n = seed
    while not stop.is_set():
        n += 1
        indices, raw, route = work.next(rng, n)
        try:
            reply = await conn.call(raw)
        except asyncio.TimeoutError:
            tally.failures["timeout"] += 1
            conn.close()
            continue
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            tally.failures["closed"] += 1
            conn.close()
            await asyncio.sleep(0.01)
            continue
        tally.statuses[reply.status] += 1
        tally.latencies.append((time.monotonic(), reply.seconds))
        if reply.status == 200:
            tally.check.add(work.check(indices, route, reply))
    conn.close()


async def run_clients(port: int, work: Workload, clients: int, tally: Tally, until: Any) -> None:
    """``clients`` clients until ``until()`` is true (checked every 20 ms)."""
    stop = asyncio.Event()
    tasks = [asyncio.create_task(client(port, work, tally, stop, seed)) for seed in range(clients)]
    while not until():
        await asyncio.sleep(0.02)
    stop.set()
    await asyncio.gather(*tasks)


class GoodClients:
    """``clients`` well-formed clients next to an attack (``hostile.Alongside``), every answer checked."""

    def __init__(self, port: int, work: Workload, clients: int):
        self.port, self.work, self.clients = port, work, clients
        self.tally = Tally()

    async def run(self, until: Any) -> None:
        await run_clients(self.port, self.work, self.clients, self.tally, until)

    def outcome(self) -> str:
        return good_outcome(self.tally)

    def passed(self) -> bool:
        return good_passed(self.tally)

    def as_dict(self) -> dict[str, Any]:
        return self.tally.as_dict()

    @property
    def requests(self) -> int:
        return self.tally.requests


def good_outcome(t: Tally) -> str:
    c = t.check
    return (f"{c.misrouted} misrouted of {c.answers:,} answers; {c.answers - c.equal} differ from the text "
            f"alone (min cosine {c.min_cosine:.6f}); {t.non_200()} non-200")


def good_passed(t: Tally) -> bool:
    return t.check.misrouted == 0 and t.check.equal == t.check.answers and t.non_200() == 0 and t.check.answers > 0


# --- misrouting ------------------------------------------------------------------------------------


async def misrouting(server: KilnServer, work: Workload, answers: int, clients: int) -> ProbeResult:
    tally = Tally()
    started = time.monotonic()
    await run_clients(server.port, work, clients, tally, lambda: tally.check.answers >= answers)
    return ProbeResult("misrouting", tally.requests, good_outcome(tally),
                       f"0 misrouted of >= {answers:,} answers from {clients} concurrent clients, each equal to "
                       "its text's answer alone (cosine >= 0.99999), 0 non-200",
                       good_passed(tally), time.monotonic() - started,
                       {"clients": clients, "texts": len(work.refs.texts), **tally.as_dict()})


# --- overload ----------------------------------------------------------------------------------------


Lone = list[tuple[float, float, int, bytes]]  # a lone client's requests: (sent at, seconds, status, body)


async def sequential_latencies(port: int, work: Workload, seconds: float) -> Lone:
    """One client, one short text per request, for ``seconds``."""
    rng = random.Random(7)
    conn = Conn(port)
    out = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        i = rng.choice(work.short)
        raw = request_bytes("POST", f"/v2/models/{work.model}/predict", orjson.dumps({"inputs": [work.refs.texts[i]]}))
        sent = time.monotonic()
        reply = await conn.call(raw)
        out.append((sent, reply.seconds, reply.status, reply.body))
    conn.close()
    return out


async def flood_client(port: int, raw: bytes, stop: asyncio.Event, tally: Tally, retry_after: Counter) -> None:
    conn = Conn(port)
    while not stop.is_set():
        try:
            reply = await conn.call(raw)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            tally.failures[type(exc).__name__] += 1
            conn.close()
            continue
        tally.statuses[reply.status] += 1
        tally.latencies.append((reply.status, reply.seconds))
        if reply.status == 503:
            retry_after[reply.headers.get("retry-after", "missing")] += 1
    conn.close()


@dataclass
class Flood:
    """``connections`` clients sending one request back to back for ``seconds``, with a lone client
    timed before (3 s) and after (8 s) it: what the flood got, and how soon the lone client was
    served as fast as before."""

    connections: int
    sustainable: int
    seconds: float
    tally: Tally
    retry_after: Counter
    before: Lone
    after: Lone
    normal_ms: float
    recovery_s: float | None

    @classmethod
    async def run(cls, port: int, raw: bytes, sustainable: int, seconds: float,
                  lone: Callable[[float], Awaitable[Lone]]) -> Flood:
        before = await lone(3.0)
        normal_ms = percentile_ms([s for _, s, status, _ in before if status == 200], 50) or 0.0
        tally, retry_after, stop = Tally(), Counter(), asyncio.Event()
        tasks = [asyncio.create_task(flood_client(port, raw, stop, tally, retry_after)) for _ in range(10 * sustainable)]
        await asyncio.sleep(seconds)
        stop.set()
        for t in tasks:  # the flood ends at once: its clients hang up, their queued work is dropped
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        flood_over = time.monotonic()
        after = await lone(8.0)
        # recovered: the first of 10 answers in a row, each within 2x normal latency (+5 ms for jitter)
        bound = max(2 * normal_ms, normal_ms + 5.0) / 1000
        recovered_at = next((after[i][0] for i in range(len(after) - 9)
                             if all(s <= bound and status == 200 for _, s, status, _ in after[i:i + 10])), None)
        recovery_s = None if recovered_at is None else round(recovered_at - flood_over, 2)
        return cls(10 * sustainable, sustainable, seconds, tally, retry_after, before, after, normal_ms, recovery_s)

    def latencies(self, status: int) -> list[float]:
        return [s for st, s in self.tally.latencies if st == status]

    @property
    def other(self) -> dict[str, int]:
        return {str(k): v for k, v in self.tally.statuses.items() if k not in (200, 503)}

    @property
    def requests(self) -> int:
        return self.tally.requests + len(self.before) + len(self.after)

    @property
    def passed(self) -> bool:
        """Only 200s and 503s, each 503 with Retry-After and fast, the lone client served as before within 5 s."""
        p99 = percentile_ms(self.latencies(503), 99)
        return (not self.other and not self.tally.failures and self.retry_after.get("missing", 0) == 0
                and p99 is not None and p99 <= FAST_503_MS and self.recovery_s is not None and self.recovery_s <= 5)

    def outcome(self, each: str = "") -> str:
        t, lat503 = self.tally, self.latencies(503)
        return (f"{self.connections} connections{each} for {self.seconds:g} s: {t.statuses[200]:,} 200s, "
                f"{t.statuses[503]:,} 503s (p50 {percentile_ms(lat503, 50)} ms, p99 {percentile_ms(lat503, 99)} ms, "
                f"Retry-After on {sum(v for k, v in self.retry_after.items() if k != 'missing'):,}), other "
                f"{self.other or 0}, no answer {sum(t.failures.values())}; back to normal latency ({self.normal_ms} ms "
                f"p50) {self.recovery_s} s after")

    def as_dict(self) -> dict[str, Any]:
        lat503, lat200 = self.latencies(503), self.latencies(200)
        return {"connections": self.connections, "sustainable": self.sustainable,
                "statuses": dict(self.tally.statuses), "no_answer": dict(self.tally.failures),
                "retry_after": dict(self.retry_after), "p50_503_ms": percentile_ms(lat503, 50),
                "p99_503_ms": percentile_ms(lat503, 99), "p50_200_ms": percentile_ms(lat200, 50),
                "p99_200_ms": percentile_ms(lat200, 99), "normal_p50_ms": self.normal_ms, "recovery_s": self.recovery_s}


OVERLOAD_GOAL = (f"10x sustainable concurrency: only 200s and 503s with Retry-After, 503 p99 <= {FAST_503_MS} ms, "
                 "normal latency again within 5 s")


async def overload(server: KilnServer, work: Workload, queue_inputs: int, seconds: float) -> ProbeResult:
    """10x the sustainable concurrency. Sustainable here: the requests of 8 texts the queue holds
    (``--max-queue-size`` inputs / 8) — more waiting requests than that get 503 by design."""
    started = time.monotonic()
    inputs = 8
    texts = [work.refs.texts[i] for i in work.short[:inputs]]
    indices = work.short[:inputs]
    raw = request_bytes("POST", f"/v2/models/{work.model}/predict", orjson.dumps({"inputs": texts}))
    flood = await Flood.run(server.port, raw, max(1, queue_inputs // inputs), seconds,
                            lambda s: sequential_latencies(server.port, work, s))
    # the 200s of the flood were 8 known texts: check them too (one reply's worth per request is enough)
    ok = await once(server.port, raw)
    check = work.refs.check(indices, ok.json()) if isinstance(ok, Reply) and ok.status == 200 else Check()
    passed = flood.passed and check.equal == check.answers == inputs
    return ProbeResult("overload", flood.requests, flood.outcome(f" x {inputs} texts"), OVERLOAD_GOAL, passed,
                       time.monotonic() - started, {**flood.as_dict(), "flood_answers_checked": check.as_dict()})


# --- SIGTERM under load ---------------------------------------------------------------------------


@dataclass
class Sent:
    at: float  # perf_counter when the request's bytes were in the kernel
    outcome: str  # "200" (checked equal), "200-differs", a status, "closed", "refused", "timeout"


async def logged_client(port: int, work: Workload, log: list[Sent], stop: asyncio.Event, seed: int) -> None:
    rng = random.Random(seed)
    conn = Conn(port)
    n = seed
    while not stop.is_set():
        n += 1
        indices, raw, route = work.next(rng, n)
        try:
            if conn.writer is None:
                await conn.open()
        except OSError:
            log.append(Sent(time.perf_counter(), "refused"))
            await asyncio.sleep(0.05)
            continue
        try:
            sent = await conn.send(raw)
        except (ConnectionError, OSError):
            log.append(Sent(time.perf_counter(), "closed"))
            conn.close()
            continue
        try:
            assert conn.reader is not None
            reply = await asyncio.wait_for(read_reply(conn.reader, sent), 60)
        except asyncio.TimeoutError:
            log.append(Sent(sent, "timeout"))
            conn.close()
            continue
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            log.append(Sent(sent, "closed"))
            conn.close()
            continue
        if reply.status == 200:
            c = work.check(indices, route, reply)
            log.append(Sent(sent, "200" if c.equal == c.answers else "200-differs"))
        else:
            log.append(Sent(sent, str(reply.status)))
        if reply.headers.get("connection", "").lower() == "close":
            conn.close()
    conn.close()


async def sigterm(server: KilnServer, work: Workload, clients: int, load_s: float) -> ProbeResult:
    """Load, then SIGTERM. Every request whose bytes were sent before the signal must be answered
    200 in full (and right); after it, new connections must be refused; the exit code must be 0."""
    started = time.monotonic()
    log: list[Sent] = []
    stop = asyncio.Event()
    tasks = [asyncio.create_task(logged_client(server.port, work, log, stop, seed)) for seed in range(clients)]
    await asyncio.sleep(load_s)
    term = await terminate(server)
    stop.set()
    await asyncio.gather(*tasks)
    signal_at, code, exit_s = term.signal_at, term.code, term.exit_s
    before = [s for s in log if s.at < signal_at]
    after = [s for s in log if s.at >= signal_at]
    lost = [s for s in before if not s.outcome.startswith("200")]  # no full 200 answer
    differs = sum(s.outcome == "200-differs" for s in before)  # answered, but not as the text alone
    after_outcomes = Counter(s.outcome for s in after)
    late_accepts, first_refusal = term.late_accepts, term.first_refusal_ms
    passed = not lost and not differs and code == 0 and not late_accepts and len(before) > 0
    outcome = (f"{len(before):,} requests sent before the signal: {len(before) - len(lost):,} answered 200 in full "
               f"({differs} differ from the text alone), {len(lost)} lost; after it: {dict(after_outcomes)}; new connections refused from "
               f"{first_refusal} ms; exit {code} in {exit_s:.2f} s")
    return ProbeResult("sigterm", len(log), outcome,
                       "every request sent before SIGTERM answered 200 in full; new connections refused; exit 0",
                       passed, time.monotonic() - started,
                       {"before_signal": len(before), "lost": len(lost), "differs": differs,
                        "lost_outcomes": dict(Counter(s.outcome for s in lost)),
                        "lost_sent_ms_before_signal": sorted(round((signal_at - s.at) * 1000, 1) for s in lost)[:20],
                        "after_signal": dict(after_outcomes), "exit_code": code, "exit_s": round(exit_s, 3),
                        **term.as_dict()})


# --- soak --------------------------------------------------------------------------------------------


async def soak(server: KilnServer, work: Workload, clients: int, seconds: float) -> ProbeResult:
    """Mixed load for ``seconds``. The first fifth is warm-up; resident memory and p99 are compared
    between the fifth after it and the last fifth."""
    started = time.monotonic()
    tally = Tally()
    end = started + seconds
    async with RssSampler(server) as rss:
        await run_clients(server.port, work, clients, tally, lambda: time.monotonic() >= end)
    flat = Flatness.of(rss.series, tally.latencies, started, seconds)
    passed = good_passed(tally) and flat.passed
    outcome = (f"{seconds / 60:.1f} min, {clients} clients, {tally.requests:,} requests ({work.long_share:.0%} SQuAD "
               f"paragraphs): {flat.outcome()}; {good_outcome(tally)}")
    return ProbeResult("soak", tally.requests, outcome,
                       "RSS growth after warm-up < 5%, last-window p99 <= 1.5x the first, every answer equal, 0 non-200",
                       passed, time.monotonic() - started,
                       {"clients": clients, "seconds": seconds, **flat.as_dict(), **tally.as_dict()})


class RssSampler:
    """The server's resident memory every 0.5 s while the ``async with`` body runs: ``series``
    of (time.monotonic(), MB)."""

    def __init__(self, server: KilnServer):
        self.server = server
        self.series: list[tuple[float, float]] = []
        self._task: asyncio.Task | None = None

    async def _sample(self) -> None:
        while True:
            value = self.server.rss_mb()
            if value is not None:
                self.series.append((time.monotonic(), value))
            await asyncio.sleep(0.5)

    async def __aenter__(self) -> RssSampler:
        self._task = asyncio.create_task(self._sample())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()


@dataclass
class Flatness:
    """A soak's memory and latency, the fifth after a fifth of warm-up against the last fifth."""

    rss_first: list[float]
    rss_last: list[float]
    rss_peak: float | None
    p99_first: float | None
    p99_last: float | None

    @classmethod
    def of(cls, rss: list[tuple[float, float]], latencies: list[tuple[float, float]], started: float,
           seconds: float) -> Flatness:
        fifth = seconds / 5
        first, last = (started + fifth, started + 2 * fifth), (started + 4 * fifth, started + 5 * fifth + 1)

        def window(series: list[tuple[float, float]], span: tuple[float, float]) -> list[float]:
            return [v for t, v in series if span[0] <= t < span[1]]

        return cls(window(rss, first), window(rss, last), max((v for _, v in rss), default=None),
                   percentile_ms(window(latencies, first), 99), percentile_ms(window(latencies, last), 99))

    @property
    def growth(self) -> float | None:
        if not self.rss_first or not self.rss_last:
            return None
        return (sum(self.rss_last) / len(self.rss_last)) / (sum(self.rss_first) / len(self.rss_first)) - 1

    @property
    def passed(self) -> bool:
        """RSS grows < 5% after warm-up; the last p99 is at most 1.5x the first."""
        ratio = self.p99_last / self.p99_first if self.p99_first and self.p99_last else None
        return self.growth is not None and self.growth < 0.05 and ratio is not None and ratio <= 1.5

    def outcome(self) -> str:
        mean = lambda values: sum(values) / max(1, len(values))  # noqa: E731
        growth = f"{self.growth:+.1%}" if self.growth is not None else "unknown"
        return (f"RSS {mean(self.rss_first):.0f} -> {mean(self.rss_last):.0f} MB ({growth} after warm-up); "
                f"p99 {self.p99_first} -> {self.p99_last} ms")

    def as_dict(self) -> dict[str, Any]:
        return {"rss_first_mb": self.rss_first and round(sum(self.rss_first) / len(self.rss_first), 1),
                "rss_last_mb": self.rss_last and round(sum(self.rss_last) / len(self.rss_last), 1),
                "rss_growth": None if self.growth is None else round(self.growth, 4), "rss_peak_mb": self.rss_peak,
                "p99_first_ms": self.p99_first, "p99_last_ms": self.p99_last}


@dataclass
class Termination:
    """SIGTERM sent at ``signal_at`` (perf_counter): how the server went, tried with a connect
    every 20 ms until it exited."""

    signal_at: float
    connects: list[tuple[float, str]]  # (seconds after the signal, "accepted" | "refused")
    exit_s: float
    code: int

    @property
    def late_accepts(self) -> list[float]:
        return [t for t, what in self.connects if what == "accepted" and t > 0.5]

    @property
    def first_refusal_ms(self) -> int | None:
        return next((round(t * 1000) for t, what in self.connects if what == "refused"), None)

    def as_dict(self) -> dict[str, Any]:
        return {"connect_attempts": dict(Counter(w for _, w in self.connects)),
                "first_refusal_ms": self.first_refusal_ms, "accepted_after_500ms": len(self.late_accepts)}


async def terminate(server: KilnServer) -> Termination:
    """SIGTERM, then new connections while it drains, until it exits."""
    signal_at = time.perf_counter()
    server.signal_term()
    connects: list[tuple[float, str]] = []
    while server.alive():
        try:
            _, w = await asyncio.open_connection("127.0.0.1", server.port)
            w.close()
            connects.append((time.perf_counter() - signal_at, "accepted"))
        except OSError:
            connects.append((time.perf_counter() - signal_at, "refused"))
        await asyncio.sleep(0.02)
    exit_s = time.perf_counter() - signal_at
    return Termination(signal_at, connects, exit_s, server.stop())
