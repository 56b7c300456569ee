"""``plan()``'s Serve config inside a KubeRay ``RayService`` (``kiln ray config --rayservice``):
KubeRay runs the cluster (a head pod, a group of worker pods) and deploys the config on it, and
recreates a lost pod, the way Serve recreates a lost replica.

The head pod reserves no CPU for replicas (``num-cpus: 0``): it runs Ray's control plane, Serve's
proxy and controller and kiln's router, whose loss loses every connection; the model replicas run
on the workers, whose loss the router survives. The artifacts must be at the same absolute paths
in every pod: ``volume`` names a PersistentVolumeClaim mounted at the folder that holds them all."""

from __future__ import annotations

import os
from typing import Any

import yaml

from ..errors import KilnError
from .plan import WORKER_NICENESS

API_VERSION = "ray.io/v1"
SERVE_PORT = 8000


def rayservice(config: dict[str, Any], name: str, image: str, workers: int, worker_cpus: int,
               worker_memory: str = "4Gi", volume: str | None = None) -> dict[str, Any]:
    """The RayService manifest serving ``config`` (``plan()``'s)."""
    if workers < 1 or worker_cpus < 1:
        raise KilnError("--workers and --worker-cpus must be at least 1")
    serve_config = {**config, "http_options": {"host": "0.0.0.0", "port": SERVE_PORT}}  # the pod's Service routes to it
    mounts: list[dict[str, Any]] = []
    volumes: list[dict[str, Any]] = []
    if volume:
        paths = [a["args"]["model"]["path"] for a in config["applications"] if "model" in a["args"]]
        folder = os.path.commonpath([os.path.dirname(p) for p in paths])
        mounts = [{"name": "artifacts", "mountPath": folder, "readOnly": True}]
        volumes = [{"name": "artifacts", "persistentVolumeClaim": {"claimName": volume, "readOnly": True}}]

    def pod(container: str, cpus: int, memory: str, ports: list[dict[str, Any]]) -> dict[str, Any]:
        spec: dict[str, Any] = {"containers": [{
            "name": container, "image": image, "ports": ports, "volumeMounts": mounts,
            # the replicas and the router at the default priority, not Ray's nice 15 (plan.WORKER_NICENESS)
            "env": [{"name": "RAY_worker_niceness", "value": WORKER_NICENESS}],
            "resources": {"requests": {"cpu": str(cpus), "memory": memory},
                          "limits": {"cpu": str(cpus), "memory": memory}}}]}
        if volumes:
            spec["volumes"] = volumes
        return {"spec": spec}

    head_ports = [{"containerPort": 6379, "name": "gcs-server"}, {"containerPort": 8265, "name": "dashboard"},
                  {"containerPort": 10001, "name": "client"}, {"containerPort": SERVE_PORT, "name": "serve"}]
    return {
        "apiVersion": API_VERSION, "kind": "RayService", "metadata": {"name": name},
        "spec": {
            "serveConfigV2": yaml.safe_dump(serve_config, sort_keys=False, default_flow_style=False),
            "rayClusterConfig": {
                "headGroupSpec": {"rayStartParams": {"num-cpus": "0"},
                                  "template": pod("ray-head", 2, "4Gi", head_ports)},
                "workerGroupSpecs": [{
                    "groupName": "replicas", "replicas": workers, "minReplicas": workers, "maxReplicas": workers,
                    "rayStartParams": {}, "template": pod("ray-worker", worker_cpus, worker_memory, []),
                }],
            },
        },
    }
