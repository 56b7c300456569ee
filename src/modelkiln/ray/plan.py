"""What a Ray Serve deployment of modelkiln looks like, as plain data (no Ray import).

One Serve application per model, whose replicas are each a whole modelkiln data plane and batcher
(``serve.http.app.create_app``), so a replica batches its share of the traffic exactly as ``kiln serve``
does: there is no second batching layer.

One more application, ``kiln``, at ``/``: the router, on the head node, is the ingress. It answers
what names no model (health, server metadata, OpenAI's model list), runs the generation routes
itself over the model's replicas (OpenAI completions and chat, Triton's generate and
generate_stream, OIP infer: ``remote_generation.py``), so that a stream whose replica is lost
goes on on another, and forwards every other model route to a replica through a deployment
handle, sending it again to another when its replica is lost before answering
(``failover.py``). With ``direct_encoders``, an encoder model's application keeps the route
prefix ``/v2/models/{name}`` instead: Ray's proxy matches the longest prefix and sends those
requests straight to a replica (one hop less, no retry).

``kiln ray`` deploys this plan; ``kiln ray config`` writes it as the YAML ``serve deploy`` takes
(and inside a KubeRay RayService: ``kuberay.py``). All come from ``plan()``, so they cannot drift
apart."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import KilnError
from ..manifest import Manifest
from ..serve.settings import ModelSpec, ServeSettings
from ..tasks.text_generation import is_generation

MODEL_DEPLOYMENT = "ModelReplica"
ROUTER_DEPLOYMENT = "Router"
ROUTER_APP = "kiln"
MODEL_BUILDER = "modelkiln.ray.deployments:model_app"
ROUTER_BUILDER = "modelkiln.ray.deployments:router_app"
# Settings a replica must not take from the command line: Ray's proxy owns the HTTP port, and a
# replica opens no gRPC port of its own.
NOT_PER_REPLICA = ("host", "port", "grpc_port", "models", "model_repository", "model_control_mode",
                   "repository_poll_s", "cpus")
# Ray's own resource on the head node: the router runs there, next to Serve's controller and proxy,
# so that losing any other node leaves every connection and stream in place.
HEAD_NODE = "node:__internal_head__"
PROXY_LOCATIONS = ("EveryNode", "HeadOnly")


@dataclass(frozen=True)
class Failover:
    """How the router goes on when a replica is lost under a request (``failover.py``): at most
    ``retries`` more attempts, each waiting at most ``window_s`` from the loss for a live replica
    (Ray replaces a lost replica in tens of seconds: a model load on another node)."""

    retries: int = 3
    window_s: float = 30.0

    def check(self) -> None:
        if self.retries < 0:
            raise KilnError("--retries must be at least 0")
        if not self.window_s > 0:
            raise KilnError("--retry-window-s must be more than 0")


@dataclass(frozen=True)
class Ingress:
    """The router and Ray's proxies. ``proxy_location``: Serve's. ``HeadOnly`` by default: every
    request goes through the router on the head node, so a proxy on another node only adds a hop,
    and a lost node's proxy takes its clients' connections with it (on one host, proxies of several
    nodes share the port: SO_REUSEPORT). ``EveryNode`` spreads the proxies' HTTP work, which pays
    with ``direct_encoders``: encoder models' routes then go from the proxy straight to a replica
    (one hop, no retry when it is lost)."""

    failover: Failover = Failover()
    proxy_location: str = "HeadOnly"
    direct_encoders: bool = False

    def check(self) -> None:
        self.failover.check()
        if self.proxy_location not in PROXY_LOCATIONS:
            raise KilnError(f"--proxy-location must be one of {', '.join(PROXY_LOCATIONS)}")


@dataclass(frozen=True)
class Scaling:
    """Replicas per model: a fixed count, or Ray's autoscaler between ``min_replicas`` and
    ``max_replicas`` aiming at ``target_ongoing_requests`` per replica."""

    replicas: int | None = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    # A replica batches: several requests waiting in it is its normal working state, not a sign of
    # overload, so the target is well above Ray's default of 2 (not tuned: pass your own).
    target_ongoing_requests: float = 16.0
    cpus_per_replica: int = 1
    # Ray's default (5) would cap what a replica's batcher ever sees at 5 requests; the replica's
    # own queue limit (max_queue_size, answered 503 + Retry-After) is the back-pressure instead.
    max_ongoing_requests: int = 1024
    # At most this many of a model's replicas on one node (Serve's max_replicas_per_node): with 1,
    # a node's loss takes one replica of each model, never all of them.
    max_replicas_per_node: int | None = None

    def check(self) -> None:
        autoscale = self.min_replicas is not None or self.max_replicas is not None
        if autoscale:
            if self.min_replicas is None or self.max_replicas is None:
                raise KilnError("autoscaling needs both --min-replicas and --max-replicas")
            if not 0 <= self.min_replicas <= self.max_replicas:
                raise KilnError(f"--min-replicas {self.min_replicas} must be between 0 and --max-replicas {self.max_replicas}")
            if self.max_replicas < 1:
                raise KilnError("--max-replicas must be at least 1")
        if not autoscale and (self.replicas is None or self.replicas < 1):
            raise KilnError("--replicas must be at least 1")
        if self.cpus_per_replica < 1:
            raise KilnError("--cpus-per-replica must be at least 1")
        if self.max_replicas_per_node is not None and self.max_replicas_per_node < 1:
            raise KilnError("--max-replicas-per-node must be at least 1")

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None

    def model_deployment(self) -> dict[str, Any]:
        """The model deployment's Serve options (the ``deployments:`` entry of the config)."""
        options: dict[str, Any] = {"name": MODEL_DEPLOYMENT, "max_ongoing_requests": self.max_ongoing_requests}
        if self.autoscaling:
            options["autoscaling_config"] = {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                                             "target_ongoing_requests": self.target_ongoing_requests}
        else:
            options["num_replicas"] = self.replicas
        if self.max_replicas_per_node is not None:
            options["max_replicas_per_node"] = self.max_replicas_per_node
        # The engine's threads come from the replica's settings (cpus); these cap the libraries
        # that size their own pools from the host's cores (the tokenizer's rayon pool, OpenMP).
        threads = str(self.cpus_per_replica)
        options["ray_actor_options"] = {"num_cpus": self.cpus_per_replica, "runtime_env": {"env_vars": {
            "RAYON_NUM_THREADS": threads, "OMP_NUM_THREADS": threads}}}
        return options


