"""The fault suite's generation mode, its probes about many good clients: answers under load
(misrouting), overload, soak, SIGTERM. Every request is greedy and streamed through kiln
loadtest's streaming client (``modelkiln.loadtest.streaming``), in turn on OpenAI chat, OpenAI
completions and Triton's generate_stream, and every answer is checked against the answer its
prompt gets alone on the same route (``Answers``): same text, same prompt and completion tokens."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import orjson

from modelkiln.loadtest.check import GenerationChecker
from modelkiln.loadtest.client import render_request
from modelkiln.loadtest.records import StreamRecord
from modelkiln.loadtest.streaming import GenerationRequest, StreamConnection, reference

from .harness import AUTH, Conn, KilnServer, ProbeResult, percentile_ms
from .load import OVERLOAD_GOAL, Flatness, Flood, Lone, RssSampler, terminate

PROTOCOLS = ("openai-chat", "openai-completions", "generate")
HOST = "127.0.0.1"
STREAM_TIMEOUT_S = 120.0


def squad_prompt(paragraph: str, question: str) -> str:
    return f"{paragraph}\n\nQuestion: {question}"


@dataclass
class Answers:
    """Every (prompt, route) pair as a ready request, its answer alone (``GenerationChecker``'s
    references) and which prompt each answer text belongs to, for telling a misrouted answer (the
    answer another prompt gets alone) from one that merely differs."""

    port: int
    model: str
    max_tokens: int
    raws: list[bytes]
    protocols: list[str]
    prompts: list[str]
    long: list[bool]
    checker: GenerationChecker
    owner: dict[tuple[str, str], int]  # (route, answer text alone) -> request index
    dropped: int = 0

    @classmethod
    async def build(cls, port: int, model: str, short: list[str], long: list[str], max_tokens: int) -> Answers:
        """Each prompt on each route, alone, one at a time on the idle server. A prompt whose answer
        on some route is another prompt's answer there is dropped (a swapped answer could pass)."""
        raws, protocols, prompts, long_flags, records = [], [], [], [], []
        seen: dict[tuple[str, str], int] = {}
        dropped = 0
        for text in short + long:
            mine = []
            for protocol in PROTOCOLS:
                raw = request_raw(port, protocol, model, text, max_tokens)
                status, record = await reference(HOST, port, raw, protocol, STREAM_TIMEOUT_S)
                if status != 200 or not record.complete:
                    raise RuntimeError(f"reference for {text[:40]!r} on {protocol}: {status} {record.error}")
                mine.append((protocol, raw, record))
            if any((p, r.text) in seen for p, _, r in mine):
                dropped += 1
                continue
            for protocol, raw, record in mine:
                seen[(protocol, record.text)] = len(raws)
                raws.append(raw)
                protocols.append(protocol)
                prompts.append(text)
                long_flags.append(text in long)
                records.append(record)
        return cls(port, model, max_tokens, raws, protocols, prompts, long_flags, GenerationChecker(records), seen,
                   dropped)

    def pick(self, rng: random.Random, long_share: float) -> int:
        """A request index: one with a long prompt with probability ``long_share``."""
        want_long = any(self.long) and rng.random() < long_share
        while True:
            k = rng.randrange(len(self.raws))
            if self.long[k] == want_long or not any(self.long):
                return k

    def verdict(self, k: int, status: int, record: StreamRecord) -> str:
        """"equal", "misrouted" (another prompt's answer alone), "differs", "incomplete" or the status."""
        if status != 200:
            return str(status)
        if not record.complete:
            return "incomplete"
        if self.checker.verify_stream(k, record) is None:
            return "equal"
        other = self.owner.get((self.protocols[k], record.text))
        return "misrouted" if other is not None and other != k else "differs"

    def reference_text(self, k: int) -> str:
        return self.checker.references[k].text


def request_raw(port: int, protocol: str, model: str, prompt: str, max_tokens: int, stream: bool = True) -> bytes:
    """The request's bytes, with the API key: streamed as kiln loadtest sends it, or (OpenAI chat
    only) as a whole answer."""
    prepared = GenerationRequest(protocol, model, max_tokens).build(prompt)
    body = prepared.body
    if not stream:
        data = orjson.loads(body)
        data.pop("stream_options", None)
        body = orjson.dumps({**data, "stream": False})
    return render_request("POST", HOST, port, prepared.path, body, (*prepared.headers, ("Authorization", AUTH)))


