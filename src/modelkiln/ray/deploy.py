"""Deploy ``plan()``'s config on a Ray cluster from this process, and take it down on exit."""

from __future__ import annotations

import signal
import sys
import threading
import time
from typing import Any

from ..errors import KilnError
from ..extras import install_hint


def serve_until_interrupted(config: dict[str, Any], address: str | None, num_cpus: int | None) -> None:
    try:
        import ray
        from ray import serve
    except ImportError:
        raise KilnError(f"kiln ray needs Ray Serve: {install_hint('ray')}") from None
    from .deployments import build
    from .plan import WORKER_NICENESS

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    local = address is None
    # "local": always a new cluster of our own. None would attach to whatever cluster this machine ran
    # last (RAY_ADDRESS, /tmp/ray/ray_current_cluster), even a stopped one.
    # a local cluster's workers (the replicas, the router) at the default priority, not Ray's nice 15
    # (plan.WORKER_NICENESS says why); a running cluster keeps what its nodes were started with
    ray.init(address="local" if local else address, num_cpus=num_cpus if local else None,
             include_dashboard=False, log_to_driver=False, configure_logging=False,
             _system_config={"worker_niceness": int(WORKER_NICENESS)} if local else None)
    deployed: list[str] = []
    try:
        http = config["http_options"]
        serve.start(http_options={"host": http["host"], "port": http["port"]},
                    proxy_location=config["proxy_location"])
        for application in config["applications"]:  # the models first, the router (at /) last
            started = time.perf_counter()
            try:
                serve.run(build(application), name=application["name"], route_prefix=application["route_prefix"])
            except RuntimeError as exc:  # Serve's "Deploying application X failed": the cause is in the replica logs
                raise KilnError(f"{str(exc).splitlines()[0]} (the replica's error is in Ray's log folder, "
                                "session_latest/logs/serve/replica_*.log)") from None
            deployed.append(application["name"])
            replicas = _replicas(application["deployments"][0])
            where = application["route_prefix"] or "the router"
            print(f"✓ {application['name']}: {replicas} behind {where} ({time.perf_counter() - started:.1f}s)",
                  file=sys.stderr, flush=True)
        url = f"http://{http['host']}:{http['port']}"
        print(f"Serving {len(deployed) - 1} model(s) on Ray Serve at {url} "
              f"(OIP: {url}/v2/models/NAME/infer, task: .../predict, OpenAI: {url}/v1/...); Ctrl-C stops",
              file=sys.stderr, flush=True)
        while not stop.wait(1.0):
            pass
    finally:
        print("stopping: deleting the applications", file=sys.stderr, flush=True)
        for name in reversed(deployed):
            serve.delete(name)
        if local:
            serve.shutdown()
        ray.shutdown()


def _replicas(deployment: dict[str, Any]) -> str:
    cpus = deployment["ray_actor_options"]["num_cpus"]
    scaling = deployment.get("autoscaling_config")
    if scaling:
        count = f"{scaling['min_replicas']}-{scaling['max_replicas']} replicas (autoscaled)"
    else:
        count = f"{deployment['num_replicas']} replica(s)"
    return f"{count}, {cpus} CPU(s) each" if cpus else count