# How long the router's Ray core waits, once a call's connection to a replica broke, for Ray to say
# whether the replica died, before it raises ActorUnavailableError (Ray's default: 1 s). The router
# then sends the request to another replica at once, so this is most of the time a stream stalls when
# its replica's node is lost: 1.75 s with the default, 0.17 s with 100 ms (a SIGKILLed node, one machine).
DEATH_INFO_WAIT_MS = "100"

# Ray starts its worker processes (Serve's replicas, kiln's router, Serve's proxy and controller) at
# nice 15, below its own daemons, so that they stay responsive under batch work. For serving it is the
# other way round: on the fault benchmark's 2 shared cores, every stream stalled together for seconds
# while Ray's daemons worked on a node's loss and a replacement's start. So workers run at the default
# priority, as kiln serve does: kiln ray's local cluster, LocalCluster's nodes and the KubeRay manifest
# set it (a running cluster given by --address keeps what its nodes were started with).
WORKER_NICENESS = "0"


def router_deployment() -> dict[str, Any]:
    # It reads requests, tokenizes generation prompts and awaits model replicas: no CPU reserved, so
    # a cluster's cores all go to model replicas (Serve reserves one per replica by default). On the
    # head node, whose loss loses the cluster anyway; one thread for the tokenizer's own pool.
    env = {"RAYON_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
           "RAY_timeout_ms_task_wait_for_death_info": DEATH_INFO_WAIT_MS}
    return {"name": ROUTER_DEPLOYMENT, "num_replicas": 1, "max_ongoing_requests": 4096,
            "ray_actor_options": {"num_cpus": 0, "resources": {HEAD_NODE: 0.001}, "runtime_env": {"env_vars": env}}}


def replica_settings(settings: ServeSettings, scaling: Scaling) -> dict[str, Any]:
    """The settings each replica runs with, as the JSON-able values that differ from the defaults
    (what the config file carries): the command line's, less what Ray owns, plus the replica's
    CPU share (``cpus``: the engine threads are sized from it, never from the host's cores)."""
    defaults = ServeSettings()
    values = {name: getattr(settings, name) for name in type(settings).model_fields
              if name not in NOT_PER_REPLICA and getattr(settings, name) != getattr(defaults, name)}
    return {**values, "cpus": scaling.cpus_per_replica, "grpc_port": 0}


def model_name(spec: ModelSpec) -> str:
    """The name the model is served under (NAME=PATH, else the artifact's own), needed before any
    replica starts: it is the application's route prefix."""
    manifest = Manifest.load(spec.path)  # ArtifactError (a KilnError) when it is none
    name = spec.name or manifest.name
    if not name or "/" in name:
        raise KilnError(f"model name {name!r} cannot be a route: use NAME=PATH")
    return name


def plan(settings: ServeSettings, scaling: Scaling, ingress: Ingress = Ingress()) -> dict[str, Any]:
    """The Serve config (``serve deploy``'s schema) for ``settings.models`` scaled as asked."""
    scaling.check()
    ingress.check()
    if settings.model_repository:
        raise KilnError("kiln ray serves the artifacts given: a model repository is not supported (list the folders)")
    if not settings.models:
        raise KilnError("kiln ray needs at least one artifact")
    per_replica = replica_settings(settings, scaling)
    applications: list[dict[str, Any]] = []
    names: list[str] = []
    generation: list[dict[str, Any]] = []  # the models whose generation routes the router runs
    for spec in settings.models:
        name = model_name(spec)
        if name in names:
            raise KilnError(f"two models are named '{name}': use NAME=PATH")
        names.append(name)
        model = {"name": name, "path": str(Path(spec.path).resolve()), "variant": spec.variant}
        generates = is_generation(Manifest.load(spec.path))
        if generates:
            generation.append(model)
        direct = ingress.direct_encoders and not generates
        applications.append({"name": name, "route_prefix": f"/v2/models/{name}" if direct else None,
                             "import_path": MODEL_BUILDER, "args": {"model": model, "settings": per_replica},
                             "deployments": [scaling.model_deployment()]})
    router_settings = {k: v for k, v in per_replica.items() if k != "cpus"}
    failover = {"retries": ingress.failover.retries, "window_s": ingress.failover.window_s}
    applications.append({"name": ROUTER_APP, "route_prefix": "/", "import_path": ROUTER_BUILDER,
                         "args": {"models": names, "generation": generation, "settings": router_settings,
                                  "failover": failover},
                         "deployments": [router_deployment()]})
    return {"proxy_location": ingress.proxy_location, "http_options": {"host": settings.host, "port": settings.port},
            "applications": applications}


__all__ = ["Failover", "Ingress", "Scaling", "plan", "replica_settings", "MODEL_DEPLOYMENT", "ROUTER_APP"]
