"""A Ray cluster of several nodes on this machine, for tests and benchmarks: ``ray start --head``
and ``ray start --address`` as on real machines, each node with its own resources, ports and
process session, so that one node can be lost (every process of it killed at once, SIGKILL: raylet,
workers, agents), drained (Ray's drain request, as an autoscaler sends before it removes a node) or
replaced while the others keep serving. ``kiln ray --address`` deploys to it like to any cluster.

The head reserves no CPU: it runs Ray's control plane, Serve's controller and proxy and kiln's
router, so that model replicas are only on the worker nodes, whose loss is what is tested (losing
the head loses the cluster: see docs/scale-out.md). Every node is on 127.0.0.1; Serve's proxy must
then run on the head only (``proxy_location: HeadOnly``): proxies on several nodes of one host share
the port (SO_REUSEPORT), and a client connected to a lost node's proxy would lose its connection."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import KilnError
from ..net import child_environment, free_port
from .plan import WORKER_NICENESS
from .process import session_pids

HOST = "127.0.0.1"


@dataclass
class Node:
    """One ``ray start --block`` process and everything it started (one process session)."""

    name: str
    proc: subprocess.Popen
    manager_port: int
    cpus: int
    log: Path
    folder: Path  # its --temp-dir: Ray's session and logs
    node_id: str = ""  # Ray's hex id, once the node has registered
    removed: bool = field(default=False)

    def pids(self) -> list[int]:
        """Every live process of the node's session: raylet, agents, workers (replicas)."""
        return session_pids(self.proc.pid)

    def raylet_fatal(self) -> str:
        """The raylet's fatal log lines, if it died."""
        raylet = self.folder / "session_latest" / "logs" / "raylet.out"
        try:
            lines = raylet.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return " | ".join(line for line in lines if " F " in line or "Check failed" in line)[:2000]


@dataclass(frozen=True)
class Replica:
    app: str
    id: str  # Serve's replica id, which kiln's answers carry (x-kiln-replica)
    node: Node
    pid: int


