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

HOST = "127.0.0.1"


@dataclass
class Node:
    """One ``ray start --block`` process and everything it started (one process session)."""

    name: str
    proc: subprocess.Popen
    manager_port: int
    cpus: int
    log: Path
    node_id: str = ""  # Ray's hex id, once the node has registered
    removed: bool = field(default=False)

    def pids(self) -> list[int]:
        """Every live process of the node's session: raylet, agents, workers (replicas)."""
        return _session_pids(self.proc.pid)


class LocalCluster:
    def __init__(self, workers: int = 3, cpus_per_worker: int = 2, env: dict[str, str] | None = None,
                 timeout: float = 120.0):
        self.root = Path(tempfile.mkdtemp(prefix="kr"))  # short: Ray's socket paths live under it
        self.gcs_port = free_port()
        self.address = f"{HOST}:{self.gcs_port}"
        # A busy machine starts a raylet slowly: Ray's default wait (30 s) failed nodes under load 10 on 2 cores.
        self.env = child_environment(RAY_USAGE_STATS_ENABLED="0", RAY_raylet_start_wait_time_s=str(int(timeout)),
                                     **(env or {}))
        self.timeout = timeout
        self.nodes: list[Node] = []
        self._count = 0
        try:
            self.head = self._start("head", ["--head", "--port", str(self.gcs_port), "--num-cpus", "0",
                                             "--include-dashboard", "false"], 0)
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

    def kill(self, node: Node) -> list[int]:
        """Lose ``node`` at once: SIGKILL to each of its processes (raylet, agents, replicas' workers)
        before any can react. Returns the pids killed."""
        pids = node.pids()
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
    def _start(self, name: str, args: list[str], cpus: int) -> Node:
        manager_port = free_port()
        ports = ["--node-ip-address", HOST, "--node-manager-port", str(manager_port),
                 "--object-manager-port", str(free_port()), "--metrics-export-port", str(free_port()),
                 "--dashboard-agent-listen-port", str(free_port()), "--dashboard-agent-grpc-port", str(free_port()),
                 "--runtime-env-agent-port", str(free_port()), "--temp-dir", str(self.root / name)]
        if "--head" in args:
            ports += ["--ray-client-server-port", str(free_port())]
        log = self.root / f"{name}.log"
        with log.open("w") as out:
            proc = subprocess.Popen([_ray(), "start", "--block", "--disable-usage-stats", *args, *ports],
                                    env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        node = Node(name, proc, manager_port, cpus, log)
        self.nodes.append(node)
        node.node_id = self._wait_registered(node)
        return node

    def _wait_registered(self, node: Node) -> str:
        from ray._raylet import GcsClient

        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if node.proc.poll() is not None:
                raise KilnError(f"ray start ({node.name}) exited with {node.proc.returncode}: "
                                f"{node.log.read_text(errors='replace')[-3000:]}")
            try:
                for node_id, info in GcsClient(address=self.address).get_all_node_info(timeout=5).items():
                    if info.node_manager_port == node.manager_port and info.state == 0:  # ALIVE
                        return node_id.hex()
            except Exception:  # noqa: BLE001 - the head's GCS is not up yet
                pass
            time.sleep(0.5)
        raise KilnError(f"node {node.name} did not register within {self.timeout:.0f}s: "
                        f"{node.log.read_text(errors='replace')[-3000:]}")


def _ray() -> str:
    return str(Path(sys.executable).parent / "ray")


def _session_pids(session: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[3]) == session and fields[0] != "Z":  # field 6 of stat: the session id
            pids.append(int(entry.name))
    return pids


__all__ = ["LocalCluster", "Node"]
