"""The one thread that steps an engine core for a server: ``kiln serve`` (serve/generation/
loop_driver.py hands each step's outputs to the requests' event loops) and the Triton model (it sends
them through Triton's response senders). Requests join and leave between steps (iteration-level
scheduling, as in Orca, vLLM and TGI); every scheduling rule lives in the core.

``submit`` and ``cancel`` come from any thread. Each step's outputs go to ``deliver`` in two parts
(first tokens before the decode step: ``EngineCore.step_parts``). ``stop`` refuses new requests,
lets the accepted ones finish (each still bounded by its deadline), then ends the thread."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable

from ..errors import KilnError, ModelNotReadyError
from .core import EngineCore, Output, Request

log = logging.getLogger("modelkiln.generation")


class CoreDriver:
    def __init__(self, core: EngineCore, deliver: Callable[[list[Output]], None], name: str = "generation"):
        self.core = core
        self.deliver = deliver
        self.name = name
        self._wake = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"kiln-generate-{self.name}", daemon=True)
        self._thread.start()

    def submit(self, request: Request) -> None:
        """Queue a request; refused at once (typed error) when it could never fit, the queue is full
        or the driver is stopping."""
        with self._wake:
            if self._stopping:
                raise ModelNotReadyError(f"model '{self.name}' is shutting down")
            self.core.add_request(request)
            self._wake.notify()

    def cancel(self, request_id: Hashable) -> None:
        """The request's client is gone: its sequence is freed before the next step."""
        with self._wake:
            self.core.abort(request_id)
            self._wake.notify()

    @property
    def waiting(self) -> int:
        return self.core.waiting

    @property
    def running(self) -> int:
        return self.core.running

    def stop(self, timeout: float | None = None) -> None:
        """Refuse new requests, finish the accepted ones, then end the thread."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self.core.has_work():
                    if self._stopping:
                        return
                    self._wake.wait()
            try:
                for part in self.core.step_parts():  # first tokens go out before the decode step
                    self._deliver(part)
            except Exception as exc:  # noqa: BLE001 - the core fails its own requests; this is a bug in it
                log.exception("generation step failed for model %s", self.name)
                self._deliver(self.core.fail_all(KilnError(f"generation failed ({type(exc).__name__})")))

    def _deliver(self, outputs: list[Output]) -> None:
        if not outputs:
            return
        try:
            self.deliver(outputs)
        except Exception:  # noqa: BLE001 - a delivery bug must not end the thread that serves every request
            log.exception("delivering generation outputs failed for model %s", self.name)
