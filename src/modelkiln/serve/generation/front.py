"""A text-generation model served by a worker whose engine runs in the engine process
(``engine_process.py``): ``kiln serve --workers N``.

``FrontGenerationModel`` is an ``EnginelessGenerationModel``, as kiln ray's router's is: prompts,
chat templates, settings and their checks are the worker's own, on the artifact's tokenizer. ``generate`` returns a ``FrontStream``: the request goes to the engine process over this
worker's one connection to it (``EngineLink``), and the answer's deltas come back, a step's worth
at a time."""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
from collections.abc import Sequence
from typing import Any

from ...errors import KilnError, ModelNotReadyError
from ...generation.sampling import SamplingParams
from ...generation.sequence import Delta
from ...native import variant_matrix_engine
from ..metrics import Metrics
from ..settings import ModelSpec, ServeSettings
from .engine_process import event_from_wire, frame, params_to_wire, read_frame
from .model import EnginelessGenerationModel, OpenStream

log = logging.getLogger("modelkiln.serve")

_keys = itertools.count(1)


class EngineLink:
    """This worker's connection to the engine process: requests out, each answer's events to its
    stream's queue. Opened at the first request; when it breaks, every open answer ends with an error."""

    def __init__(self, address: str):
        self.address = address
        self.queues: dict[int, asyncio.Queue] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._opening: asyncio.Task | None = None
        self._pending: list[bytes] = []  # frames sent before the connection was open

    def send(self, message: Any) -> None:
        data = frame(message)
        if self._writer is not None:
            self._writer.write(data)
            return
        self._pending.append(data)
        if self._opening is None:
            self._opening = asyncio.ensure_future(self._open())

    async def _open(self) -> None:
        try:
            reader, self._writer = await asyncio.open_unix_connection(self.address)
        except OSError as exc:
            self._opening = None
            self._fail(ModelNotReadyError(f"the engine process is not reachable ({exc.strerror})"))
            return
        self._writer.writelines(self._pending)
        self._pending.clear()
        try:
            while True:
                _, events = await read_frame(reader)
                for key, event in events:
                    queue = self.queues.get(key)
                    if queue is not None:
                        queue.put_nowait(event_from_wire(event))
        except (asyncio.IncompleteReadError, ConnectionError):
            log.error("the engine process closed its connection")
        self._writer = None
        self._opening = None
        self._fail(ModelNotReadyError("the engine process is gone"))

    def _fail(self, error: KilnError) -> None:
        self._pending.clear()
        for queue in self.queues.values():
            queue.put_nowait(error)


class FrontGenerationModel(EnginelessGenerationModel):
    def __init__(self, spec: ModelSpec, settings: ServeSettings, metrics: Metrics, address: str):
        super().__init__(spec, settings, metrics)  # the artifact's tokenizer and chat template, no engine
        self.address = address
        self._link: EngineLink | None = None

    def load(self) -> None:
        super().load()
        v = self.variant  # the engine process runs on this host, in this environment (KILN_AMX): the same unit
        self.matrix_engine = variant_matrix_engine(v.details, v.precision, v.device)

    @property
    def link(self) -> EngineLink:
        if self._link is None:
            self._link = EngineLink(self.address)
        return self._link

    def generate(self, prompt_ids: list[int], params: SamplingParams, timeout_s: float | None = None,
                 resume_ids: Sequence[int] = (), seed: int | None = None) -> FrontStream:
        """The answer's stream; its seed chosen here when the request has none (the stream tells it at once)."""
        if params.seed is not None:
            seed = params.seed
        elif seed is None:
            seed = secrets.randbits(63)
        return FrontStream(self, prompt_ids, params, seed, list(resume_ids), timeout_s or self.settings.generation_timeout_s)


class FrontStream(OpenStream):
    """One request's deltas from the engine process (the interface of ``model.Stream``). ``aclose``
    before the end cancels it there."""

    def __init__(self, model: FrontGenerationModel, prompt_ids: list[int], params: SamplingParams, seed: int,
                 resume_ids: list[int], timeout_s: float):
        self.model = model
        self.seed = seed
        self.prompt_tokens = len(prompt_ids)
        self.completion_tokens = len(resume_ids)  # a resumed answer's usage counts the whole answer
        self.finish_reason: str | None = None
        self._resumed = bool(resume_ids)
        self._accepted = False
        self._queue: asyncio.Queue = asyncio.Queue()
        self._key = next(_keys)
        self._open = True
        model.in_flight += 1
        link = model.link
        link.queues[self._key] = self._queue
        # a grammar goes as its source: the engine process compiles it (cached there by its spec)
        link.send(["submit", self._key, model.name, prompt_ids, params_to_wire(params), seed, resume_ids, timeout_s])

    async def started(self) -> None:
        """Returns once the engine process accepted the request; its refusal (a full queue: 503) is raised."""
        if not self._accepted:
            event = await self._queue.get()
            if isinstance(event, BaseException):
                self._close(cancel=False)
                raise event
            self._accepted = True  # ("taken", seed): the seed is the one sent

    def __aiter__(self) -> FrontStream:
        return self

    async def __anext__(self) -> Delta:
        if self.finish_reason is not None or not self._open:
            raise StopAsyncIteration
        await self.started()
        return self._next(await self._queue.get(), self._resumed)

    def _close(self, cancel: bool) -> None:
        was_open = self._open
        super()._close(cancel)
        if was_open:
            self.model.link.queues.pop(self._key, None)

    def _cancel(self) -> None:
        self.model.link.send(["cancel", self._key])
