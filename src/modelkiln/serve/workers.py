"""``kiln serve --workers N``: N server processes behind one address, one server to its clients.

Why: in one process the event loop (HTTP, codecs, the data plane) and the engine threads' Python
work (tokenizing calls, batching, answers) share one interpreter lock. On a 16-core Intel Xeon one
process served at most ~2,000 req/s whatever its sessions (their model alone ran 4,384
sentences/s), its event loop at 300-335 µs of CPU per request and answers waiting 38-69 ms for
it. Worker processes each have their own lock, loop and engines (``ServeSettings.worker_count``).

How it stays one server:
- The supervisor (the process ``kiln serve`` started: ``Supervisor``) loads no model. It reserves
  the ports (a bound, not listening, socket: a second server on the same port fails as before),
  starts the workers (fresh interpreters, each in a session of its own, talking to it over a
  socket pair in JSON: ``channel.py``), waits until every one has loaded the
  models, then lets them all serve.
- Each worker is a whole server (``http.server.serve_http``: uvicorn, gRPC if on, the data plane and
  engines, sized to its share of the CPU budget) listening through its own ``SO_REUSEPORT``
  socket on the same port: the kernel spreads new connections over the workers (by a hash of the
  connection's addresses, so each gets its share of a client's connections; a keep-alive
  connection stays with the worker that accepted it). A pre-bound socket shared by every worker,
  as gunicorn and uvicorn's own ``--workers`` do, hands a burst of new connections to whichever
  worker wakes first, and asyncio accepts up to the backlog per wake-up: one worker could take
  every connection of a load test and leave the others idle.
- Metrics: every worker writes to files in one folder, ``/metrics`` reads them all (``metrics.py``).
- The model repository is decided in the supervisor (``repository.ModelRepository`` over
  ``WorkerModels``): a load or unload asked of any worker, over HTTP or gRPC, goes to the
  supervisor, which has every worker carry it out and answers when all have; poll mode's scans
  run there too. Triton's statistics are added up over the workers the same way.
- SIGTERM (or Ctrl-C): every worker stops accepting, answers every request it accepted and exits;
  the supervisor exits 0 when all have.
- A worker that dies (killed, crashed) is replaced by a new one serving the same models, while the
  others serve on. Its connections die with it: the kernel closes them, so their clients see the
  connection closed at once, never a hang (no process is left holding them to answer with a 503).
- Text generation: continuous batching is one scheduler, so its engines (``--generation-replicas``) run
  in one process over the whole CPU budget, the **engine process** (``generation/engine_process.py``),
  started before the workers; each worker serves the model as a front to it (prompts, templates and
  checks its own; the tokens stream back from the engine process). A text-generation model is
  loaded at start only: the repository's load of one is refused while the workers run. The engine
  process exiting ends the server (exit 1): its answers are gone with it."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, cast

import orjson

from ..errors import ArtifactError, KilnError
from ..manifest import Manifest
from ..tasks.text_generation import is_generation
from .channel import Channel, WorkerGone, error_to_json
from .generation.engine_process import ENGINE_ADDRESS
from .metrics import MULTIPROCESS_DIR
from .repository import Folder, ModelRepository
from .settings import ModelSpec, ServeSettings
from .types import Duration, ModelStatistics, RepositoryModel

log = logging.getLogger("modelkiln.serve")

RESTART_DELAYS_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)  # after each failed start of a replacement in a row
# A worker sets its queue gauges this often: /metrics, answered by any worker, reads every worker's
# last value (a queue emptied by departed clients runs no batch, which would otherwise set it).
GAUGE_REFRESH_S = 0.1


# --- ports ---------------------------------------------------------------------------------------


def _address(host: str, port: int) -> tuple[int, tuple]:
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    return family, address


def shared_listener(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` with ``SO_REUSEPORT``: every worker binds one, and the
    kernel spreads new connections over those listening."""
    family, address = _address(host, port)
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(address)
    return sock


def reserve_port(host: str, port: int, what: str, flag: str) -> socket.socket:
    """Hold ``host:port`` for the workers: a ``SO_REUSEPORT`` socket bound but never listening (it
    takes no connection: the kernel spreads them over listening sockets only). First a plain bind,
    which fails when anything holds the port, another server of this kind included (that one's
    sockets would share the port with ours). Port 0: the port the system picks."""
    family, address = _address(host, port)
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
            address = probe.getsockname()
        return shared_listener(host, address[1])
    except OSError as exc:
        raise KilnError(f"cannot listen for {what} on {host}:{port} ({exc.strerror}): pass {flag} PORT") from None


