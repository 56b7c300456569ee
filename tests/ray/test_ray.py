"""kiln ray: the plan and config, and the router's failover with a stand-in for Serve's handle (fast);
a real Ray cluster of a head and 3 worker nodes on this machine (slow): answers equal to kiln serve's,
replicas spread over the nodes, requests spread over both replicas by their own statistics, a replica
killed under load, and the fault benchmark's short form (nodes killed and drained under load)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np
import pytest

from helpers import kiln, REPO
from modelkiln.errors import KilnError
from modelkiln.manifest import Manifest
from modelkiln.samples import SAMPLE_TEXTS
from modelkiln.serve.settings import ModelSpec, ServeSettings


@pytest.fixture(scope="module")
def emb(zoo) -> Path:
    return zoo.artifact("bert", "sentence-embeddings")


@pytest.fixture(scope="module")
def cls(zoo) -> Path:
    return zoo.artifact("bert", "text-classification")


# --- the plan and its config (no cluster) ----------------------------------------------------------


def test_replica_threads_come_from_its_cpus_not_the_host():
    assert ServeSettings(cpus=1).engine_layout() == (1, 1, 0)  # one instance, one thread, no "alone" session
    assert ServeSettings(cpus=4).engine_layout() == (2, 2, 4)
    assert ServeSettings(cpus=4, instances=1).engine_layout()[:2] == (1, 4)


def test_plan_replicas_autoscaling_and_replica_settings(emb, tiny_generation_artifact):
    from modelkiln.ray.plan import HEAD_NODE, ROUTER_APP, Failover, Ingress, Scaling, plan

    settings = ServeSettings(port=9000, threads=1, grpc_port=8001, api_key="k").with_models(
        (ModelSpec("a", str(emb)), ModelSpec("", str(emb)), ModelSpec("gen", str(tiny_generation_artifact))))
    config = plan(settings, Scaling(replicas=3, cpus_per_replica=2, max_replicas_per_node=1))
    apps = {a["name"]: a for a in config["applications"]}
    own_name = Manifest.load(emb).name  # a model given without NAME= is served under its artifact's name
    assert list(apps) == ["a", own_name, "gen", ROUTER_APP]
    first = apps["a"]
    # every request goes through the router (route_prefix None: no HTTP route of its own)
    assert first["route_prefix"] is None and first["args"]["model"]["path"] == str(emb.resolve())
    assert first["args"]["settings"] == {"api_key": "k", "threads": 1, "cpus": 2, "grpc_port": 0}  # no port/host
    deployment = first["deployments"][0]
    assert deployment["num_replicas"] == 3 and deployment["ray_actor_options"]["num_cpus"] == 2
    assert deployment["max_replicas_per_node"] == 1
    assert config["http_options"] == {"host": "127.0.0.1", "port": 9000} and config["proxy_location"] == "HeadOnly"
    router = apps[ROUTER_APP]
    assert router["route_prefix"] == "/" and router["args"]["models"] == ["a", own_name, "gen"]
    assert [m["name"] for m in router["args"]["generation"]] == ["gen"]  # the router runs its generation routes
    assert router["args"]["failover"] == {"retries": 3, "window_s": 30.0}
    assert router["deployments"][0]["ray_actor_options"]["resources"] == {HEAD_NODE: 0.001}  # on the head node
    assert router["args"]["settings"]["api_key"] == "k" and "cpus" not in router["args"]["settings"]

    direct = plan(settings, Scaling(), Ingress(Failover(1, 5.0), "EveryNode", direct_encoders=True))
    prefixes = {a["name"]: a["route_prefix"] for a in direct["applications"]}
    assert prefixes == {"a": "/v2/models/a", own_name: f"/v2/models/{own_name}", "gen": None, ROUTER_APP: "/"}
    assert direct["proxy_location"] == "EveryNode"
    for bad in (Ingress(Failover(-1)), Ingress(Failover(window_s=0)), Ingress(proxy_location="Nowhere")):
        with pytest.raises(KilnError):
            plan(settings, Scaling(), bad)

    auto = plan(settings, Scaling(replicas=None, min_replicas=1, max_replicas=4, target_ongoing_requests=8))
    deployment = auto["applications"][0]["deployments"][0]
    assert "num_replicas" not in deployment
    assert deployment["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8}

    for bad in (Scaling(replicas=None, min_replicas=3, max_replicas=2), Scaling(replicas=None, min_replicas=1),
                Scaling(replicas=0), Scaling(cpus_per_replica=0), Scaling(max_replicas_per_node=0)):
        with pytest.raises(KilnError):
            plan(settings, bad)
    with pytest.raises(KilnError, match="two models are named"):
        plan(settings.with_models((ModelSpec("a", str(emb)), ModelSpec("a", str(emb)))), Scaling())


def test_kiln_ray_config_is_a_valid_serve_deploy_file(emb, cls, tmp_path):
    yaml = pytest.importorskip("yaml")
    schema = pytest.importorskip("ray.serve.schema")
    out = tmp_path / "serve.yaml"
    r = kiln("ray", "config", f"emb={emb}", f"cls={cls}", "--min-replicas", "1", "--max-replicas", "3",
             "--cpus-per-replica", "2", "--max-batch-size", "8", "--port", "8111", "--out", str(out))
    assert r.returncode == 0, r.stderr
    config = yaml.safe_load(out.read_text())
    parsed = schema.ServeDeploySchema.model_validate(config)  # what `serve deploy` checks before deploying
    assert [a.name for a in parsed.applications] == ["emb", "cls", "kiln"]
    assert parsed.http_options.port == 8111
    assert config["applications"][0]["args"]["settings"] == {"max_batch_size": 8, "cpus": 2, "grpc_port": 0}
    # the builders the import paths name exist and accept these args
    from ray.serve._private.utils import import_attr

    for app in config["applications"]:
        assert callable(import_attr(app["import_path"]))
    r = kiln("ray", "config", str(emb), "--replicas", "2", "--min-replicas", "1", "--max-replicas", "2")
    assert r.returncode != 0 and "not both" in r.stderr


def test_kiln_ray_config_writes_a_kuberay_rayservice(emb, cls, tmp_path):
    """The same Serve config inside a KubeRay RayService: the head reserves no CPU (control plane,
    proxy, router), one worker pod per replica and one spare, the artifacts' folder mounted from a
    volume claim at the same path in every pod."""
    yaml = pytest.importorskip("yaml")
    schema = pytest.importorskip("ray.serve.schema")
    out = tmp_path / "rayservice.yaml"
    r = kiln("ray", "config", f"emb={emb}", f"cls={cls}", "--replicas", "2", "--max-replicas-per-node", "1",
             "--rayservice", "kiln", "--volume", "models", "--image", "registry.example/kiln:1", "--out", str(out))
    assert r.returncode == 0, r.stderr
    service = yaml.safe_load(out.read_text())
    assert (service["apiVersion"], service["kind"], service["metadata"]["name"]) == ("ray.io/v1", "RayService", "kiln")
    serve_config = yaml.safe_load(service["spec"]["serveConfigV2"])
    parsed = schema.ServeDeploySchema.model_validate(serve_config)
    assert [a.name for a in parsed.applications] == ["emb", "cls", "kiln"] and parsed.http_options.port == 8000
    cluster = service["spec"]["rayClusterConfig"]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    workers = cluster["workerGroupSpecs"][0]
    container = workers["template"]["spec"]["containers"][0]
    assert workers["replicas"] == 3 and container["resources"]["limits"]["cpu"] == "2"
    # replicas and router at the default priority (Ray's default would be nice 15), on every pod
    for pod in (cluster["headGroupSpec"], workers):
        assert {"name": "RAY_worker_niceness", "value": "0"} in pod["template"]["spec"]["containers"][0]["env"]
    mount = container["volumeMounts"][0]["mountPath"]
    assert all(str(Path(a.args["model"]["path"])).startswith(mount + "/") for a in parsed.applications[:2])
    assert workers["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] == "models"


# --- a real local cluster ---------------------------------------------------------------------------


@pytest.mark.slow
def test_serve_deploy_of_kiln_ray_config_on_a_ray_start_cluster(emb, tmp_path):
    """The config file on the path it is written for: `ray start --head` (its own session, ended by
    that session's id), `serve deploy FILE`, a request, `serve shutdown`. It runs before the tests of
    `kiln ray`'s own cluster on purpose: `ray start` leaves /tmp/ray/ray_current_cluster behind, and
    `kiln ray` must start a cluster of its own anyway, not attach to that stopped one."""
    pytest.importorskip("ray")
    import secrets
    import subprocess
    import sys

    from helpers import SRC
    from modelkiln.net import free_port

    bin_dir = Path(sys.executable).parent
    http_port, dashboard_port = free_port(), free_port()
    out = tmp_path / "serve.yaml"
    r = kiln("ray", "config", f"emb={emb}", "--replicas", "1", "--port", str(http_port), "--out", str(out))
    assert r.returncode == 0, r.stderr
    # the workers import modelkiln from this checkout (a real cluster has it installed); the cluster
    # and the CLI client use token authentication, with a token of this test's own (`ray start` makes
    # none: it reads ~/.ray/auth_token or RAY_AUTH_TOKEN)
    env = {**os.environ, "PYTHONPATH": str(SRC), "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    head = subprocess.Popen([str(bin_dir / "ray"), "start", "--head", "--block", "--num-cpus", "2",
                             "--port", str(free_port()), "--dashboard-port", str(dashboard_port),
                             "--include-dashboard", "true", "--disable-usage-stats"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{dashboard_port}"
    try:
        deadline = time.monotonic() + 180
        while True:  # the dashboard answers once the head is up
            deployed = subprocess.run([str(bin_dir / "serve"), "deploy", str(out), "-a", address], env=env,
                                      capture_output=True, text=True, timeout=120)
            if deployed.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(3)
        assert deployed.returncode == 0, deployed.stderr[-2000:]
        url = f"http://127.0.0.1:{http_port}"
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/v2/health/ready", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(1)
        r = post(url + "/v2/models/emb/predict", {"inputs": ["deployed by serve deploy"]})
        assert r.status_code == 200 and len(r.json()[0]) > 8
        shutdown = subprocess.run([str(bin_dir / "serve"), "shutdown", "-a", address, "-y"], env=env,
                                  capture_output=True, text=True, timeout=120)
        assert shutdown.returncode == 0, shutdown.stderr[-2000:]
    finally:
        head.send_signal(signal.SIGTERM)  # `ray start --block` stops the processes it started
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()




@pytest.fixture(scope="module")
def nodes():
    """A head and 3 worker nodes on this machine (`ray start`), 3 logical CPUs each."""
    pytest.importorskip("ray")
    from modelkiln.ray.local_cluster import LocalCluster

    with LocalCluster(workers=3, cpus_per_worker=3, timeout=300) as local:
        yield local
    assert not local.session_pids(), "processes of the cluster still running after it stopped"


@pytest.fixture(scope="module")
def cluster(nodes, emb, cls, tiny_generation_artifact):
    """`kiln ray --address` on the 3-node cluster: 3 models x 2 replicas, at most one of each per node."""
    from modelkiln.ray.process import RayProcess

    server = RayProcess([f"emb={emb}", f"cls={cls}", f"gen={tiny_generation_artifact}", "--replicas", "2",
                         "--max-replicas-per-node", "1", "--variant", "fp32", "--address", nodes.address], timeout=600)
    yield server
    code = server.stop()
    assert code == 0, server.output()[-3000:]
    assert not server.session_pids(), "kiln ray's own processes still running after it stopped"


@pytest.fixture(scope="module")
def reference_server(emb, cls, tiny_generation_artifact):
    from servers import Server

    server = Server([f"emb={emb}", f"cls={cls}", f"gen={tiny_generation_artifact}", "--variant", "fp32"])
    yield server
    server.stop()


def post(url: str, body, **kw) -> httpx.Response:
    return httpx.post(url, content=body if isinstance(body, (bytes, str)) else json.dumps(body), timeout=60, **kw)


@pytest.mark.slow
def test_answers_equal_kiln_serve(cluster, reference_server):
    import openai
    import tritonclient.http as th

    texts = list(SAMPLE_TEXTS[:3])
    for path, body in [("/v2/models/emb/predict", {"inputs": texts}), ("/v2/models/cls/predict", {"inputs": texts}),
                       ("/v2/models/cls/predict", {"inputs": "x", "parameters": {"top_k": 1}})]:
        ours, theirs = post(cluster.url + path, body), post(reference_server.url + path, body)
        assert ours.status_code == theirs.status_code == 200
        assert len(ours.headers.get_list("x-request-id")) == 1  # Ray's proxy sets it; the replica's copy is left out
        np.testing.assert_allclose(_numbers(ours.json()), _numbers(theirs.json()), atol=1e-5)
    answers = []
    for url in (cluster.url, reference_server.url):  # the OIP route, binary tensors, through tritonclient
        client = th.InferenceServerClient(url.removeprefix("http://"))
        tensor = th.InferInput("TEXT", [len(texts)], "BYTES")
        tensor.set_data_from_numpy(np.array(texts, dtype=object), binary_data=True)
        answers.append(client.infer("emb", [tensor]).as_numpy("EMBEDDINGS"))
        assert client.get_model_metadata("emb")["name"] == "emb"
        assert client.is_server_ready() and client.is_model_ready("cls")
    np.testing.assert_allclose(answers[0], answers[1], atol=1e-5)
    vectors = []
    for url in (cluster.url, reference_server.url):  # OpenAI: the model is in the body (the router forwards)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        vectors.append([d.embedding for d in client.embeddings.create(model="emb", input=texts).data])
        with pytest.raises(openai.BadRequestError, match="not an embedding model"):
            client.embeddings.create(model="cls", input="x")
        with pytest.raises(openai.NotFoundError):
            client.embeddings.create(model="nope", input="x")
    np.testing.assert_allclose(vectors[0], vectors[1], atol=1e-5)
    # errors: the same status and message from both
    for path, body in [("/v2/models/emb/predict", b"{not json"), ("/v2/models/emb/infer", {"inputs": []}),
                       ("/v2/models/nope/predict", {"inputs": "x"}), ("/v1/embeddings", {"input": 3, "model": "emb"})]:
        ours, theirs = post(cluster.url + path, body), post(reference_server.url + path, body)
        assert (ours.status_code, ours.json()) == (theirs.status_code, theirs.json()), path


@pytest.mark.slow
def test_generation_routes_equal_kiln_serve(cluster, reference_server):
    """A text-generation model under Ray: Triton's generate and generate_stream and OpenAI completions,
    streamed too (all run by the router over the replicas), give kiln serve's greedy text."""
    import openai
    from servers import sse_events

    body = {"text_input": "The quick brown fox", "parameters": {"max_tokens": 8, "temperature": 0, "ignore_eos": True}}
    texts: dict[str, list[str]] = {}
    for name, url in (("ray", cluster.url), ("serve", reference_server.url)):
        whole = post(url + "/v2/models/gen/generate", body)
        assert whole.status_code == 200, whole.text
        with httpx.stream("POST", url + "/v2/models/gen/generate_stream", json=body, timeout=60) as response:
            assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
            streamed = "".join(json.loads(e)["text_output"] for e in sse_events(response))
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        completion = client.completions.create(model="gen", prompt="The quick brown fox", max_tokens=8, temperature=0,
                                               extra_body={"ignore_eos": True})
        chunks = client.completions.create(model="gen", prompt="The quick brown fox", max_tokens=8, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        texts[name] = [whole.json()["text_output"], streamed, completion.choices[0].text,
                       "".join(c.choices[0].text for c in chunks if c.choices)]
        assert completion.usage.completion_tokens == 8
    assert len(set(texts["ray"])) == 1 and texts["ray"] == texts["serve"], texts


def _numbers(answer) -> list[float]:
    """Every number in a JSON answer, in order (labels compared by the caller's equality of shapes)."""
    if isinstance(answer, dict):
        return [x for k in sorted(answer) for x in _numbers(answer[k])]
    if isinstance(answer, list):
        return [x for item in answer for x in _numbers(item)]
    return [float(answer)] if isinstance(answer, (int, float)) else []


def _replica_stats(url: str, model: str, tries: int = 200) -> dict[str, int]:
    """{replica id: inference_count} read from each replica's own /stats (the proxy picks the replica;
    asked until both have answered)."""
    seen: dict[str, int] = {}
    for _ in range(tries):
        r = httpx.get(f"{url}/v2/models/{model}/stats", timeout=30)
        seen[r.headers["x-kiln-replica"]] = r.json()["model_stats"][0]["inference_count"]
        if len(seen) == 2:
            return seen
    raise AssertionError(f"only {len(seen)} replica(s) answered /stats in {tries} tries")


@pytest.mark.slow
def test_replicas_are_spread_over_the_nodes(cluster, nodes):
    """Each model's 2 replicas on 2 different worker nodes; the router on the head node."""
    replicas = nodes.replicas()
    for app in ("emb", "cls", "gen"):
        on = [r.node.name for r in replicas if r.app == app]
        assert len(on) == 2 and len(set(on)) == 2 and nodes.head.name not in on, (app, on)
    assert [r.node for r in replicas if r.app == "kiln"] == [nodes.head]


@pytest.mark.slow
def test_requests_spread_over_both_replicas(cluster):
    before = _replica_stats(cluster.url, "emb")
    answered_by: Counter[str] = Counter()
    lock = threading.Lock()

    def client(n: int) -> None:
        with httpx.Client(timeout=60) as http:
            for i in range(n):
                r = http.post(cluster.url + "/v2/models/emb/predict", json={"inputs": [SAMPLE_TEXTS[i % 20]] * 2})
                assert r.status_code == 200
                with lock:
                    answered_by[r.headers["x-kiln-replica"]] += 1

    threads = [threading.Thread(target=client, args=(15,)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = _replica_stats(cluster.url, "emb")
    assert set(after) == set(before) == set(answered_by)
    runs = {r: after[r] - before[r] for r in after}  # inputs each replica ran, by its own statistics
    assert sum(runs.values()) == 8 * 15 * 2
    assert all(runs[r] == 2 * answered_by[r] for r in runs), (runs, answered_by)
    assert min(answered_by.values()) >= 0.2 * 120, answered_by  # both took a real share, not one stray request


@pytest.mark.slow
def test_a_replica_killed_under_load_is_replaced(cluster, nodes):
    """Requests in flight when a replica's process dies are sent again to the other replica by the
    router: every one is answered 200; Ray replaces the replica."""
    old = set(_replica_stats(cluster.url, "emb"))
    victim = next(r for r in nodes.replicas() if r.app == "emb")
    retries_before = _router_counter(cluster.url, "kiln_retries_total")
    outcomes: Counter[str] = Counter()
    stop = threading.Event()
    lock = threading.Lock()

    def client() -> None:
        with httpx.Client(timeout=60) as http:
            while not stop.is_set():
                try:
                    r = http.post(cluster.url + "/v2/models/emb/predict", json={"inputs": SAMPLE_TEXTS[:16]})
                    outcome = "200" if r.status_code == 200 else f"{r.status_code} {r.text[:80]}"
                except httpx.TransportError as exc:
                    outcome = f"transport error {type(exc).__name__}"
                with lock:
                    outcomes[outcome] += 1

    threads = [threading.Thread(target=client) for _ in range(8)]
    for t in threads:
        t.start()
    time.sleep(3)
    before_kill = sum(outcomes.values())
    os.kill(victim.pid, signal.SIGKILL)
    deadline = time.monotonic() + 180
    answering: set[str] = set()
    while time.monotonic() < deadline and not (len(answering) == 2 and victim.id not in answering):
        time.sleep(1)
        try:  # a new replica answers once Serve runs it (its model loaded), not when Ray has started it
            answering = set(_replica_stats(cluster.url, "emb", tries=20))
        except AssertionError:
            pass
    time.sleep(2)  # the new replica takes its share of the load
    stop.set()
    for t in threads:
        t.join()
    retried = _router_counter(cluster.url, "kiln_retries_total") - retries_before
    print(f"\nreplica kill under load: {dict(outcomes)} ({before_kill} answered before the kill, {retried:.0f} "
          "sent again)")
    # a survivor and a new replica answer
    assert len(answering) == 2 and len(answering - old) == 1 and victim.id not in answering, (old, answering)
    # every request answered: those inside the replica when it died were sent again (Ray's proxy
    # alone answered them 500), unless none was inside at that moment (retried counts them)
    assert outcomes.keys() == {"200"} and outcomes["200"] > before_kill, outcomes


def _router_counter(url: str, name: str) -> float:
    """A counter of the router's /metrics, summed over its labels."""
    import re

    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M))


@pytest.fixture(scope="module")
def slow_generation_artifact(tmp_path_factory):
    """A tiny Llama whose tokens take a few milliseconds (8 layers of 512): a replica running it is
    still writing its streams when its node is lost (a faster one is done before its answers reach
    the clients: Ray streams a replica's items without back-pressure)."""
    from generation_helpers import make_tiny_llama
    from modelkiln.convert.pipeline import ConvertConfig, convert

    root = tmp_path_factory.mktemp("slow-generation")
    out = root / "tiny-llama-8x512"
    convert(ConvertConfig(model=str(make_tiny_llama(root / "hf", hidden_size=512, layers=8)), out=out,
                          task="text-generation", precisions=["fp32"], threads=1, timing_seconds=0.02))
    return out


@pytest.mark.slow
def test_the_fault_benchmark_loses_nothing(emb, slow_generation_artifact, tmp_path):
    """benchmarks/reliability/ray_failover.py --short: a node killed (SIGKILL) and a node drained
    under 4 streaming and 4 embedding clients. Every accepted request is answered, every answer is
    the one it gets alone on kiln serve, token for token; the kill's streams continued elsewhere.
    (Its timing goal is the benchmark's to report, not this test's.)"""
    import subprocess
    import sys

    pytest.importorskip("ray")
    repo = REPO
    out = tmp_path / "result"
    run = subprocess.run([sys.executable, str(repo / "benchmarks" / "reliability" / "ray_failover.py"), "--short",
                          "--chat", str(slow_generation_artifact), "--embeddings", str(emb), "--variant", "fp32",
                          "--out", str(out)], capture_output=True, text=True, timeout=1500)
    result = json.loads((out / "result.json").read_text()) if (out / "result.json").exists() else None
    assert result is not None, run.stdout[-3000:] + run.stderr[-3000:]
    print("\n" + (out / "result.txt").read_text())
    chat, embeddings = result["chat"], result["embeddings"]
    assert chat["answered"] > 0 and embeddings["answered"] > 0
    for tally in (chat, embeddings):
        assert tally["lost"] == tally["differing"] == 0, tally["examples"]
    assert chat["duplicated_or_missing"] == 0
    kill, drain = result["faults"]
    # the lost replica had streams running, and they went on elsewhere (a stream whose replica had written
    # all of it before the kill needs nothing: the router has every token)
    assert kill["kind"] == "kill" and kill["streams_on_lost"] >= 1 and kill["streams_continued"] >= 1
    assert drain["kind"] == "drain" and drain["node_emptied_s"] is not None


# --- the router's failover, with a stand-in for Serve's handle (no cluster) --------------------------


class _Call:
    """A stand-in for a streaming handle call on a replica: the real replica side
    (``replica_deltas`` over an in-process kiln serve model), lost after ``lose_after`` deltas
    (None: never), or ``hang`` (no replica takes it), or refused with ``error``; ``beacon``: the
    replica's ``liveness.Beacon``, and ``die_after``: after that many deltas the replica's process
    dies without a word from Ray (the beacon closes, the call stalls until cancelled)."""

    def __init__(self, plane, args, lose_after=None, hang=False, error=None, beacon=None, die_after=None):
        self.plane, self.args, self.lose_after, self.hang, self.error = plane, args, lose_after, hang, error
        self.beacon, self.die_after = beacon, die_after
        self.items = None
        self.deltas = 0
        self.cancelled = False
        self._cancel = asyncio.Event()

    def __aiter__(self):
        return self

    async def __anext__(self):
        from ray.exceptions import ActorUnavailableError, RayTaskError
        from ray.serve.exceptions import RequestCancelledError

        from modelkiln.ray.remote_generation import Taken, replica_deltas

        if self.items is None:
            taken = Taken("stand-in", await self.beacon.address() if self.beacon else None)
            self.items = replica_deltas(self.plane, taken, *self.args)
        if self.hang or (self.die_after is not None and self.deltas >= self.die_after):
            if self.die_after is not None:
                while not self.beacon.connections:  # the router connects once the request was taken
                    await asyncio.sleep(0.005)
                self.beacon.close()  # what the process's end does to its sockets
            await self._cancel.wait()  # Ray says nothing; only a cancel ends the wait (as Serve's calls)
            await self.items.aclose()
            raise RequestCancelledError("stand-in")
        if self.error is not None:
            raise RayTaskError("generate", "", self.error).as_instanceof_cause()
        if self.lose_after is not None and self.deltas >= self.lose_after:
            await self.items.aclose()
            raise ActorUnavailableError("RPC error: Socket closed", None)
        item = await self.items.__anext__()
        self.deltas += len(item) if isinstance(item, list) else 0  # the first item: Taken
        return item

    def cancel(self):
        self.cancelled = True
        self._cancel.set()


class _Handle:
    """Serve's handle as RemoteStream uses it (``options(stream=True).generate.remote``); each call
    behaves as the next entry of ``script`` says (then: answers whole)."""

    def __init__(self, plane, script):
        self.plane, self.script, self.calls = plane, list(script), []
        self.generate = self

    def options(self, **_):
        return self

    def remote(self, *args):
        call = _Call(self.plane, args, **(self.script.pop(0) if self.script else {}))
        self.calls.append(call)
        return call


@pytest.fixture(scope="module")
def local_plane(tiny_generation_artifact):
    """kiln serve's data plane over the tiny generation model, in this process: the replicas' side."""
    pytest.importorskip("ray")
    from modelkiln.serve.dataplane import build_dataplane

    settings = ServeSettings(threads=1, warmup=False).with_models((ModelSpec("gen", str(tiny_generation_artifact),
                                                                              "fp32"),))
    plane = build_dataplane(settings)
    yield plane
    plane.stop()


def _remote(plane, script, retries=3, window_s=5.0):
    from modelkiln.ray.plan import Failover
    from modelkiln.ray.remote_generation import RemoteGenerationModel
    from modelkiln.serve.metrics import Metrics

    model = plane.models["gen"]
    handle = _Handle(plane, script)
    return RemoteGenerationModel(ModelSpec("gen", str(model.folder), "fp32"), plane.settings, Metrics(), handle,
                                 Failover(retries, window_s)), handle


def _answer(model, prompt_ids, params, **kw) -> list:
    async def run():
        stream = model.generate(prompt_ids, params, **kw)
        async with stream:
            deltas = [delta async for delta in stream]
        return deltas, stream

    return asyncio.run(run())


def _counter(model, name: str) -> float:
    return getattr(model.metrics, name).labels("gen")._value.get()


@pytest.mark.parametrize("sampled", [False, True])
def test_a_stream_whose_replica_is_lost_goes_on_as_the_uninterrupted_answer(local_plane, sampled):
    """Lost before it was accepted, after its first token, mid-answer, twice: the deltas are the
    uninterrupted answer's, token for token, text for text; the next replica got prompt + the
    tokens passed on and the same seed; usage counts the whole answer."""
    from modelkiln.generation.sampling import SamplingParams

    local = local_plane.models["gen"]
    ids = local.tokenizer.encode("The quick brown fox").ids
    extra = {"temperature": 0.9, "top_p": 0.95, "repetition_penalty": 1.2} if sampled else {}
    params = SamplingParams(max_new_tokens=24, ignore_eos=True, **extra)
    whole, first = _answer(_remote(local_plane, [])[0], ids, params)
    for script, resumed in ([{"lose_after": 0}], 0), ([{"lose_after": 1}], 1), ([{"lose_after": 10}], 1), \
                           ([{"lose_after": 5}, {"lose_after": 7}], 2):
        model, handle = _remote(local_plane, script)
        deltas, stream = _answer(model, ids, params, seed=first.seed)
        assert [d.token_id for d in deltas] == [d.token_id for d in whole], script
        assert "".join(d.text for d in deltas) == "".join(d.text for d in whole)
        assert deltas[-1].finish_reason == whole[-1].finish_reason and stream.completion_tokens == 24
        assert len(handle.calls) == len(script) + 1 and all(c.args[2] == first.seed for c in handle.calls)
        passed = [sum(c.deltas for c in handle.calls[:i]) for i in range(len(handle.calls))]
        assert [len(c.args[3]) for c in handle.calls] == passed  # resume_ids: exactly the tokens passed on
        assert _counter(model, "streams_resumed") == resumed
        assert _counter(model, "retries") == len(script) - resumed
    assert local.in_flight == 0


def test_a_replica_whose_process_dies_loses_its_streams_at_once_not_when_ray_says(local_plane):
    """The replica's beacon connection ends (its process died) while Ray reports nothing: the router
    cancels the stalled call and the stream goes on on another replica, the uninterrupted answer,
    long before the request's timeout. A live replica's beacon moves nothing."""
    from modelkiln.generation.sampling import SamplingParams
    from modelkiln.ray.liveness import Beacon

    ids = local_plane.models["gen"].tokenizer.encode("The quick brown fox").ids
    params = SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=0.9, top_p=0.95)
    whole, first = _answer(_remote(local_plane, [])[0], ids, params)

    async def run(script):
        model, handle = _remote(local_plane, script)
        started = time.monotonic()
        stream = model.generate(ids, params, timeout_s=60, seed=first.seed)
        async with stream:
            deltas = [delta async for delta in stream]
        return deltas, time.monotonic() - started, model, handle

    async def both():
        dying, live = Beacon("127.0.0.1"), Beacon("127.0.0.1")
        # bounded: without the beacon's word the stalled call would wait for ever (Ray says nothing here)
        moved = await asyncio.wait_for(run([{"beacon": dying, "die_after": 9}, {"beacon": live}]), 30)
        stayed = await asyncio.wait_for(run([{"beacon": live}]), 30)
        return moved, stayed

    (deltas, seconds, model, handle), (kept, _, kept_model, kept_handle) = asyncio.run(both())
    assert [d.token_id for d in deltas] == [d.token_id for d in whole]
    assert "".join(d.text for d in deltas) == "".join(d.text for d in whole)
    assert seconds < 10 and len(handle.calls) == 2 and handle.calls[0].cancelled
    assert [len(c.args[3]) for c in handle.calls] == [0, 9] and _counter(model, "streams_resumed") == 1
    assert [d.token_id for d in kept] == [d.token_id for d in whole] and len(kept_handle.calls) == 1
    assert _counter(kept_model, "streams_resumed") == 0 and local_plane.models["gen"].in_flight == 0


def test_no_live_replica_within_the_window_ends_the_stream_cleanly(local_plane):
    from modelkiln.errors import ModelNotReadyError
    from modelkiln.generation.sampling import SamplingParams

    ids = local_plane.models["gen"].tokenizer.encode("Hello").ids
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    model, handle = _remote(local_plane, [{"lose_after": 3}, {"hang": True}], window_s=0.5)

    async def run():
        got = []
        with pytest.raises(ModelNotReadyError, match="no replica took the request within 0.5s"):
            async with model.generate(ids, params) as stream:
                async for delta in stream:
                    got.append(delta)
        return got

    assert len(asyncio.run(run())) == 3  # ended by the window (the message), not the request's timeout
    assert handle.calls[1].cancelled and _counter(model, "failovers_failed") == 1
    # every attempt lost at once: bounded by the count
    model, handle = _remote(local_plane, [{"lose_after": 0}] * 10, retries=2)
    with pytest.raises(ModelNotReadyError, match="lost"):
        _answer(model, ids, params)
    assert len(handle.calls) == 3 and _counter(model, "failovers_failed") == 1


def test_a_client_that_leaves_stops_its_resubmission(local_plane):
    from modelkiln.generation.sampling import SamplingParams

    ids = local_plane.models["gen"].tokenizer.encode("Hello").ids
    model, handle = _remote(local_plane, [{"lose_after": 2}, {"hang": True}])

    async def run():
        stream = model.generate(ids, SamplingParams(max_new_tokens=16, ignore_eos=True))

        async def client():
            async with stream:
                async for _ in stream:
                    pass

        task = asyncio.create_task(client())
        while len(handle.calls) < 2:  # the request was sent again: no replica has taken it
            await asyncio.sleep(0.01)
        task.cancel()  # the client's connection closed
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0.2)

    asyncio.run(run())
    assert len(handle.calls) == 2 and handle.calls[1].cancelled and model.in_flight == 0


