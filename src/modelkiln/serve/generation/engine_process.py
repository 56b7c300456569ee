"""``kiln serve --workers N`` with text-generation models: their engines in one process, the HTTP and
gRPC fronts in N (vLLM's API servers in front of one engine core).

Why: a token streamed over SSE costs the serving process ~40 µs of Python (its event, its JSON, the
write), under the same interpreter lock as the engine's own host work. On a 2-core AMD EPYC one
process delivered 15,500-19,800 tokens/s to 256 streams where its engine alone made 68,900-72,200
(``benchmarks/generation/sse_front.py``), and two fronts 30,400-40,000 on the 1.6 cores the load
generator left; a GPU makes 40,000 a second and more. Continuous batching
is one scheduler, so the engine cannot be split; the fronts can.

- The engine process (``engine_main``, started by the supervisor before the workers) loads each
  text-generation model as a one-process server does (``GenerationModel``: its engine replicas
  and the threads that step them, its metrics into the workers' shared folder) and listens on a
  Unix socket.
- Each worker serves the model as a ``FrontGenerationModel`` (``front.py``): prompts, chat templates
  and every check are its own (a bad request gets its 4xx there, the engine never sees it); a
  request goes over its connection to the engine process, and the answer's tokens come back.
- The wire: frames of a 4-byte length and a JSON array (orjson: a frame is data, never
  code). A front sends ``["submit", key, model, prompt ids, params, seed, resume ids, timeout]`` (the
  sampling parameters' fields, a grammar as its source, compiled and cached here) and ``["cancel",
  key]``; the engine process answers with ``["events", [[key, event], ...]]``, one frame a front per
  engine step (the driver hands a step's outputs to this event loop in one call, and they leave in
  one write): ``event`` is ``["taken", seed]``, ``["delta", ...its fields]`` or ``["error", kind,
  message]`` (``channel.error_to_json``).
- A front that goes (killed, stopped) has its requests cancelled: their sequences are freed before the
  next step. The engine process stops when the supervisor closes its channel or sends SIGTERM, after
  the fronts: every request accepted is answered first."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import struct
import sys
from collections.abc import Mapping
from dataclasses import fields, replace
from multiprocessing.connection import Connection
from typing import Any

import orjson

from ...errors import KilnError
from ...generation.sampling import SamplingParams
from ...generation.sequence import Delta
from ..channel import error_from_json, error_to_json
from ..metrics import Metrics
from ..settings import ServeSettings
from .loop_driver import Job
from .model import GenerationModel

log = logging.getLogger("modelkiln.serve")

ENGINE_ADDRESS = "KILN_ENGINE_ADDRESS"  # a worker's environment: the engine process's socket
_LENGTH = struct.Struct("!I")


# --- the wire -------------------------------------------------------------------------------------


def frame(message: Any) -> bytes:
    body = orjson.dumps(message)
    return _LENGTH.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader) -> Any:
    """The next message; ``asyncio.IncompleteReadError`` when the other side is gone."""
    size, = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    return orjson.loads(await reader.readexactly(size))


def params_to_wire(params: SamplingParams) -> dict[str, Any]:
    """A request's sampling parameters as JSON fields, a grammar as its (kind, spec)."""
    constraint = params.constraint.spec if params.constraint is not None else None
    return {f.name: getattr(params, f.name) for f in fields(params) if f.name != "constraint"} | {"constraint": constraint}


def params_from_wire(values: dict[str, Any]) -> SamplingParams:
    """``params_to_wire``'s fields as SamplingParams again (checked again), the grammar still a (kind, spec)."""
    values = dict(values)
    for name in ("stop", "stop_token_ids"):
        values[name] = tuple(values[name])
    values["logit_bias"] = tuple((int(token), float(bias)) for token, bias in values["logit_bias"])
    if values["constraint"] is not None:
        values["constraint"] = tuple(values["constraint"])
    return SamplingParams(**values)


def event_to_wire(event: Delta | BaseException) -> list:
    if isinstance(event, Delta):
        return ["delta", event.token_id, event.text, event.finish_reason, event.logprob, event.top_logprobs,
                event.prompt_logprobs]
    return ["error", *error_to_json(event)]


def event_from_wire(event: list) -> Delta | KilnError | tuple[str, int]:
    """A front's view of an event: a Delta, the error that ends the answer, or ("taken", seed)."""
    if event[0] == "delta":
        token_id, text, finish_reason, logprob, top, prompt = event[1:]
        return Delta(token_id, text, finish_reason, logprob, [(t, p) for t, p in top] if top is not None else None,
                     [None if e is None else (e[0], [(t, p) for t, p in e[1]]) for e in prompt]
                     if prompt is not None else None)
    if event[0] == "error":
        return error_from_json(event[1:])
    return ("taken", event[1])


# --- the engine process ---------------------------------------------------------------------------


