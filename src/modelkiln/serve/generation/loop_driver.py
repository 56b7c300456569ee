"""Continuous batching for ``kiln serve``: ``generation/driver.py``'s thread steps the engine core,
and this module carries requests across the thread boundary: ``submit`` and ``cancel`` come from
the event loop; each step's outputs go back to their requests' event loops with one
``call_soon_threadsafe`` per loop and step (not one per token)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from ...generation.core import CoreHooks, EngineCore, Output, Request
from ...generation.driver import CoreDriver


@dataclass(eq=False)
class Job(Request):
    """A request whose outputs go to an ``asyncio.Queue`` of ``loop``: a ``Delta`` per token (the
    last one has a ``finish_reason``), or a ``KilnError`` that ends it."""

    loop: asyncio.AbstractEventLoop | None = field(default=None, kw_only=True)
    queue: Any = field(default=None, kw_only=True)  # an asyncio.Queue, or anything with its put_nowait
    driver: LoopDriver | None = field(default=None, kw_only=True)  # the engine replica it runs on


class LoopDriver(CoreDriver):
    def __init__(self, core: EngineCore, name: str = "generation"):
        super().__init__(core, _deliver, name)

    @property
    def engine(self) -> Any:
        return self.core.engine

    def cancel(self, job: Job) -> None:  # type: ignore[override]  # by Job: its holders never cancel by request id
        super().cancel(job.request_id)


def _deliver(outputs: list[Output]) -> None:
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
    for output in outputs:
        job = output.request
        assert isinstance(job, Job) and job.loop is not None and job.queue is not None
        by_loop.setdefault(job.loop, []).append((job.queue, output.error or output.delta))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the loop is closed (a test, or shutdown): nobody is listening
            pass


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, event in items:
        queue.put_nowait(event)


__all__ = ["CoreHooks", "Job", "LoopDriver"]
