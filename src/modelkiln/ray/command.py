"""``kiln ray ARTIFACT...`` (deploy on Ray Serve and stay up) and ``kiln ray config ARTIFACT...``
(write the Serve config YAML for ``serve deploy``). Both take every ``kiln serve`` setting that
means something per replica (derived from the ``ServeSettings`` declaration, like kiln serve's),
plus the scaling options; ``plan.plan()`` turns them into one config, which ``run`` deploys and
``config`` writes. Ray is imported only by ``run``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import typer
from typer.core import TyperGroup

from ..derived_options import DERIVED, DerivedOptionsCommand, keyword, typer_params
from ..errors import KilnError
from ..extras import install_hint
from ..model_arg import PRECISION, TASK


class RunByDefault(TyperGroup):
    """``kiln ray ARTIFACT...`` means ``kiln ray run ARTIFACT...``: the group's first argument is
    a command name only when it names one (``config``, ``run``)."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h"):
            args = ["run", *args]
        return super().parse_args(ctx, args)


ray_app = typer.Typer(cls=RunByDefault, no_args_is_help=True, add_completion=False, rich_markup_mode=None,
                      help="Serve artifacts on Ray Serve: one deployment per model, each replica a kiln serve "
                           "data plane and batcher, behind Ray's HTTP proxy.")


class RayCommand(DerivedOptionsCommand):
    """The command's own options plus one per declared setting a replica uses (host and port are
    the Ray proxy's)."""

    insert_before = "replicas"

    def derive(self) -> list[Any]:
        from ..serve.command import _setting_option
        from ..serve.settings import declared
        from .plan import NOT_PER_REPLICA

        names = [n for n in declared() if n not in NOT_PER_REPLICA or n in ("host", "port")]
        return typer_params([keyword(name, *_setting_option(name)) for name in names])


ARTIFACTS = typer.Argument(..., help="Artifact folders or models (a .gguf file, a Hugging Face folder or hub id: "
                                     "converted once into the model cache), or NAME=PATH (one Serve application per "
                                     "model).", show_default=False)
REPLICAS = typer.Option(None, help="Replicas per model (default 1; or autoscale with --min/--max-replicas).",
                        show_default=False)
MIN_REPLICAS = typer.Option(None, help="Autoscaling: fewest replicas per model.", show_default=False)
MAX_REPLICAS = typer.Option(None, help="Autoscaling: most replicas per model.", show_default=False)
TARGET = typer.Option(16.0, help="Autoscaling: requests in flight per replica the autoscaler aims at.")
CPUS = typer.Option(1, help="CPUs each replica reserves in Ray; its engine threads are sized from them.")
PER_NODE = typer.Option(None, help="At most this many replicas of a model on one node (1: a node's loss takes "
                                   "one replica of each model).", show_default=False)
PROXY = typer.Option("HeadOnly", help="Where Ray's HTTP proxies run: HeadOnly (next to the router, which every "
                                      "request goes through) or EveryNode.")
RETRIES = typer.Option(3, help="Times the router sends a request again, or continues a stream, on another "
                               "replica after its replica was lost.")
WINDOW = typer.Option(30.0, help="Seconds after a replica's loss the router waits for another to take the "
                                 "request (then 503, or an error event in a stream).")
DIRECT = typer.Option(False, "--direct-encoders", help="Encoder models' routes go from Ray's proxy straight to "
                                                        "a replica: one hop less, no retry when it is lost.")
CONFIG = typer.Option(None, help="JSON settings file (as kiln serve --config); env vars and flags override it.",
                      show_default=False)


def _plan(ctx: typer.Context, artifacts: list[str], replicas: Optional[int], min_replicas: Optional[int],
          max_replicas: Optional[int], target: float, cpus: int, per_node: Optional[int], proxy: str, retries: int,
          window: float, direct: bool, config: Optional[Path], task: Optional[str],
          precision: Optional[str]) -> dict[str, Any]:
    from ..model_arg import model_argument
    from ..serve.config_file import read_serve_config
    from ..serve.settings import ServeSettings, parse_model_arg
    from .plan import Failover, Ingress, Scaling, plan

    flags = ctx.meta.get(DERIVED, {})
    settings = ServeSettings.from_env(config=read_serve_config(config) if config else None, **flags)
    settings = settings.with_models(tuple(parse_model_arg(model_argument(a, task, precision), settings.variant)
                                          for a in artifacts))
    autoscale = min_replicas is not None or max_replicas is not None
    if autoscale and replicas is not None:
        raise typer.BadParameter("give --replicas or --min-replicas/--max-replicas, not both")
    scaling = Scaling(replicas=None if autoscale else (replicas or 1), min_replicas=min_replicas,
                      max_replicas=max_replicas, target_ongoing_requests=target, cpus_per_replica=cpus,
                      max_replicas_per_node=per_node)
    ingress = Ingress(Failover(retries, window), proxy, direct)
    return plan(settings, scaling, ingress)


