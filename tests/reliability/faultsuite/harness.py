"""What every probe needs: the server under test, a raw HTTP/1.1 client, /metrics, and the
reference answers that every answer is checked against."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from modelkiln.net import child_environment, free_port, stop_child, wait_until_ready
from modelkiln.tune.sweep import server_memory_mb

SRC = Path(__file__).resolve().parents[3] / "src"
API_KEY = "faultsuite-key"
AUTH = f"Bearer {API_KEY}"

# ``kiln serve``'s own entry point, started behind two watches that change nothing else: any
# unpickling (pickle.load/loads/Unpickler, and the ``pickle.find_class`` audit event) prints a
# marker line to stderr, so the security probe can say that none happened while the artifact
# was loaded and served.
LAUNCHER = """
import pickle, sys
def _report(what):
    sys.stderr.write("FAULTSUITE-PICKLE " + what + "\\n")
    sys.stderr.flush()
sys.addaudithook(lambda event, args: _report(event + " " + repr(args[:2])) if event == "pickle.find_class" else None)
for _name in ("load", "loads"):
    def _watched(*a, _orig=getattr(pickle, _name), _name=_name, **k):
        _report(_name)
        return _orig(*a, **k)
    setattr(pickle, _name, _watched)
class _Unpickler(pickle.Unpickler):
    def __init__(self, *a, **k):
        _report("Unpickler")
        super().__init__(*a, **k)
