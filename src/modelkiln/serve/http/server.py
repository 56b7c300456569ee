"""uvicorn serving the HTTP app: one place for its configuration, used by the one-process server
and by each worker of ``kiln serve --workers N`` (``workers.py``)."""

from __future__ import annotations

import signal
import socket
from collections.abc import Callable
from types import FrameType
from typing import Any

from ..settings import ServeSettings


def serve_http(app: Any, settings: ServeSettings, sockets: list[socket.socket] | None = None,
               on_server: Callable[[Any], None] | None = None) -> None:
    """Serve ``app`` until SIGTERM or SIGINT (a drained stop exits 0), on ``settings.host:port``
    or on ``sockets`` already bound (a worker's). ``on_server``: given the uvicorn server before
    it starts (a worker stops it when its supervisor is gone)."""
    import uvicorn

    from .protocol import bounded_head_protocol

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            super().handle_exit(sig, frame)
            # uvicorn re-raises the signal after a graceful shutdown, which would make the
            # process die of SIGTERM; a drained shutdown is a success, so exit 0 instead.
            if sig == signal.SIGTERM and sig in self._captured_signals:
                self._captured_signals.remove(sig)

    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, log_level=settings.log_level.lower(),
        access_log=False,  # ours (Gate) carries request ids; uvicorn's costs ~10% throughput
        # No X-Forwarded-* rewriting of the client address: nothing here reads it, and its
        # middleware would be one more layer on every request's path.
        proxy_headers=False,
        loop="auto", lifespan="on", timeout_keep_alive=30, backlog=2048,
        http=bounded_head_protocol(settings.body_read_timeout_s),  # uvicorn's, with a deadline for request heads
    )
    server = Server(config)
    if on_server is not None:
        on_server(server)
    server.run(sockets=sockets)