# --- the worker side ------------------------------------------------------------------------------


def worker_main(fd: int) -> None:
    """A worker process (``python -c``, the supervisor's end of a socket pair as ``fd``): read its
    start, load the models, say so, wait for the word, serve until SIGTERM."""
    conn = Connection(fd)
    start = orjson.loads(conn.recv_bytes())
    settings = ServeSettings.model_validate(start["settings"])
    logging.basicConfig(level=settings.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s %(name)s [worker {start['index']}]: %(message)s")
    from .http.app import create_app
    from .dataplane import build_dataplane
    from .http.server import serve_http

    link = SupervisorLink(conn, settings.model_control_mode)
    try:
        plane = build_dataplane(settings, repository=link)
    except BaseException as exc:
        conn.send_bytes(orjson.dumps(["failed", error_to_json(exc)[1]]))
        raise SystemExit(2) from None
    link.plane = plane
    plane.peers = link
    conn.send_bytes(orjson.dumps(["loaded"]))
    try:
        if orjson.loads(conn.recv_bytes()) != ["serve"]:
            return
    except (EOFError, OSError):  # the supervisor gave up (another worker failed to load) or is gone
        plane.stop()
        return
    serve_http(create_app(plane), settings, sockets=[shared_listener(settings.host, settings.port)],
               on_server=link.stop_with)


class SupervisorLink:
    """A worker's side of its channel: the data plane's repository (``dataplane.Repository``:
    asks the supervisor, which changes every worker) and peers (``dataplane.Peers``), and what
    the supervisor asks of this worker (install, remove, statistics)."""

    def __init__(self, conn: Connection, mode: str):
        self.mode = mode
        self.plane: Any = None
        self._stop: Callable[[], None] = lambda: None
        self.channel = Channel(conn, {"install": self._install, "remove": self._remove,
                                      "statistics": self._statistics}, on_closed=lambda: self._stop())

    def stop_with(self, server: Any) -> None:
        """The server to stop when the supervisor is gone (it exited: nothing would replace or
        stop this worker any more)."""
        def stop() -> None:
            server.should_exit = True

        self._stop = stop

    # dataplane.Repository
    async def start(self) -> None:
        self.channel.attach()
        self._gauges = asyncio.ensure_future(self._publish_gauges())

    async def close(self) -> None:
        self._gauges.cancel()  # the channel stays open until the process exits: the supervisor may still ask

    async def _publish_gauges(self) -> None:
        while True:
            self.plane.publish_queue_gauges()
            await asyncio.sleep(GAUGE_REFRESH_S)

    async def index(self, ready_only: bool = False) -> list[RepositoryModel]:
        return [RepositoryModel(**entry) for entry in await self.channel.call("index", ready_only)]

    async def load(self, name: str) -> None:
        await self.channel.call("load", name)

    async def unload(self, name: str) -> None:
        await self.channel.call("unload", name)

    # dataplane.Peers
    async def statistics(self, name: str | None, version: str | None) -> list[ModelStatistics]:
        return statistics_from_json(await self.channel.call("statistics", name, version))

    # asked by the supervisor
    async def _install(self, spec: dict) -> None:
        from .local_models import LocalModels

        await LocalModels(self.plane).install(ModelSpec(**spec), set())

    async def _remove(self, name: str) -> None:
        from .local_models import LocalModels

        await LocalModels(self.plane).remove(name)

    async def _statistics(self, name: str | None, version: str | None) -> list[ModelStatistics]:
        return self.plane.local_statistics(name, version)


# --- the supervisor side ---------------------------------------------------------------------------


@dataclass(eq=False)
class Worker:
    index: int
    process: asyncio.subprocess.Process
    channel: Channel
    loaded: asyncio.Future
    serving: bool = False

    def stop(self) -> None:
        """SIGTERM: it stops accepting, answers what it accepted, exits."""
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)