pickle.Unpickler = _Unpickler
sys.argv[0] = "kiln"
from modelkiln.cli import main
main()
"""
PICKLE_MARK = "FAULTSUITE-PICKLE"


class KilnServer:
    """``kiln serve NAME=ARTIFACT [args]`` on a free loopback port, with the API key set and the
    bind address left at its default (the security probe checks what that is). Output goes to a
    log file the probes read (tracebacks, pickle markers)."""

    def __init__(self, artifact: Path, name: str, args: list[str], timeout: float = 180.0):
        self.name = name
        self.port = free_port()
        self.log_path = Path(tempfile.mkstemp(prefix="faultsuite-serve-", suffix=".log")[1])
        env = child_environment(KILN_API_KEY=API_KEY)
        # the server of this checkout, not whatever modelkiln the interpreter would import
        env["PYTHONPATH"] = os.pathsep.join([str(SRC), *filter(None, [env.get("PYTHONPATH")])])
        command = [sys.executable, "-c", LAUNCHER, "serve", f"{name}={artifact}", "--port", str(self.port),
                   "--grpc-port", "0", "--log-level", "warning", *args]
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.started = time.monotonic()
        wait_until_ready(self.proc, f"http://127.0.0.1:{self.port}", timeout, "kiln serve",
                         lambda: self.log()[-3000:], self.stop)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def rss_mb(self) -> float | None:
        return server_memory_mb(self.proc.pid, "VmRSS")  # with --workers N, the workers' too

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def signal_term(self) -> float:
        """Send SIGTERM; returns the monotonic time it was sent."""
        sent = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        return sent

    def stop(self, timeout: float = 60.0) -> int:
        returncode = stop_child(self.proc, timeout)
        self._log.close()
        return returncode


# --- a raw HTTP/1.1 client ------------------------------------------------------------------------


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes
    seconds: float  # from the request's last byte written to the reply's last byte read

    def json(self) -> Any:
        return orjson.loads(self.body)


# Every error body any probe receives, for the security probe's "no stack traces or paths" check.
ERROR_BODIES: list[bytes] = []


def request_bytes(method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None,
                  auth: str | None = AUTH) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"]
    given = {k.lower() for k in (headers or {})}
    if auth is not None and "authorization" not in given:
        lines.append(f"Authorization: {auth}")
    if not given & {"content-length", "transfer-encoding"} and (body or method in ("POST", "PUT", "PATCH")):
        lines.append(f"Content-Length: {len(body)}")
    if body and "content-type" not in given:
        lines.append("Content-Type: application/json")
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


async def read_reply(reader: asyncio.StreamReader, started: float) -> Reply:
    head = await reader.readuntil(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in header_lines:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding", "").lower() == "chunked":
        body = b""
        while size := int((await reader.readuntil(b"\r\n")).strip(), 16):
            body += (await reader.readexactly(size + 2))[:-2]
        await reader.readuntil(b"\r\n")
    else:
        body = await reader.read()
    reply = Reply(int(status_line.split(" ", 2)[1]), headers, body, time.perf_counter() - started)
    if reply.status >= 400:
        ERROR_BODIES.append(body)
    return reply


class Conn:
    """One keep-alive connection; ``call`` sends a request and reads its reply."""

    def __init__(self, port: int):
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> Conn:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        return self

    async def send(self, raw: bytes) -> float:
        """Write a request; returns when its bytes are handed to the kernel (perf_counter)."""
        if self.writer is None:
            await self.open()
        assert self.writer is not None
        self.writer.write(raw)
        await self.writer.drain()
        return time.perf_counter()

    async def call(self, raw: bytes, timeout: float = 60.0) -> Reply:
        started = await self.send(raw)
        assert self.reader is not None
        reply = await asyncio.wait_for(read_reply(self.reader, started), timeout)
        if reply.headers.get("connection", "").lower() == "close":
            self.close()
        return reply

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


async def once(port: int, raw: bytes, timeout: float = 60.0) -> Reply | str:
    """Send ``raw`` on a fresh connection: the reply, or what happened instead ("closed" without
    an answer, "timeout", "refused")."""
    conn = Conn(port)
    try:
        await conn.open()
    except OSError:
        return "refused"
    try:
        return await conn.call(raw, timeout)
    except asyncio.TimeoutError:
        return "timeout"
    except (asyncio.IncompleteReadError, ConnectionError):
        return "closed"
    finally:
        conn.close()


async def metrics(port: int) -> dict[str, float]:
    """/metrics as {series (with labels): value}."""
    reply = await once(port, request_bytes("GET", "/metrics"), 30)
    assert isinstance(reply, Reply) and reply.status == 200, reply
    values = {}
    for line in reply.body.decode().splitlines():
        if line and not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            values[series] = float(value)
    return values


async def wait_idle(port: int, model: str, timeout: float, gauges: tuple[str, ...] = ('kiln_queue_inputs{{model="{}"}}',)
                    ) -> tuple[bool, float, dict[str, float]]:
    """Poll /metrics until the ``gauges`` (series, ``{}`` for the model's name) are 0 and the only
    request in flight is the poll itself: (went idle, seconds it took, the last values)."""
    started = time.monotonic()
    values: dict[str, float] = {}
    series = [g.format(model) for g in gauges]
    while time.monotonic() - started < timeout:
        values = await metrics(port)
        if values.get("kiln_requests_in_flight") == 1 and all(values.get(s, 0) == 0 for s in series):
            return True, time.monotonic() - started, values
        await asyncio.sleep(0.05)
    return False, time.monotonic() - started, values


# --- texts and reference answers --------------------------------------------------------------------

EQUAL_COSINE = 0.99999  # "the same answer": issue 15's bar for batch invariance


def load_texts(short_limit: int | None) -> tuple[list[str], list[str]]:
    """(short texts: STS-B sentences and SQuAD questions, long texts: SQuAD paragraphs), real data
    read packaged with modelkiln; ``short_limit`` keeps the first N short ones."""
    from modelkiln.data import read_squad, sts_sentences

    paragraphs, questions = read_squad()
    short = list(dict.fromkeys([*sts_sentences(), *(q.question for q in questions)]))
    return (short[:short_limit] if short_limit else short), paragraphs


@dataclass
class Check:
    """Answers checked against the references: how many, how many equal to the text's own answer
    alone, how many closer to another text's answer than to their own (misrouted)."""

    answers: int = 0
    equal: int = 0
    misrouted: int = 0
    min_cosine: float = 1.0

    def add(self, other: Check) -> None:
        self.answers += other.answers
        self.equal += other.equal
        self.misrouted += other.misrouted
        self.min_cosine = min(self.min_cosine, other.min_cosine)

    def as_dict(self) -> dict[str, Any]:
        return {"answers": self.answers, "equal": self.equal, "differs": self.answers - self.equal,
                "misrouted": self.misrouted, "min_cosine": round(self.min_cosine, 6)}


@dataclass
class References:
    """Each text's answer taken alone (one text per request, one request at a time, on an idle
    server), unit-normalised. Texts whose answers are nearly the same as another's are dropped, so
    that a swapped answer cannot pass for the right one."""

    texts: list[str]
    vectors: np.ndarray
    dropped: int = 0
    index: dict[str, int] = field(default_factory=dict)

    @classmethod
    async def build(cls, port: int, model: str, texts: list[str], distinct_below: float = 0.999) -> References:
        conn = await Conn(port).open()
        vectors = []
        for text in texts:
            reply = await conn.call(request_bytes("POST", f"/v2/models/{model}/predict", orjson.dumps({"inputs": text})))
            if reply.status != 200:
                raise RuntimeError(f"reference for {text[:40]!r}: {reply.status} {reply.body[:200]!r}")
            vectors.append(reply.json())
        conn.close()
        matrix = np.asarray(vectors, dtype=np.float32)
        if matrix.ndim != 2:
            raise RuntimeError("the misrouting check needs a sentence-embeddings model (one vector per text)")
        matrix /= np.linalg.norm(matrix, axis=1, keepdims=True)
        keep: list[int] = []
        for i in range(len(texts)):  # greedy: keep a text unless its answer is nearly a kept one's
            if not keep or float(np.max(matrix[keep] @ matrix[i])) < distinct_below:
                keep.append(i)
        refs = cls([texts[i] for i in keep], matrix[keep], dropped=len(texts) - len(keep))
        refs.index = {t: i for i, t in enumerate(refs.texts)}
        return refs

    def check(self, indices: list[int], answers: Any) -> Check:
        got = np.asarray(answers, dtype=np.float32).reshape(len(indices), -1)
        got /= np.maximum(np.linalg.norm(got, axis=1, keepdims=True), 1e-12)
        own = np.einsum("ij,ij->i", got, self.vectors[indices])
        result = Check(answers=len(indices), equal=int(np.sum(own >= EQUAL_COSINE)), min_cosine=float(own.min()))
        for row in np.nonzero(own < EQUAL_COSINE)[0]:  # not the same: is another text's answer closer?
            if int(np.argmax(self.vectors @ got[row])) != indices[row] and float(np.max(self.vectors @ got[row])) > own[row]:
                result.misrouted += 1
        return result


# --- what a probe reports ------------------------------------------------------------------------------


@dataclass
class ProbeResult:
    name: str
    count: int  # requests (or cases) the probe sent
    outcome: str  # one line, in numbers
    goal: str
    passed: bool
    seconds: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)


def percentile_ms(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(np.asarray(values) * 1000, q)), 1) if values else None


# A trace or a server path in an error body. (Not backslashes: JSON escapes the control characters a
# fuzzed body echoes back, which a Windows-path pattern mistook for a path in the first full run.)
LEAK_PATTERNS = re.compile(r'Traceback|File "|site-packages|\.py\b|/home/|/work/|/tmp/|/usr/|/root/')