def test_a_replicas_refusal_is_the_clients_answer_not_a_retry(local_plane):
    from modelkiln.errors import OverloadedError
    from modelkiln.generation.sampling import SamplingParams

    ids = local_plane.models["gen"].tokenizer.encode("Hello").ids
    model, handle = _remote(local_plane, [{"error": OverloadedError("3 generation requests waiting; retry later")}])
    with pytest.raises(OverloadedError, match="retry later"):
        _answer(model, ids, SamplingParams(max_new_tokens=4))
    assert len(handle.calls) == 1 and _counter(model, "retries") == 0


class _ForwardCall:
    """A stand-in for ``ModelReplica.forward`` on a replica: lost before the answer (``lose``:
    "before", or "after-start": between the response start and its body), or after it ("after-end":
    the answer is whole, the call's end is lost), or hanging, or answering."""

    def __init__(self, lose=None, hang=False):
        self.lose, self.hang, self.cancelled = lose, hang, False
        self.items = iter([{"status": 200, "headers": [(b"content-type", b"application/json")]}, (b'{"ok":1}', False)])
        self.sent = 0

    def __aiter__(self):
        return self

    async def __anext__(self):
        from ray.exceptions import ActorDiedError

        if self.hang:
            await asyncio.Event().wait()
        if self.lose == "before" or (self.lose == "after-start" and self.sent == 1) or \
                (self.lose == "after-end" and self.sent == 2):
            raise ActorDiedError()
        try:
            item = next(self.items)
        except StopIteration:
            raise StopAsyncIteration from None
        self.sent += 1
        return item

    def cancel(self):
        self.cancelled = True