@dataclass
class StreamTally:
    """What streaming clients saw: statuses, verdicts, latencies (finished at, seconds), connection failures."""

    verdicts: Counter = field(default_factory=Counter)
    latencies: list[tuple[float, float]] = field(default_factory=list)
    failures: Counter = field(default_factory=Counter)

    @property
    def requests(self) -> int:
        return sum(self.verdicts.values()) + sum(self.failures.values())

    @property
    def answers(self) -> int:
        return self.verdicts["equal"] + self.verdicts["differs"] + self.verdicts["misrouted"]

    def passed(self) -> bool:
        return self.answers > 0 and self.verdicts["equal"] == self.requests

    def outcome(self) -> str:
        other = {**{k: v for k, v in self.verdicts.items() if k not in ("equal", "differs", "misrouted")},
                 **self.failures}
        return (f"{self.verdicts['misrouted']} misrouted of {self.answers:,} answers; {self.verdicts['differs']} differ "
                f"from the prompt alone; {sum(other.values())} not a complete 200" + (f" ({other})" if other else ""))

    def as_dict(self) -> dict[str, Any]:
        seconds = [s for _, s in self.latencies]
        return {"requests": self.requests, "answers": self.answers, "verdicts": dict(self.verdicts),
                "no_answer": dict(self.failures), "p50_ms": percentile_ms(seconds, 50),
                "p99_ms": percentile_ms(seconds, 99)}


async def stream_client(answers: Answers, tally: StreamTally, until: Any, seed: int, long_share: float) -> None:
    """One client on one keep-alive connection, greedy streams back to back until ``until()``."""
    rng = random.Random(seed)
    conn: StreamConnection | None = None
    while not until():
        k = answers.pick(rng, long_share)
        record = StreamRecord(answers.protocols[k])
        started = time.perf_counter()
        try:
            if conn is None or conn.closed:
                conn = await StreamConnection.open(HOST, answers.port)
            status = await conn.stream(answers.raws[k], record, STREAM_TIMEOUT_S)
        except (ConnectionError, TimeoutError, OSError) as exc:
            tally.failures[type(exc).__name__] += 1
            if conn is not None:
                conn.abort()
            conn = None
            await asyncio.sleep(0.01)
            continue
        tally.verdicts[answers.verdict(k, status, record)] += 1
        tally.latencies.append((time.monotonic(), time.perf_counter() - started))
    if conn is not None:
        conn.abort()


async def run_streams(answers: Answers, clients: int, tally: StreamTally, until: Any, long_share: float = 0.0) -> None:
    await asyncio.gather(*(stream_client(answers, tally, until, seed, long_share) for seed in range(clients)))


class GoodStreams:
    """Streaming clients next to an attack (``hostile.Alongside``)."""

    def __init__(self, answers: Answers, clients: int):
        self.answers, self.clients = answers, clients
        self.tally = StreamTally()

    async def run(self, until: Any) -> None:
        await run_streams(self.answers, self.clients, self.tally, until)

    def outcome(self) -> str:
        return self.tally.outcome()

    def passed(self) -> bool:
        return self.tally.passed()

    def as_dict(self) -> dict[str, Any]:
        return self.tally.as_dict()

    @property
    def requests(self) -> int:
        return self.tally.requests


# --- answers under load --------------------------------------------------------------------------


async def misrouting(answers: Answers, count: int, clients: int) -> ProbeResult:
    started = time.monotonic()
    tally = StreamTally()
    await run_streams(answers, clients, tally, lambda: tally.answers >= count, long_share=0.2)
    return ProbeResult("misrouting", tally.requests, tally.outcome(),
                       f"0 misrouted of >= {count:,} greedy streamed answers from {clients} concurrent clients "
                       "(20% long prompts), each the text and token counts its prompt gets alone on its route, "
                       "0 not a complete 200", tally.passed(), time.monotonic() - started,
                       {"clients": clients, "requests_distinct": len(answers.raws), **tally.as_dict()})


# --- overload --------------------------------------------------------------------------------------


async def whole_answers(port: int, raw: bytes, seconds: float) -> Lone:
    """One client sending ``raw`` (a whole-answer request) back to back for ``seconds``."""
    out: Lone = []
    conn = Conn(port)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sent = time.monotonic()
        reply = await conn.call(raw)
        out.append((sent, reply.seconds, reply.status, reply.body))
    conn.close()
    return out


