"""The Ray Serve deployments (``plan.py`` says how they are laid out and why).

``ModelReplica``: one model's replica, the whole ``kiln serve`` HTTP front-end
(``serve.http.app.create_app``) over a data plane built in the replica (``build_dataplane``), with its
own batcher and engine threads sized from the replica's CPU share. ``forward`` runs that app for a
request the router passes on (or Ray's proxy hands it the requests of ``/v2/models/{name}/...``
when the model has that route prefix); ``generate`` streams one generation request's deltas to the
router's ``RemoteStream``. Every answer carries ``x-kiln-replica``, the replica's id, so that a
client can see which replica answered.

``Router``: the ingress at ``/`` (``ingress.py``)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any, cast

import ray
from ray import serve

from ..generation.sampling import SamplingParams
from ..generation.sequence import Delta
from ..serve.http.app import create_app
from ..serve.dataplane import DataPlane, build_dataplane
from ..serve.settings import ModelSpec, ServeSettings
from .ingress import RouterApp, without_request_id
from .plan import MODEL_DEPLOYMENT, ROUTER_DEPLOYMENT, Failover
from .liveness import Beacon
from .remote_generation import Taken, replica_deltas

log = logging.getLogger("modelkiln.ray")

REPLICA_HEADER = b"x-kiln-replica"


def replica_settings(values: dict[str, Any], model: dict[str, Any] | None = None) -> ServeSettings:
    """The settings a replica runs with, validated by the declaration (a bad value in a hand-edited
    config fails the replica's start with the setting's name)."""
    settings = ServeSettings().replace(**values)
    if model is not None:
        settings = settings.with_models((ModelSpec(model["name"], model["path"], model.get("variant")),))
    return settings


@serve.deployment(name=MODEL_DEPLOYMENT)
@serve.ingress()
class ModelReplica:
    def __init__(self, model: dict[str, Any], settings: dict[str, Any]):
        self.settings = replica_settings(settings, model)
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.plane: DataPlane | None = None
        self.beacon = Beacon(ray.util.get_node_ip_address())  # the router's connection to it ends with this process

    def __serve_build_asgi_app__(self) -> Any:
        # Blocking (loads and warms the model) before the replica takes requests, as kiln serve does
        # before binding its port; Serve runs the app's lifespan (which starts and stops the batchers).
        self.plane = build_dataplane(self.settings)
        model = next(iter(self.plane.models.values()))
        log.info("replica %s: %s (%s), %d engine instance(s) x %d thread(s) on %s cpu(s)", self.replica, model.name,
                 model.variant.name, model.instances, model.threads, self.settings.cpus)
        return without_request_id(create_app(self.plane), (REPLICA_HEADER, self.replica.encode()))

    def ready(self) -> bool:
        return self.plane is not None and self.plane.ready()

    async def generate(self, prompt_ids: list[int], params: SamplingParams, seed: int, resume_ids: list[int],
                       timeout_s: float) -> AsyncIterator[Taken | list[Delta]]:
        """One generation request of the router's ``RemoteStream`` (``remote_generation.replica_deltas``).
        ``resume_ids``: the answer's tokens already sent, by a lost replica or the client."""
        assert self.plane is not None
        taken = Taken(self.replica, await self.beacon.address())
        items = replica_deltas(self.plane, taken, prompt_ids, params, seed, resume_ids, timeout_s)
        async with aclosing(items):
            async for item in items:  # a cancelled call closes them now, which cancels the sequence
                yield item

    async def forward(self, method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]],
                      body: bytes) -> AsyncIterator[dict[str, Any] | tuple[bytes, bool]]:
        """Run one HTTP request through this replica's app; yields the response start
        (``{"status", "headers"}``), then its body chunks as (bytes, more to come): the router
        knows when the answer is whole, whatever happens to this replica after."""
        messages: asyncio.Queue[dict | None] = asyncio.Queue()
        answered = asyncio.Event()
        body_sent = False

        async def receive() -> dict:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await answered.wait()  # the router's client is still there until the answer is out
            return {"type": "http.disconnect"}

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query,
                 "root_path": "", "headers": headers, "client": None, "server": None, "state": {}}
        task = asyncio.create_task(self.app(scope, receive, messages.put))  # type: ignore[attr-defined]  # serve.ingress adds app
        task.add_done_callback(lambda _: messages.put_nowait(None))
        try:
            while (message := await messages.get()) is not None:
                if message["type"] == "http.response.start":
                    yield {"status": message["status"], "headers": list(message.get("headers", []))}
                elif message["type"] == "http.response.body":
                    more = message.get("more_body", False)
                    if message.get("body") or not more:
                        yield message.get("body", b""), more
            await task  # an exception in the app is the router's 500
        finally:
            answered.set()
            if not task.done():  # the router's client left: stop the request like a disconnect would
                task.cancel()


def model_app(args: dict[str, Any]) -> Any:
    """``serve deploy``'s builder for one model (``import_path: modelkiln.ray.deployments:model_app``)."""
    return _deployment(ModelReplica).bind(args["model"], args["settings"])


@serve.deployment(name=ROUTER_DEPLOYMENT)
@serve.ingress()
class Router:
    def __init__(self, models: list[str], settings: dict[str, Any], generation: list[dict[str, Any]] | None = None,
                 failover: dict[str, Any] | None = None):
        self.models = list(models)
        self.generation = list(generation or [])
        self.settings = replica_settings(settings)
        self.failover = Failover(**(failover or {}))

    def __serve_build_asgi_app__(self) -> Any:
        handles = {m: serve.get_deployment_handle(MODEL_DEPLOYMENT, app_name=m) for m in self.models}
        return RouterApp(self.models, self.generation, self.settings, handles, self.failover)


def router_app(args: dict[str, Any]) -> Any:
    """``serve deploy``'s builder for the router (``import_path: modelkiln.ray.deployments:router_app``)."""
    return _deployment(Router).bind(args["models"], args["settings"], args.get("generation", []), args.get("failover"))


def build(application: dict[str, Any]) -> Any:
    """One application of ``plan()``'s config, bound with its deployment options, as ``serve
    deploy`` would build it from the YAML."""
    options = dict(application["deployments"][0])
    name = options.pop("name")
    deployment = {MODEL_DEPLOYMENT: ModelReplica, ROUTER_DEPLOYMENT: Router}[name]
    args = application["args"]
    if deployment is ModelReplica:
        return _deployment(ModelReplica).options(**options).bind(args["model"], args["settings"])
    return _deployment(Router).options(**options).bind(args["models"], args["settings"], args.get("generation", []),
                                                       args.get("failover"))


def _deployment(cls: object) -> serve.Deployment:
    """``cls`` as what ``@serve.deployment`` made of it (mypy types a decorated class as the class)."""
    return cast(serve.Deployment, cls)


__all__ = ["ModelReplica", "Router", "build", "model_app", "router_app", "REPLICA_HEADER"]
