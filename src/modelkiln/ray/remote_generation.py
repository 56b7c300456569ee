"""A text-generation model whose engine runs in Ray Serve replicas, as the router sees it: the
router runs kiln serve's generation routes (OpenAI, Triton generate, OIP infer) on it unchanged.

``RemoteGenerationModel`` is an ``EnginelessGenerationModel``: prompts, chat templates, settings and
the checks on them are kiln serve's own code on the artifact's tokenizer, so a bad request gets the
same 400 here as there, before any replica is asked. ``generate`` returns a
``RemoteStream``: the answer's deltas, pulled from a replica through a streaming handle call
(``ModelReplica.generate``).

When that replica is lost mid-answer, the stream sends the request to another replica as
prompt + the tokens it has passed on (``resume_ids``), with the same seed and deadline, and goes on
pulling: the client's connection stays open, and what it receives is the uninterrupted answer,
token for token (every draw is keyed by (seed, token index), and the replica replays the text
state through the resumed tokens: ``serve/generation/resume.py``). Nothing is sent twice: the
tokens passed on are exactly those in ``resume_ids``. The gap is the loss's detection (the replica's
beacon connection ending, ``liveness.py``, else Ray's report), the new replica's queue and its
recompute: the prompt and the tokens sent prefilled in chunks (a decode step per token sent where
the serving graph computes a prompt's positions otherwise than decode steps)."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import deque
from collections.abc import AsyncGenerator, Sequence
from dataclasses import replace
from typing import Any, NamedTuple

from ..errors import KilnError
from ..generation.sampling import SamplingParams
from ..generation.sequence import Delta
from ..serve.dataplane import DataPlane
from ..serve.generation.model import EnginelessGenerationModel, OpenStream
from ..serve.metrics import Metrics
from ..serve.settings import ModelSpec, ServeSettings
from .failover import Retry, replica_lost, unwrap
from .liveness import Watch
from .plan import Failover

log = logging.getLogger("modelkiln.ray")


class Taken(NamedTuple):
    """A replica's first item of a stream: it accepted the request; ``beacon``: where the router
    connects to see it die (``liveness.Beacon``), or None."""
    replica: str
    beacon: str | None

class RemoteGenerationModel(EnginelessGenerationModel):
    def __init__(self, spec: ModelSpec, settings: ServeSettings, metrics: Metrics, handle: Any, failover: Failover):
        super().__init__(spec, settings, metrics)  # the artifact's tokenizer and chat template, no engine
        self.handle = handle.options(stream=True)
        self.failover = failover
        self.watch = Watch()

    def generate(self, prompt_ids: list[int], params: SamplingParams, timeout_s: float | None = None,
                 resume_ids: Sequence[int] = (), seed: int | None = None) -> RemoteStream:
        """The answer's stream. Its seed is chosen here when the request has none, so that every
        replica it may run on draws the same tokens."""
        if params.seed is not None:
            seed = params.seed
        elif seed is None:
            seed = secrets.randbits(63)
        deadline = time.monotonic() + (timeout_s or self.settings.generation_timeout_s)
        return RemoteStream(self, prompt_ids, params, seed, list(resume_ids), deadline)


class RemoteStream(OpenStream):
    """One request's deltas from the replicas (the interface of ``serve.generation.model.Stream``).
    ``aclose`` before the end cancels the replica's request (the client left)."""

    def __init__(self, model: RemoteGenerationModel, prompt_ids: list[int], params: SamplingParams, seed: int,
                 resume_ids: list[int], deadline: float):
        self.model = model
        self.prompt_ids = prompt_ids
        self.params = params
        self.seed = seed
        self.deadline = deadline
        self.sent = resume_ids  # the answer's tokens so far: the client's own, then every delta passed on
        self.prompt_tokens = len(prompt_ids)
        self.completion_tokens = len(resume_ids)
        self.finish_reason: str | None = None
        self.replica: str | None = None  # the replica that took the request (the last one, after a loss)
        self.attempts = 1
        self._client_resumed = len(resume_ids)
        self._pending: deque[Delta] = deque()
        self._retry = Retry(model.failover, model.name, model.metrics, deadline)
        self._accepted = False
        self._lost_at = 0.0
        self._gone = False  # the replica's beacon connection ended: its call was cancelled for that
        self._unwatch = _nothing
        self._open = True
        model.in_flight += 1
        self._call = self._submit()

    def _submit(self) -> Any:
        """The request (prompt + the tokens passed on so far) on a replica Serve chooses."""
        self._accepted = False
        self._gone = False
        timeout_s = max(0.001, self.deadline - time.monotonic())
        params = self.params
        if params.constraint is not None:  # the replica compiles it (cached there by its spec)
            params = replace(params, constraint=params.constraint.spec)
        return self.model.handle.generate.remote(self.prompt_ids, params, self.seed, list(self.sent), timeout_s)

    async def started(self) -> None:
        """Returns once a replica accepted the request (``replica`` names it); its refusal (a full
        queue: 503) is raised."""
        try:
            while not self._accepted:
                self._pending.extend(await self._next_item())
        except BaseException:
            self._close(cancel=True)
            raise

    def __aiter__(self) -> RemoteStream:
        return self

    async def __anext__(self) -> Delta:
        if self.finish_reason is not None or not self._open:
            raise StopAsyncIteration
        try:
            while not self._pending:
                self._pending.extend(await self._next_item())
        except BaseException:
            self._close(cancel=True)
            raise
        delta = self._pending.popleft()
        self.sent.append(delta.token_id)
        self.completion_tokens += 1
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self._close(cancel=False)
        return delta

    async def _next_item(self) -> list[Delta]:
        """The replica's next deltas ([] when it accepts the request). When the replica is lost: the
        request on another, from the tokens passed on, until one accepts it or the retries or the
        window run out (``ModelNotReadyError``)."""
        while True:
            try:
                if self._accepted:
                    item = await self._call.__anext__()
                else:  # no replica has it: wait for one at most until the window's end
                    item = await asyncio.wait_for(self._call.__anext__(), self._retry.remaining())
                if isinstance(item, Taken):  # the replica accepted the request
                    if self.attempts > 1:
                        log.info("model %s: %s taken by replica %s after %d token(s) (attempt %d, %.2f s after the "
                                 "loss of %s)", self.model.name, "answer" if self.sent else "request", item.replica,
                                 len(self.sent), self.attempts, time.monotonic() - self._lost_at, self.replica)
                    self.replica, self._accepted = item.replica, True
                    if item.beacon is not None:
                        self._unwatch = self.model.watch.on_loss(item.beacon, self._replica_gone)
                    return []
                return item
            except asyncio.TimeoutError:
                self._call.cancel()
                raise self._retry.timed_out() from None
            except StopAsyncIteration:  # the replica ended the call without the answer's end
                raise KilnError(f"model '{self.model.name}': the replica ended the answer early") from None
            except Exception as exc:
                if not (self._gone or replica_lost(exc)):
                    error = unwrap(exc)
                    raise error if isinstance(error, KilnError) else exc
                self._unwatch()
                self._call.cancel()
                self._lost_at = time.monotonic()
                log.warning("model %s: replica %s lost under a request after %d token(s) (%s); sending it to another",
                            self.model.name, self.replica, len(self.sent), type(unwrap(exc)).__name__)
                await self._retry.after_loss(exc, resumed=self.completion_tokens > self._client_resumed)
                self.attempts += 1
                self._call = self._submit()

    def _replica_gone(self) -> None:
        """The replica's beacon connection ended (its process died): the call is cancelled, and the
        next item awaited raises, which sends the request to another replica (``_next_item``)."""
        self._gone = True
        self._call.cancel()

    def _close(self, cancel: bool) -> None:
        self._unwatch()
        super()._close(cancel)

    def _cancel(self) -> None:
        self._call.cancel()


async def replica_deltas(plane: DataPlane, taken: Taken, prompt_ids: list[int], params: SamplingParams, seed: int,
                         resume_ids: list[int], timeout_s: float) -> AsyncGenerator[Taken | list[Delta], None]:
    """A replica's side of a ``RemoteStream`` (``ModelReplica.generate``): ``taken`` once its
    model accepted the request (a refusal, a full queue or a model stopping, is raised before), then
    the deltas. Closing it early (the router cancels the call: its client left) cancels the sequence."""
    model = plane.generation_model(None)
    if isinstance(params.constraint, tuple):  # (kind, spec): RemoteStream sends a grammar so
        params = replace(params, constraint=await asyncio.to_thread(model.grammars.compile, *params.constraint))
    stream = model.generate(prompt_ids, params, timeout_s, resume_ids, seed)
    async with stream:
        yield taken
        async for delta in stream:
            yield [delta]


def _nothing() -> None:
    pass