class WorkerModels:
    """``repository.ModelSet`` over every worker: a change is carried out by all of them before it
    counts as made. ``specs`` is what every worker serves, and what a new worker loads."""

    def __init__(self, supervisor: Supervisor, specs: dict[str, ModelSpec]):
        self.supervisor = supervisor
        self.specs = specs

    def served(self) -> Mapping[str, bool]:
        return {name: True for name in self.specs}

    async def install(self, spec: ModelSpec, loading: set[str]) -> None:
        if is_generation(Manifest.load(Path(spec.path))):
            raise ArtifactError(f"'{spec.name}' is a text-generation model: with --workers above 1 it is loaded when "
                                "kiln serve starts (name it there)")
        loading.add(spec.name)
        try:
            async with self.supervisor.changing:
                outcomes = await self.supervisor.each_worker("install", spec)
                failed = [w for w, error in outcomes.items() if error is not None]
                if failed and len(failed) == len(outcomes):
                    raise next(error for error in outcomes.values() if error is not None)  # every one failed
                self.specs[spec.name] = spec
                for worker in failed:  # loaded elsewhere (so not the artifact): a fresh worker loads it again
                    log.warning("worker %d could not load %s (%s); replacing it", worker.index, spec.name,
                                outcomes[worker])
                    worker.stop()
        finally:
            loading.discard(spec.name)

    async def remove(self, name: str) -> None:
        async with self.supervisor.changing:
            self.specs.pop(name, None)
            await self.supervisor.each_worker("remove", name)


def statistics_from_json(rows: list[dict]) -> list[ModelStatistics]:
    """Statistics as a worker sent them (JSON: dataclasses as dicts)."""
    durations = ("success", "fail", "queue", "compute_infer")

    def value(key: str, v: Any) -> Any:
        return Duration(**v) if key in durations else v

    return [ModelStatistics(**{k: value(k, v) for k, v in row.items()}) for row in rows]


def add_statistics(per_worker: list[list[ModelStatistics]]) -> list[ModelStatistics]:
    """Each worker's statistics (the same models, in the same order) added up."""
    def add(a: Duration, b: Duration) -> Duration:
        return Duration(a.count + b.count, a.ns + b.ns)

    total: dict[tuple[str, str], ModelStatistics] = {}
    for stats in per_worker:
        for s in stats:
            key = (s.name, s.version)
            t = total.get(key)
            total[key] = s if t is None else replace(
                t, last_inference_ms=max(t.last_inference_ms, s.last_inference_ms),
                inference_count=t.inference_count + s.inference_count,
                execution_count=t.execution_count + s.execution_count, success=add(t.success, s.success),
                fail=add(t.fail, s.fail), queue=add(t.queue, s.queue), compute_infer=add(t.compute_infer, s.compute_infer))
    return list(total.values())


@dataclass
class Startup:
    """The model repository, its folders loaded at start, and every model served at start by name."""

    repository: ModelRepository
    folders: list[Folder]
    specs: dict[str, ModelSpec]


def startup_specs(settings: ServeSettings) -> Startup:
    """What a server loads at start: the models given, then the repository's folders (all but in
    explicit mode), each named (a path alone is named by its manifest). KilnError for two models
    of one name, or a bad repository setting."""
    repository = ModelRepository(settings, Path(settings.model_repository) if settings.model_repository else None)
    folders = repository.startup_folders()
    specs: dict[str, ModelSpec] = {}
    for spec in (*settings.models, *(repository.spec(f) for f in folders)):
        named = spec if spec.name else replace(spec, name=Manifest.load(Path(spec.path)).name)
        if named.name in specs:
            raise KilnError(f"two models are named '{named.name}': use NAME=PATH")
        specs[named.name] = named
    return Startup(repository, folders, specs)


def generates_text(specs: Mapping[str, ModelSpec]) -> bool:
    return any(is_generation(Manifest.load(Path(s.path))) for s in specs.values())


