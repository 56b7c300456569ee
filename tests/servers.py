"""Real servers for the tests: ``kiln serve`` on a free port (HTTP, and gRPC beside it), started as a
user starts it and stopped with SIGTERM, and the tiny encoder models every serving test loads."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from modelkiln.net import free_port

TASKS = {"cls": "text-classification", "emb": "sentence-embeddings", "ner": "token-classification",
         "qa": "question-answering"}


class Server:
    """``python -m modelkiln serve ...`` on a free port; waits until /v2/health/ready answers 200."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None, python_flags: tuple[str, ...] = (),
                 timeout: float = 60.0, cwd: Path | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.workers = int(args[args.index("--workers") + 1]) if "--workers" in args else 1
        full_env = {**os.environ, "KILN_THREADS": "1", "KILN_PORT": str(self.port), **(env or {})}
        self.proc = subprocess.Popen([sys.executable, *python_flags, "-m", "modelkiln", "serve", *args],
                                     env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}: {self.proc.stderr.read()[-3000:]}")
            try:
                if httpx.get(self.url + "/v2/health/ready", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("server did not become ready")
            time.sleep(0.05)

    def stop(self) -> tuple[int, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            _, err = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        return self.proc.returncode, err


class GrpcServer(Server):
    def __init__(self, args: list[str], **kwargs):
        self.grpc_port = free_port()
        super().__init__([*args, "--grpc-port", str(self.grpc_port)], **kwargs)
        self.grpc_url = f"127.0.0.1:{self.grpc_port}"


def sse_events(response: httpx.Response) -> list[str]:
    """The ``data:`` payloads of an SSE response, checking the framing (blank line after each)."""
    events, lines = [], list(response.iter_lines())
    for i, line in enumerate(lines):
        if line.startswith("data: "):
            assert i + 1 < len(lines) and lines[i + 1] == "", f"event not followed by a blank line: {line!r}"
            events.append(line[len("data: "):])
        else:
            assert line == "", f"unexpected SSE line {line!r}"
    return events
