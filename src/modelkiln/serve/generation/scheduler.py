"""Continuous batching for ``kiln serve``: one thread steps the engine core
(``generation/core.py``: admission, chunked prefill, decode, all scheduling rules live there), and
requests join and leave between steps (iteration-level scheduling, as in Orca, vLLM and TGI).

This module only carries requests across the thread boundary: ``submit`` and ``cancel`` come from
the event loop; each step's outputs go back to their requests' event loops with one
``call_soon_threadsafe`` per loop and step (not one per token)."""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from ...errors import KilnError, ModelNotReadyError
from ...generation.core import CoreHooks, EngineCore, Output, Request

log = logging.getLogger("modelkiln.serve")


@dataclass(eq=False)
class Job(Request):
    """A request whose outputs go to an ``asyncio.Queue`` of ``loop``: a ``Delta`` per token (the last
    one has a ``finish_reason``), or a ``KilnError`` that ends it."""

    loop: asyncio.AbstractEventLoop | None = field(default=None, kw_only=True)
    queue: asyncio.Queue | None = field(default=None, kw_only=True)


class Scheduler:
    def __init__(self, core: EngineCore, name: str = "generation"):
        self.core = core
        self.name = name
        self._wake = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    @property
    def engine(self) -> Any:
        return self.core.engine

    # -- called from the event loop ----------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"kiln-generate-{self.name}", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue a job; refused at once (typed error) when it could never fit or the queue is full."""
        with self._wake:
            if self._stopping:
                raise ModelNotReadyError(f"model '{self.name}' is shutting down")
            self.core.add_request(job)
            self._wake.notify()

    def cancel(self, job: Job) -> None:
        """The job's client is gone: free its sequence before the next step."""
        with self._wake:
            self.core.abort(job.request_id)
            self._wake.notify()

    @property
    def waiting(self) -> int:
        return self.core.waiting

    @property
    def running(self) -> int:
        return self.core.running

    def stop(self, timeout: float | None = None) -> None:
        """Refuse new jobs, finish the accepted ones, then end the thread."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # -- the scheduler thread --------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._wake:
                while not self.core.has_work():
                    if self._stopping:
                        return
                    self._wake.wait()
            try:
                for part in self.core.step_parts():  # first tokens go out before the decode step
                    _deliver(part)
            except Exception as exc:  # noqa: BLE001 - the core fails its own requests; this is a bug in it
                log.exception("generation step failed for model %s", self.name)
                _deliver(self.core.fail_all(KilnError(f"generation failed ({type(exc).__name__})")))


def _deliver(outputs: list[Output]) -> None:
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
    for output in outputs:
        job = output.request
        assert isinstance(job, Job) and job.loop is not None
        by_loop.setdefault(job.loop, []).append((job.queue, output.error or output.delta))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the loop is closed (a test, or shutdown): nobody is listening
            pass


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, event in items:
        queue.put_nowait(event)


__all__ = ["CoreHooks", "Job", "Scheduler"]