class LocalCluster:
    def __init__(self, workers: int = 3, cpus_per_worker: int = 2, env: dict[str, str] | None = None,
                 timeout: float = 120.0):
        self.root = Path(tempfile.mkdtemp(prefix="kr"))  # short: Ray's socket paths live under it
        self.gcs_port = free_port()
        self.address = f"{HOST}:{self.gcs_port}"
        self.dashboard = f"http://{HOST}:{free_port()}"  # Ray's state API (which replica runs where)
        # A busy machine starts a node slowly: under load 10 on 2 cores, `ray start` gave up on registering
        # after its default 30 s. (Its raylet also gives its dashboard agent 30 s to start, which no setting
        # changes: a node started while a benchmark loads the same 2 cores failed that way, three times out
        # of four; start the nodes a run needs before its load.)
        # Authentication off, whatever the home folder holds: with RAY_AUTH_MODE unset, `ray start --head`
        # turns token authentication on when ~/.ray/auth_token exists (an earlier ray.init() writes it), but
        # the nodes started with --address and this process's own GCS client then send no token, and
        # every node fails to register ("InvalidAuthToken"). A cluster on 127.0.0.1 for tests needs none.
        self.env = child_environment(RAY_USAGE_STATS_ENABLED="0", RAY_raylet_start_wait_time_s=str(int(timeout)),
                                     RAY_worker_niceness=WORKER_NICENESS, RAY_AUTH_MODE="disabled", **(env or {}))
        self.timeout = timeout
        self.nodes: list[Node] = []
        self._count = 0
        try:
            self.head = self._start("head", ["--head", "--port", str(self.gcs_port), "--num-cpus", "0",
                                             "--include-dashboard", "true", "--dashboard-host", HOST,
                                             "--dashboard-port", self.dashboard.rsplit(":", 1)[1]], 0)
            for _ in range(workers):
                self.add_node(cpus_per_worker)
        except BaseException:
            self.stop()
            raise

    # -- nodes ---------------------------------------------------------------------------------------
    def add_node(self, cpus: int = 2) -> Node:
        """A new worker node; returns once it has registered with the head."""
        self._count += 1
        return self._start(f"worker-{self._count}", ["--address", self.address, "--num-cpus", str(cpus),
                                                       "--resources", json.dumps({f"kiln_node_{self._count}": 1})],
                           cpus)

    def workers(self) -> list[Node]:
        """The worker nodes still in the cluster."""
        return [n for n in self.nodes if n is not self.head and not n.removed]

    def replicas(self) -> list[Replica]:
        """The Serve replicas alive now: application, replica id (kiln's ``x-kiln-replica``), node and
        process, from Ray's state API (``ray list actors``; Serve names a replica's actor
        ``SERVE_REPLICA::APP#DEPLOYMENT#ID``)."""
        from ray.util.state import list_actors

        by_id = {n.node_id: n for n in self.nodes if n.node_id}
        found = []
        for actor in list_actors(address=self.dashboard, filters=[("state", "=", "ALIVE")], limit=10_000,
                                 raise_on_missing_output=False):
            if actor.name and actor.name.startswith("SERVE_REPLICA::") and actor.node_id in by_id:
                app, _, replica = actor.name.removeprefix("SERVE_REPLICA::").split("#")
                assert actor.pid is not None  # an ALIVE actor has its process
                found.append(Replica(app, replica, by_id[actor.node_id], actor.pid))
        return found

    def kill(self, node: Node, pids: list[int] | None = None) -> list[int]:
        """Lose ``node`` at once: SIGKILL to each of its processes (raylet, agents, replicas' workers)
        before any can react (``pids``: found before, by ``node.pids()``). Returns the pids killed."""
        pids = node.pids() if pids is None else pids
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        node.proc.wait()
        node.removed = True
        return pids

    def drain(self, node: Node, deadline_s: int = 60) -> None:
        """Ask Ray to drain ``node`` (what an autoscaler does before it terminates one): Serve moves
        its replicas to other nodes, and stops the old ones gracefully."""
        r = subprocess.run([_ray(), "drain-node", "--address", self.address, "--node-id", node.node_id,
                            "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "kiln: drained",
                            "--deadline-remaining-seconds", str(deadline_s)],
                           env=self.env, capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            raise KilnError(f"ray drain-node failed: {r.stderr[-2000:]}")

    def stop_node(self, node: Node, timeout: float = 60.0) -> None:
        """Take ``node`` out the way `ray stop` does (SIGTERM: its processes end themselves)."""
        if node.proc.poll() is None:
            node.proc.send_signal(signal.SIGTERM)  # `ray start --block` stops what it started
        try:
            node.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        for pid in node.pids():  # anything left behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        node.removed = True

    def stop(self) -> None:
        """Stop every node, workers first; then remove the cluster's folder."""
        for node in reversed(self.nodes):
            if not node.removed:
                self.stop_node(node, timeout=30.0)
        shutil.rmtree(self.root, ignore_errors=True)

    def session_pids(self) -> list[int]:
        """Processes of the cluster still running (after ``stop``: none)."""
        return [pid for node in self.nodes for pid in node.pids()]

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- starting a node -------------------------------------------------------------------------------
    def _start(self, name: str, args: list[str], cpus: int, attempts: int = 3) -> Node:
        """Start a node and wait until it has registered. On a busy machine a raylet sometimes dies
        while starting (waiting for its agents); the node is then started again, on new ports."""
        for attempt in range(1, attempts + 1):
            node = self._launch(name, args, cpus, attempt)
            try:
                node.node_id = self._wait_registered(node)
                return node
            except KilnError as exc:
                self.nodes.remove(node)
                for pid in node.pids():
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                node.proc.wait()
                if attempt == attempts:
                    raise
                print(f"LocalCluster: {exc}; starting {name} again", file=sys.stderr, flush=True)
        raise AssertionError("unreachable")

    def _launch(self, name: str, args: list[str], cpus: int, attempt: int) -> Node:
        manager_port = free_port()
        folder = self.root / (name if attempt == 1 else f"{name}.{attempt}")
        ports = ["--node-ip-address", HOST, "--node-manager-port", str(manager_port),
                 "--object-manager-port", str(free_port()), "--metrics-export-port", str(free_port()),
                 "--dashboard-agent-listen-port", str(free_port()), "--dashboard-agent-grpc-port", str(free_port()),
                 "--runtime-env-agent-port", str(free_port()), "--temp-dir", str(folder)]
        if "--head" in args:
            ports += ["--ray-client-server-port", str(free_port())]
        log = folder.with_suffix(folder.suffix + ".log")
        with log.open("w") as out:
            proc = subprocess.Popen([_ray(), "start", "--block", "--disable-usage-stats", *args, *ports],
                                    env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        node = Node(name, proc, manager_port, cpus, log, folder)
        self.nodes.append(node)
        return node

    def _wait_registered(self, node: Node) -> str:
        from ray._raylet import GcsClient  # type: ignore[attr-defined]  # missing from ray's _raylet.pyi

        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if node.proc.poll() is not None:
                raise KilnError(f"ray start ({node.name}) exited with {node.proc.returncode}: "
                                f"{node.log.read_text(errors='replace')[-3000:]}")
            if fatal := node.raylet_fatal():
                raise KilnError(f"the raylet of {node.name} failed: {fatal}")
            try:
                for node_id, info in GcsClient(address=self.address).get_all_node_info(timeout=5).items():
                    if info.node_manager_port == node.manager_port and info.state == 0:  # ALIVE
                        return node_id.hex()
            except Exception:  # noqa: BLE001 - the head's GCS is not up yet
                pass
            time.sleep(0.5)
        raise KilnError(f"node {node.name} did not register within {self.timeout:.0f}s: "
                        f"{node.log.read_text(errors='replace')[-2000:]}")


def _ray() -> str:
    return str(Path(sys.executable).parent / "ray")


__all__ = ["LocalCluster", "Node", "Replica"]