class _ForwardHandle:
    def __init__(self, script):
        self.script, self.calls = list(script), []
        self.forward = self

    def options(self, **_):
        return self

    def remote(self, *args):
        self.calls.append(_ForwardCall(**(self.script.pop(0) if self.script else {})))
        return self.calls[-1]


def _route(app, path: str = "/v2/models/emb/predict") -> tuple[int, bytes]:
    sent = []

    async def receive():
        return {"type": "http.request", "body": b'{"inputs": "x"}', "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "query_string": b"", "headers": []}
    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def test_a_forwarded_request_whose_replica_is_lost_is_sent_again():
    """The router's forward (an encoder's routes): a replica lost before the answer, or between its
    start and its body (the start is held back), gets the request again on another; the client sees
    one answer. No replica within the window: 503. Counted in the router's metrics."""
    pytest.importorskip("ray")
    from modelkiln.ray.ingress import RouterApp
    from modelkiln.ray.plan import Failover

    for script, tries in (([{"lose": "before"}], 2), ([{"lose": "after-start"}], 2),
                          ([{"lose": "before"}, {"lose": "before"}], 3), ([{"lose": "after-end"}], 1)):
        handle = _ForwardHandle(script)
        app = RouterApp(["emb"], [], ServeSettings(), {"emb": handle}, Failover(3, 5.0))
        assert _route(app) == (200, b'{"ok":1}')
        assert len(handle.calls) == tries and all(c.cancelled for c in handle.calls[:-1])
        assert app.metrics.retries.labels("emb")._value.get() == tries - 1
    handle = _ForwardHandle([{"lose": "before"}, {"hang": True}])
    app = RouterApp(["emb"], [], ServeSettings(), {"emb": handle}, Failover(3, 0.3))
    status, body = _route(app)
    assert status == 503 and b"no replica took the request" in body and handle.calls[1].cancelled
    assert app.metrics.failovers_failed.labels("emb")._value.get() == 1
