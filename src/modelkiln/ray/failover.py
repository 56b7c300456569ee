"""What the router does when a model replica is lost under a request: which errors mean that, and
how often and how long it tries another replica. One policy for both kinds of request it sends to
replicas: a forwarded request (sent again whole: encoder requests are idempotent) and a generation
stream (continued from the tokens already sent: ``remote_generation.py``).

A replica is lost when its process or node dies (Ray raises ``ActorDiedError``, or
``ActorUnavailableError`` while Ray does not know yet: in the measurements on one machine the
caller learned of a SIGKILLed node 1.4 s after the kill), or when it is stopping (a drained node,
a scale-down: kiln serve's data plane answers ``ModelNotReadyError`` to new requests then).
Serve's handle stops choosing a replica that failed this way, so the next attempt goes to a live
one, or waits for one (a replacement starting) within the window."""

from __future__ import annotations

import asyncio
import time

from ray.exceptions import (ActorUnavailableError, NodeDiedError, ObjectLostError, RayActorError, RayTaskError,
                            WorkerCrashedError)

from ..errors import ModelNotReadyError
from ..serve.metrics import Metrics
from .plan import Failover

_LOST = (RayActorError, ActorUnavailableError, WorkerCrashedError, NodeDiedError, ObjectLostError)


def unwrap(exc: BaseException) -> BaseException:
    """The error a replica raised (Ray wraps it in a ``RayTaskError``), else ``exc``."""
    cause = getattr(exc, "cause", None) if isinstance(exc, RayTaskError) else None
    return cause if isinstance(cause, BaseException) else exc


def replica_lost(exc: BaseException) -> bool:
    """``exc`` says the replica went away (or is going), not that the request failed on it."""
    return isinstance(unwrap(exc), (*_LOST, ModelNotReadyError))


class Retry:
    """One request's attempts after losses: at most ``failover.retries`` more, each waiting at most
    ``failover.window_s`` from the loss for a replica to take it (and never past the request's own
    deadline). Counted in the router's metrics."""

    def __init__(self, failover: Failover, model: str, metrics: Metrics, deadline: float = float("inf")):
        self.failover = failover
        self.model = model
        self.metrics = metrics
        self.deadline = deadline
        self.count = 0
        self.window_end = deadline  # until a loss: the request's own deadline

    async def after_loss(self, exc: BaseException, resumed: bool) -> None:
        """Called when the replica was lost: returns when the request may be sent again (counted as a
        retry, or as a resumed stream when tokens were sent), else raises ``ModelNotReadyError``."""
        self.count += 1
        now = time.monotonic()
        self.window_end = min(self.deadline, now + self.failover.window_s)
        if self.count > self.failover.retries or now >= self.window_end:
            self.metrics.failovers_failed.labels(self.model).inc()
            raise self.gave_up(exc)
        (self.metrics.streams_resumed if resumed else self.metrics.retries).labels(self.model).inc()
        # The first attempt goes at once (Serve's handle has already set the lost replica aside);
        # later ones back off, in case the loss is not the replica's alone (a node, the network).
        await asyncio.sleep(min(0.25 * 2 ** (self.count - 2), 2.0, self.remaining()) if self.count > 1 else 0)

    def remaining(self) -> float:
        """Seconds left to wait for a replica to take the request now."""
        return max(0.0, self.window_end - time.monotonic())

    def timed_out(self) -> ModelNotReadyError:
        """No replica took the request within the window."""
        self.metrics.failovers_failed.labels(self.model).inc()
        return ModelNotReadyError(f"model '{self.model}': no replica took the request within "
                                  f"{self.failover.window_s:g}s of its replica's loss; retry later")

    def gave_up(self, exc: BaseException) -> ModelNotReadyError:
        return ModelNotReadyError(f"model '{self.model}': its replica was lost ({type(unwrap(exc)).__name__}) "
                                  f"{self.count} time(s); no live replica took the request in time; retry later")