class _Front:
    """One front's connection: its requests in the engines, and the events going back to it, written
    once a loop turn (one frame a front per engine step)."""

    def __init__(self, writer: asyncio.StreamWriter):
        self.writer = writer
        self.jobs: dict[int, Job] = {}
        self.compiling: dict[int, asyncio.Task] = {}  # requests whose grammar is being compiled
        self._events: list[tuple[int, Any]] = []

    def send(self, key: int, event: Any) -> None:
        if not self._events:
            asyncio.get_running_loop().call_soon(self._flush)
        self._events.append((key, event))

    def _flush(self) -> None:
        events, self._events = self._events, []
        if not self.writer.is_closing():
            self.writer.write(frame(("events", events)))

    def cancel(self, key: int) -> None:
        compiling = self.compiling.pop(key, None)
        if compiling is not None:
            compiling.cancel()
        job = self.jobs.pop(key, None)
        if job is not None and job.driver is not None:
            job.driver.cancel(job)

    def cancel_all(self) -> None:
        for key in [*self.compiling, *self.jobs]:
            self.cancel(key)


class _Events:
    """A job's queue (``Job.queue``): each of its events goes to its front, the job forgotten at its last."""

    def __init__(self, front: _Front, key: int):
        self.front, self.key = front, key

    def put_nowait(self, event: Delta | BaseException) -> None:
        if not isinstance(event, Delta) or event.finish_reason is not None:
            self.front.jobs.pop(self.key, None)
        self.front.send(self.key, event_to_wire(event))


class EngineHost:
    """The engine process's server: the generation models, and the fronts' connections to them."""

    def __init__(self, models: Mapping[str, GenerationModel]):
        self.models = models
        self.fronts: set[_Front] = set()

    async def serve_front(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        front = _Front(writer)
        self.fronts.add(front)
        try:
            while True:
                message = await read_frame(reader)
                if message[0] == "submit":
                    key = message[1]
                    submitting = self._submit(front, *message[1:])
                    if message[4].get("constraint") is None:
                        await submitting  # at once: nothing in it waits
                    else:  # its grammar compiles in a thread while this front's other messages are read
                        front.compiling[key] = asyncio.ensure_future(submitting)
                elif message[0] == "cancel":
                    front.cancel(message[1])
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the front is gone
        except Exception:  # noqa: BLE001 - a frame this side cannot read: the connection ends, its requests with it
            log.exception("a front sent a frame the engine process cannot read; closing its connection")
        finally:
            front.cancel_all()
            self.fronts.discard(front)
            writer.close()

    async def _submit(self, front: _Front, key: int, name: str, prompt_ids: list[int], wire_params: dict[str, Any],
                      seed: int, resume_ids: list[int], timeout_s: float) -> None:
        model = self.models.get(name)
        try:
            if model is None:
                raise KilnError(f"the engine process serves no model '{name}'")
            params = params_from_wire(wire_params)
            if isinstance(params.constraint, tuple):  # (kind, spec): the front sends a grammar so
                params = replace(params, constraint=await asyncio.to_thread(model.grammars.compile, *params.constraint))
            front.jobs[key] = model.submit(prompt_ids, params, _Events(front, key), timeout_s, resume_ids, seed)
        except Exception as exc:  # noqa: BLE001 - refused (a full queue, a model stopping): the front raises it
            front.send(key, event_to_wire(exc))
        else:
            front.send(key, ["taken", seed])
        finally:
            front.compiling.pop(key, None)


def engine_main(fd: int, address: str) -> None:
    """The engine process (``python -c``, the supervisor's end of a socket pair as ``fd``): read its
    settings, load the text-generation models, listen on ``address``, say so, serve until SIGTERM or
    until the supervisor is gone; then answer what was accepted and exit."""
    conn = Connection(fd)
    start = orjson.loads(conn.recv_bytes())
    settings = ServeSettings.model_validate(start["settings"])
    logging.basicConfig(level=settings.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s [engine]: %(message)s")
    metrics = Metrics()
    models: dict[str, GenerationModel] = {}
    try:
        for spec in settings.models:
            model = GenerationModel(spec, settings, metrics)
            model.load()
            models[model.name] = model
    except BaseException as exc:
        conn.send_bytes(orjson.dumps(["failed", f"{type(exc).__name__}: {exc}" if not isinstance(exc, KilnError)
                                      else str(exc)]))
        raise SystemExit(2) from None
    asyncio.run(_serve(EngineHost(models), conn, address))
    for model in models.values():
        model.stop()  # the fronts stopped first: nothing is left to answer, the threads end


async def _serve(host: EngineHost, conn: Connection, address: str) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = await asyncio.start_unix_server(host.serve_front, path=address)
    loop.add_reader(conn.fileno(), stop.set)  # the supervisor closed its end (it stops us), or is gone
    conn.send_bytes(orjson.dumps(["loaded"]))
    await stop.wait()
    server.close()
    for front in list(host.fronts):
        front.cancel_all()
    try:
        os.unlink(address)
    except OSError:
        pass