class Supervisor:
    def __init__(self, settings: ServeSettings, count: int, startup: Startup):
        self.count = count
        self.repository = startup.repository
        specs = startup.specs
        self.generation = {name: spec for name, spec in specs.items() if is_generation(Manifest.load(Path(spec.path)))}
        self.engine_settings = settings.with_models(tuple(self.generation.values()))  # the whole CPU budget
        self.http_port = reserve_port(settings.host, settings.port, "HTTP", "--port")
        self.grpc_port = (reserve_port(settings.host, settings.grpc_port, "gRPC", "--grpc-port")
                          if settings.grpc_port else None)
        share = max(1, (settings.cpus or 1) // count)
        self.worker_settings = settings.replace(
            cpus=share, workers=count, port=self.http_port.getsockname()[1],
            grpc_port=self.grpc_port.getsockname()[1] if self.grpc_port else 0)
        self.models = WorkerModels(self, specs)
        self.repository.attach(self.models, startup.folders)
        self.metrics_dir = tempfile.mkdtemp(prefix="kiln-metrics-")
        self.engine_address = os.path.join(self.metrics_dir, "engine.sock") if self.generation else None
        self.engine: Worker | None = None  # the engine process, with text-generation models
        self.failed = False  # the engine process exited while serving
        self.workers: dict[int, Worker] = {}
        self.changing: asyncio.Lock  # a change of the served models, or a worker starting: one at a time
        self.stopping = False
        self.stopped: asyncio.Event
        self.failures: dict[int, int] = {}  # replacements of each worker that failed to start, in a row

    # -- life -------------------------------------------------------------------------------------
    def run(self) -> int:
        try:
            return asyncio.run(self._run())
        finally:
            for sock in (self.http_port, self.grpc_port):
                if sock is not None:
                    sock.close()
            shutil.rmtree(self.metrics_dir, ignore_errors=True)

    async def _run(self) -> int:
        self.changing = asyncio.Lock()
        self.stopped = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopped.set)
        if self.generation:
            try:
                await self._start_engine()
            except BaseException:
                await self._stop_all()
                raise
        started = [await self._spawn(k) for k in range(self.count)]
        loading, stop = asyncio.ensure_future(self._all_loaded(started)), asyncio.ensure_future(self.stopped.wait())
        try:
            await asyncio.wait({loading, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not loading.done():  # SIGTERM while loading: nothing was served yet
                loading.cancel()
                return await self._stop_all()
            loading.result()  # KilnError: a worker could not load (a bad artifact fails fast, as with one process)
        except BaseException:
            await self._stop_all()
            raise
        for worker in started:
            self._serve(worker)
        address = self.worker_settings
        log.info("serving on %s:%d with %d workers (%d cpus each)", address.host, address.port, self.count,
                 address.cpus)
        await self.repository.start()
        await self.stopped.wait()
        self.stopping = True
        await self.repository.close()
        code = await self._stop_all()
        return 1 if self.failed else code

    async def _all_loaded(self, workers: list[Worker]) -> None:
        """Every worker has loaded its models; else KilnError with the first one's reason."""
        for done in asyncio.as_completed([w.loaded for w in workers]):
            await done

    async def _stop_all(self) -> int:
        """SIGTERM to every worker (each answers what it accepted), then wait for them; the exit
        code: 0 when every one drained and exited 0."""
        self.stopping = True
        workers = list(self.workers.values())
        for worker in workers:
            worker.stop()
        await asyncio.gather(*(w.process.wait() for w in workers))
        if self.engine is not None:  # after the fronts: every answer they accepted is out
            self.engine.stop()
            await self.engine.process.wait()
            workers.append(self.engine)
        return 0 if all(w.process.returncode == 0 for w in workers) else 1

    # -- the engine process ------------------------------------------------------------------------
    async def _start_engine(self) -> None:
        """The engine process with the text-generation models, loaded and listening (else KilnError)."""
        engine = await self._child(
            -1, lambda fd: "from modelkiln.serve.generation.engine_process import engine_main; "
                           f"engine_main({fd}, {self.engine_address!r})",
            {}, {"settings": self.engine_settings.model_dump(mode="json")}, {})
        self.engine = engine
        asyncio.ensure_future(self._watch_engine(engine))
        stop = asyncio.ensure_future(self.stopped.wait())
        try:
            await asyncio.wait({engine.loaded, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if not engine.loaded.done():  # SIGTERM while loading
            raise KilnError("stopped while the engine process was loading")
        engine.loaded.result()
        engine.serving = True

    async def _watch_engine(self, engine: Worker) -> None:
        code = await engine.process.wait()
        engine.channel.close()
        if not engine.loaded.done():
            engine.loaded.set_exception(KilnError(f"the engine process exited with code {code} while loading"))
        elif not self.stopping:
            log.error("the engine process (pid %d) exited with code %s: stopping the server", engine.process.pid, code)
            self.failed = True
            self.stopped.set()

    # -- workers ----------------------------------------------------------------------------------
    async def _spawn(self, index: int) -> Worker:
        settings = self.worker_settings.with_models(tuple(self.models.specs.values()))
        worker = await self._child(index, lambda fd: f"from modelkiln.serve.workers import worker_main; worker_main({fd})",
                                   self._handlers(), {"index": index, "settings": settings.model_dump(mode="json")},
                                   {ENGINE_ADDRESS: self.engine_address} if self.engine_address else {})
        self.workers[index] = worker
        asyncio.ensure_future(self._watch(worker))
        return worker

    async def _child(self, index: int, code: Callable[[int], str], handlers: dict[str, Callable[..., Awaitable[Any]]],
                     start: dict[str, Any], env: dict[str, str]) -> Worker:
        """A child process (a worker, or the engine process): ``python -c code(fd)``, ``fd`` its end of a
        socket pair, in a session of its own (Ctrl-C reaches the supervisor, which stops it), its metrics
        in the shared folder; ``start`` sent on its channel first."""
        ours, theirs = socket.socketpair()
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-c", code(theirs.fileno()), pass_fds=[theirs.fileno()], start_new_session=True,
            env={**os.environ, MULTIPROCESS_DIR: self.metrics_dir, **env})  # read by its prometheus_client at import
        theirs.close()
        child = Worker(index, process, None, asyncio.get_running_loop().create_future())  # type: ignore[arg-type]  # channel next: it needs the worker
        child.loaded.add_done_callback(lambda f: f.cancelled() or f.exception())  # a failure nobody awaits: no warning
        child.channel = Channel(Connection(ours.detach()), handlers, on_message=lambda m: self._message(child, m))
        child.channel.send(start)
        child.channel.attach()
        return child

    def _serve(self, worker: Worker) -> None:
        worker.channel.send(["serve"])
        worker.serving = True
        self.failures.pop(worker.index, None)

    def _message(self, worker: Worker, message: list) -> None:
        if message == ["loaded"] and not worker.loaded.done():
            worker.loaded.set_result(None)
        elif message[0] == "failed" and not worker.loaded.done():
            worker.loaded.set_exception(KilnError(message[1]))

    async def _watch(self, worker: Worker) -> None:
        code = await worker.process.wait()
        worker.channel.close()
        if not worker.loaded.done():
            worker.loaded.set_exception(KilnError(
                f"worker {worker.index} exited with code {code} while loading the models"))
        if not worker.serving:  # a start that failed: the next one waits longer
            self.failures[worker.index] = self.failures.get(worker.index, 0) + 1
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(worker.process.pid, self.metrics_dir)  # its live gauges; counters stay
        if self.stopping or self.workers.get(worker.index) is not worker:
            return
        log.warning("worker %d (pid %d) exited with code %s; starting another", worker.index, worker.process.pid, code)
        await self._replace(worker.index)

    async def _replace(self, index: int) -> None:
        """A new worker in the place of one that exited, with the models served now."""
        failures = self.failures.get(index, 0)
        if failures:
            await asyncio.sleep(RESTART_DELAYS_S[min(failures, len(RESTART_DELAYS_S)) - 1])
        async with self.changing:
            if self.stopping:
                return
            worker = await self._spawn(index)
            try:
                await worker.loaded
            except KilnError as exc:
                if not self.stopping:
                    log.error("a new worker %d failed to start: %s", index, exc)
                return  # its exit starts the next try
            self._serve(worker)
        log.info("worker %d replaced (pid %d)", index, worker.process.pid)

    async def each_worker(self, op: str, *args: Any) -> dict[Worker, Exception | None]:
        """Ask every serving worker; each one's error, or None. A worker that exits meanwhile is
        left out (its replacement starts with the models served by then)."""
        workers = [w for w in self.workers.values() if w.serving and not w.channel.closed]
        results = await asyncio.gather(*(w.channel.call(op, *args) for w in workers), return_exceptions=True)
        return {w: (r if isinstance(r, Exception) else None) for w, r in zip(workers, results)
                if not isinstance(r, WorkerGone)}

    # -- what workers ask ----------------------------------------------------------------------------
    def _handlers(self) -> dict[str, Callable[..., Awaitable[Any]]]:
        return {"index": self.repository.index, "load": self.repository.load, "unload": self.repository.unload,
                "statistics": self._statistics}

    async def _statistics(self, name: str | None, version: str | None) -> list[ModelStatistics]:
        workers = [w for w in self.workers.values() if w.serving and not w.channel.closed]
        results = await asyncio.gather(*(w.channel.call("statistics", name, version) for w in workers),
                                       return_exceptions=True)
        answered = [r for r in results if not isinstance(r, WorkerGone)]
        failed = [r for r in answered if isinstance(r, Exception)]
        if failed and len(failed) == len(answered):
            raise failed[0]
        # a call's answer: a worker's rows (JSON)
        return add_statistics([statistics_from_json(cast(list[dict], r)) for r in answered if not isinstance(r, Exception)])


def run_workers(settings: ServeSettings, count: int, startup: Startup) -> int:
    """Serve with ``count`` worker processes until SIGTERM; the exit code."""
    return Supervisor(settings, count, startup).run()
