"""Calls both ways between two processes over a socket pair, on an asyncio loop: what a worker
of ``kiln serve --workers N`` and its supervisor (``workers.py``) say to each other. Messages are
JSON (``orjson``), so nothing unpickles what another process sent; typed errors travel as their
class name and message."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict
from multiprocessing.connection import Connection
from typing import Any

import orjson

from .. import errors
from ..errors import KilnError


class WorkerGone(KilnError):
    """The worker process on the other end exited (or its supervisor did)."""


def error_to_json(exc: BaseException) -> list[str]:
    """A typed error as [class name, message] (anything else: KilnError with its type and message)."""
    if isinstance(exc, KilnError) and getattr(errors, type(exc).__name__, None) is type(exc):
        return [type(exc).__name__, str(exc)]
    return ["KilnError", str(exc) if isinstance(exc, KilnError) else f"{type(exc).__name__}: {exc}"]


def error_from_json(value: list[str]) -> KilnError:
    kind = getattr(errors, value[0], KilnError)
    return kind(value[1]) if isinstance(kind, type) and issubclass(kind, KilnError) else KilnError(value[1])


class Channel:
    """Calls both ways over one socket: ``await call(op, *args)`` runs ``handlers[op](*args)`` on
    the other side and returns its result (as JSON has it: dataclasses become dicts) or raises its
    typed error. Other messages (the start-up handshake) go to ``on_message``; ``on_closed`` runs
    once when the other side is gone. Messages are JSON lists, framed by ``Connection``."""

    def __init__(self, conn: Connection, handlers: Mapping[str, Callable[..., Awaitable[Any]]],
                 on_message: Callable[[Any], None] = lambda message: None,
                 on_closed: Callable[[], None] = lambda: None):
        self.conn = conn
        self.handlers = handlers
        self.on_message = on_message
        self.on_closed = on_closed
        self.closed = False
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future] = {}
        self._tasks: set[asyncio.Task] = set()
        self._loop: asyncio.AbstractEventLoop | None = None

    def attach(self) -> None:
        """Start reading on the running loop."""
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self.conn.fileno(), self._readable)

    def send(self, message: Any) -> None:
        if self.closed:
            raise WorkerGone("the other process is gone")
        try:
            self.conn.send_bytes(orjson.dumps(message, default=asdict))
        except (OSError, ValueError):
            self.close()
            raise WorkerGone("the other process is gone") from None

    async def call(self, op: str, *args: Any) -> Any:
        assert self._loop is not None
        number = next(self._ids)
        reply = self._loop.create_future()
        self._waiting[number] = reply
        try:
            self.send(["call", number, op, args])
            return await reply
        finally:
            self._waiting.pop(number, None)

    def _readable(self) -> None:
        try:
            while not self.closed and self.conn.poll():
                self._dispatch(orjson.loads(self.conn.recv_bytes()))
        except (EOFError, OSError):
            self.close()

    def _dispatch(self, message: list) -> None:
        if message[0] == "call":
            task = asyncio.ensure_future(self._answer(*message[1:]))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        elif message[0] == "reply":
            _, number, error, value = message
            reply = self._waiting.get(number)
            if reply is not None and not reply.done():
                reply.set_exception(error_from_json(error)) if error is not None else reply.set_result(value)
        else:
            self.on_message(message)

    async def _answer(self, number: int, op: str, args: list) -> None:
        error, value = None, None
        try:
            value = await self.handlers[op](*args)
        except Exception as exc:  # typed errors travel with their kind; anything else as its message
            error = error_to_json(exc)
        if not self.closed:
            try:
                self.send(["reply", number, error, value])
            except WorkerGone:
                pass

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self.conn.fileno())
        for reply in self._waiting.values():
            if not reply.done():
                reply.set_exception(WorkerGone("the other process is gone"))
        self.conn.close()
        self.on_closed()