async def overload(server: KilnServer, answers: Answers, sustainable: int, seconds: float) -> ProbeResult:
    """10x the sustainable concurrency (sequences running + requests the queue holds), each
    connection sending a whole-answer chat request back to back; the lone client's answers checked."""
    started = time.monotonic()
    k = answers.protocols.index("openai-chat")
    raw = request_raw(server.port, "openai-chat", answers.model, answers.prompts[k], answers.max_tokens, stream=False)
    flood = await Flood.run(server.port, raw, sustainable, seconds, lambda s: whole_answers(server.port, raw, s))
    texts = [orjson.loads(body)["choices"][0]["message"]["content"]
             for _, _, status, body in flood.before + flood.after if status == 200]
    wrong = sum(t != answers.reference_text(k) for t in texts)
    outcome = f"{flood.outcome()}; {wrong} of {len(texts)} answers before and after differ from alone"
    return ProbeResult("overload", flood.requests, outcome, OVERLOAD_GOAL + ", answers equal",
                       flood.passed and bool(texts) and not wrong, time.monotonic() - started,
                       {**flood.as_dict(), "answers_checked": len(texts), "answers_wrong": wrong})


# --- soak --------------------------------------------------------------------------------------------


async def soak(server: KilnServer, answers: Answers, clients: int, seconds: float) -> ProbeResult:
    """Streams for ``seconds``, 20% long prompts. The first fifth is warm-up; resident memory and
    p99 are compared between the fifth after it and the last fifth."""
    started = time.monotonic()
    tally = StreamTally()
    end = started + seconds
    async with RssSampler(server) as rss:
        await run_streams(answers, clients, tally, lambda: time.monotonic() >= end, long_share=0.2)
    flat = Flatness.of(rss.series, tally.latencies, started, seconds)
    outcome = (f"{seconds / 60:.1f} min, {clients} streaming clients, {tally.requests:,} requests (20% SQuAD "
               f"paragraphs): {flat.outcome()}; {tally.outcome()}")
    return ProbeResult("soak", tally.requests, outcome,
                       "RSS growth after warm-up < 5%, last-window p99 <= 1.5x the first, every answer equal, "
                       "all complete 200s", tally.passed() and flat.passed, time.monotonic() - started,
                       {"clients": clients, "seconds": seconds, **flat.as_dict(), **tally.as_dict()})


# --- SIGTERM ------------------------------------------------------------------------------------------


async def sigterm(server: KilnServer, answers: Answers, clients: int, load_s: float) -> ProbeResult:
    """Streams, then SIGTERM. Every stream sent before the signal must end complete and equal to
    its answer alone; after it, new connections must be refused; the exit code must be 0."""
    started = time.monotonic()
    log: list[tuple[float, str]] = []  # (sent at, outcome)
    stop = asyncio.Event()

    async def client(seed: int) -> None:
        rng = random.Random(seed)
        conn: StreamConnection | None = None
        while not stop.is_set():
            k = answers.pick(rng, 0.0)
            record = StreamRecord(answers.protocols[k])
            try:
                if conn is None or conn.closed:
                    conn = await StreamConnection.open(HOST, server.port)
            except OSError:
                log.append((time.perf_counter(), "refused"))
                await asyncio.sleep(0.05)
                continue
            sent = time.perf_counter()  # stream() writes the request before its first await
            try:
                status = await conn.stream(answers.raws[k], record, STREAM_TIMEOUT_S)
            except (ConnectionError, TimeoutError, OSError):
                log.append((sent, "incomplete" if record.token_times else "closed"))
                conn.abort()
                conn = None
                continue
            log.append((sent, answers.verdict(k, status, record)))
        if conn is not None:
            conn.abort()

    tasks = [asyncio.create_task(client(seed)) for seed in range(clients)]
    await asyncio.sleep(load_s)
    term = await terminate(server)
    stop.set()
    await asyncio.gather(*tasks)
    signal_at = term.signal_at
    before = [outcome for at, outcome in log if at < signal_at]
    after = Counter(outcome for at, outcome in log if at >= signal_at)
    lost = Counter(o for o in before if o != "equal")
    passed = not lost and term.code == 0 and not term.late_accepts and len(before) > 0
    outcome = (f"{len(before):,} streams sent before the signal: {len(before) - sum(lost.values()):,} ended complete and "
               f"equal to alone, {sum(lost.values())} not ({dict(lost) or 0}); after it: {dict(after)}; new connections "
               f"refused from {term.first_refusal_ms} ms; exit {term.code} in {term.exit_s:.2f} s")
    return ProbeResult("sigterm", len(log), outcome,
                       "every stream sent before SIGTERM ends complete and equal to alone; new connections refused; "
                       "exit 0", passed, time.monotonic() - started,
                       {"before_signal": len(before), "lost": sum(lost.values()), "lost_outcomes": dict(lost),
                        "after_signal": dict(after), "exit_code": term.code, "exit_s": round(term.exit_s, 3),
                        **term.as_dict()})