@ray_app.command("run", cls=RayCommand)
def run(
    ctx: typer.Context,
    artifacts: list[str] = ARTIFACTS,
    replicas: Optional[int] = REPLICAS,
    min_replicas: Optional[int] = MIN_REPLICAS,
    max_replicas: Optional[int] = MAX_REPLICAS,
    target_ongoing_requests: float = TARGET,
    cpus_per_replica: int = CPUS,
    max_replicas_per_node: Optional[int] = PER_NODE,
    proxy_location: str = PROXY,
    retries: int = RETRIES,
    retry_window_s: float = WINDOW,
    direct_encoders: bool = DIRECT,
    address: Optional[str] = typer.Option(
        None, help="A running Ray cluster (host:port, or 'auto'). Default: start a local one in this process, "
                   "stopped when it exits.", show_default=False),
    num_cpus: Optional[int] = typer.Option(None, help="CPUs of the local cluster (default: the host's).",
                                           show_default=False),
    config: Optional[Path] = CONFIG,
    task: Optional[str] = TASK,
    precision: Optional[str] = PRECISION,
) -> None:
    """Deploy the artifacts on Ray Serve and serve until interrupted (then delete the applications)."""
    from .deploy import serve_until_interrupted

    serve_until_interrupted(_plan(ctx, artifacts, replicas, min_replicas, max_replicas, target_ongoing_requests,
                                  cpus_per_replica, max_replicas_per_node, proxy_location, retries, retry_window_s,
                                  direct_encoders, config, task, precision), address, num_cpus)


@ray_app.command("config", cls=RayCommand)
def write_config(
    ctx: typer.Context,
    artifacts: list[str] = ARTIFACTS,
    replicas: Optional[int] = REPLICAS,
    min_replicas: Optional[int] = MIN_REPLICAS,
    max_replicas: Optional[int] = MAX_REPLICAS,
    target_ongoing_requests: float = TARGET,
    cpus_per_replica: int = CPUS,
    max_replicas_per_node: Optional[int] = PER_NODE,
    proxy_location: str = PROXY,
    retries: int = RETRIES,
    retry_window_s: float = WINDOW,
    direct_encoders: bool = DIRECT,
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="YAML file to write (default: standard output).",
                                       show_default=False),
    rayservice: Optional[str] = typer.Option(
        None, help="Write a KubeRay RayService of this name instead (the cluster and the config in one manifest: "
                   "kubectl apply -f FILE).", show_default=False),
    image: str = typer.Option("rayproject/ray:2.60.0-py311", help="RayService: the pods' image (it must have "
                                                                   "modelkiln[ray,serve] installed)."),
    workers: Optional[int] = typer.Option(None, help="RayService: worker pods (default: the most replicas of a "
                                                     "model, plus one to take a lost pod's replicas).",
                                          show_default=False),
    worker_cpus: Optional[int] = typer.Option(None, help="RayService: CPUs per worker pod (default: one replica of "
                                                         "each model).", show_default=False),
    worker_memory: str = typer.Option("4Gi", help="RayService: memory per worker pod."),
    volume: Optional[str] = typer.Option(None, help="RayService: a PersistentVolumeClaim holding the artifacts, "
                                                    "mounted at their folder's path in every pod.", show_default=False),
    config: Optional[Path] = CONFIG,
    task: Optional[str] = TASK,
    precision: Optional[str] = PRECISION,
) -> None:
    """Write the Serve config YAML for `serve deploy FILE` on an existing cluster, or with
    --rayservice a KubeRay RayService (artifact paths are absolute: every node must see the same
    folders)."""
    try:
        import yaml
    except ImportError:
        raise KilnError(f"kiln ray config needs PyYAML: {install_hint('ray')}") from None

    plan = _plan(ctx, artifacts, replicas, min_replicas, max_replicas, target_ongoing_requests, cpus_per_replica,
                 max_replicas_per_node, proxy_location, retries, retry_window_s, direct_encoders, config, task,
                 precision)
    models = len(plan["applications"]) - 1
    if rayservice:
        from .kuberay import rayservice as manifest

        most = max_replicas or replicas or 1
        service = manifest(plan, rayservice, image, workers or most + 1, worker_cpus or cpus_per_replica * models,
                           worker_memory, volume)
        text = ("# Written by `kiln ray config --rayservice`; apply with: kubectl apply -f FILE\n"
                + yaml.safe_dump(service, sort_keys=False, default_flow_style=False))
        what = f"RayService {rayservice} ({models} model application(s) and the router); apply with: kubectl apply -f"
    else:
        text = ("# Written by `kiln ray config`; deploy with: serve deploy FILE\n"
                + yaml.safe_dump(plan, sort_keys=False, default_flow_style=False))
        what = f"{models} model application(s) and the router; deploy with: serve deploy"
    if out is None:
        sys.stdout.write(text)
    else:
        out.write_text(text)
        print(f"Wrote {out}: {what} {out}", file=sys.stderr)
