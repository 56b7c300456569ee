"""A replica's death, seen by the router the moment its process goes, not when Ray reports it.

Ray tells a caller that an actor's process died some time after it happened: on one machine, with
the router's wait for death info already at 100 ms (``plan.DEATH_INFO_WAIT_MS``), 0.4 to 1.2 s after
a node's processes were SIGKILLed (``benchmarks/reliability/ray_failover.py``, traced), while the
streams on it stall. A TCP connection says it at once: when a process dies, its kernel closes its
sockets, and the other end reads the end of the stream.

So each generation replica listens on a port of its node (``Beacon``), and names it when it takes a
request; the router holds one connection to each replica whose streams it pulls (``Watch``), and
when that connection ends, every stream on that replica is sent to another one (``RemoteStream``
cancels its call and resumes from the tokens it passed on: the answer is the same either way). A
connection that cannot be made, or a node lost without its kernel (power, network), leaves the
stream to Ray's own report, as before."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

log = logging.getLogger("modelkiln.ray")

# After a failed connection to a beacon (a firewall, a replica going away), how long the router
# leaves that replica to Ray's reports before it tries again: one try per stream would cost each a
# connection timeout.
RETRY_AFTER_S = 10.0
CONNECT_TIMEOUT_S = 2.0


class Beacon:
    """The replica's side: a listening socket whose connections it never writes to nor closes; its
    process's end closes them."""

    def __init__(self, host: str):
        self.host = host
        self._server: asyncio.Server | None = None
        self._peers: set[asyncio.StreamWriter] = set()
        self._starting = asyncio.Lock()

    async def address(self) -> str:
        """``host:port``, listening from the first call on."""
        async with self._starting:
            if self._server is None:
                self._server = await asyncio.start_server(self._hold, self.host, 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"{self.host}:{port}"

    @property
    def connections(self) -> int:
        """Routers holding a connection to it now."""
        return len(self._peers)

    def close(self) -> None:
        """What this process's end does: no more connections, and those open end."""
        if self._server is not None:
            self._server.close()
        for writer in list(self._peers):
            writer.close()

    async def _hold(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._peers.add(writer)
        try:
            await reader.read()  # the router does not write: this returns when it goes
        except ConnectionError:
            pass
        finally:
            self._peers.discard(writer)
            writer.close()


class Watch:
    """The router's side: one connection per beacon; ``on_loss(address, callback)`` registers what
    to call when it ends (the returned function unregisters it)."""

    def __init__(self) -> None:
        self._watchers: dict[str, set[Callable[[], None]]] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._failed_at: dict[str, float] = {}

    def on_loss(self, address: str, callback: Callable[[], None]) -> Callable[[], None]:
        if time.monotonic() - self._failed_at.get(address, -RETRY_AFTER_S) < RETRY_AFTER_S:
            return lambda: None  # no connection to that replica: Ray's report will do
        self._watchers.setdefault(address, set()).add(callback)
        if address not in self._tasks:
            self._tasks[address] = asyncio.get_running_loop().create_task(self._follow(address))
        return lambda: self._watchers.get(address, set()).discard(callback)

    async def _follow(self, address: str) -> None:
        host, port = address.rsplit(":", 1)
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), CONNECT_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError) as exc:
            log.warning("replica beacon %s: no connection (%s); its loss is left to Ray's report", address, exc)
            self._failed_at[address] = time.monotonic()
            self._watchers.pop(address, None)
            self._tasks.pop(address, None)
            return
        try:
            await reader.read()  # the beacon never writes: the end of the stream is its process's end
        except ConnectionError:
            pass
        finally:
            writer.close()
            self._tasks.pop(address, None)
            watchers = self._watchers.pop(address, set())
        if watchers:
            log.warning("replica beacon %s: connection lost; moving its %d stream(s)", address, len(watchers))
        for callback in watchers:
            callback()
