"""Triton's model repository API on a real server process (serve/repository.py): index, load,
unload, failed loads, poll mode, and loads/unloads/polls while clients keep calling."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from servers import Server

KEY = "repo-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}
TEXT = {"inputs": ["a good day", "the weather is bad"]}


@pytest.fixture(scope="module")
def sources(zoo) -> dict[str, Path]:
    return {"cls": zoo.artifact("bert", "text-classification"), "emb": zoo.artifact("bert", "sentence-embeddings")}


def add(repo: Path, name: str, source: Path) -> Path:
    """Copy an artifact folder in, then rename it into place (a poll never sees half a folder)."""
    staging = repo.parent / f".staging-{name}"
    shutil.copytree(source, staging)
    staging.rename(repo / name)
    return repo / name


def corrupt(folder: Path) -> None:
    for onnx in folder.glob("*.onnx"):
        onnx.write_bytes(onnx.read_bytes()[:1000])


def call(server: Server, path: str, body=None, headers=AUTH) -> httpx.Response:
    return httpx.post(server.url + path, content=b"" if body is None else json.dumps(body), headers=headers,
                      timeout=30)


def index(server: Server, **body) -> dict[str, dict]:
    r = call(server, "/v2/repository/index", body or None)
    assert r.status_code == 200, r.text
    return {e["name"]: e for e in r.json()}


def loaded_info(server: Server) -> dict[str, float]:
    """kiln_model_info's value per model in /metrics (1 while loaded, 0 once unloaded)."""
    text = httpx.get(server.url + "/metrics", headers=AUTH, timeout=10).text
    lines = [ln for ln in text.splitlines() if ln.startswith("kiln_model_info{")]
    return {ln.split('model="')[1].split('"')[0]: float(ln.rsplit(" ", 1)[1]) for ln in lines}


def wait_until(check, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out waiting for the repository to change"
        time.sleep(0.1)


def start(repo: Path, mode: str, *extra: str, workers: int = 1) -> Server:
    return Server(["--model-repository", str(repo), "--model-control-mode", mode, "--variant", "fp32",
                   "--api-key", KEY, "--no-warmup", "--workers", str(workers), *extra])


def everywhere(server: Server, path: str, body, status: int) -> None:
    """Every worker (with --workers 2) answers ``status``: 12 requests on new connections, which
    the kernel spreads over the workers, and at least two answering processes (their request ids)."""
    replies = [call(server, path, body) for _ in range(12)]
    assert [r.status_code for r in replies] == [status] * 12, [r.text for r in replies]
    assert len({r.headers["x-request-id"].rsplit("-", 1)[0] for r in replies}) == server.workers


# One process, and two worker processes: a load or unload asked of one worker is carried out by every
# worker before it is answered (serve/workers.py).
per_workers = pytest.mark.parametrize("workers", [1, 2])


@per_workers
def test_explicit_index_load_unload_and_failed_loads(tmp_path, sources, workers):
    repo = tmp_path / "repo"
    repo.mkdir()
    add(repo, "cls", sources["cls"])
    add(repo, "emb", sources["emb"])
    (repo / "notes").mkdir()  # a folder without kiln.json is not a model
    server = start(repo, "explicit", workers=workers)
    try:
        assert httpx.get(server.url + "/v2/health/ready").status_code == 200  # explicit: ready with nothing loaded
        assert call(server, "/v2/repository/index", headers={}).status_code == 401
        assert call(server, "/v2/repository/models/cls/load", headers={}).status_code == 401
        assert index(server) == {
            "cls": {"name": "cls", "version": "1", "state": "UNAVAILABLE", "reason": "not loaded"},
            "emb": {"name": "emb", "version": "1", "state": "UNAVAILABLE", "reason": "not loaded"}}
        assert call(server, "/v2/models/cls/predict", TEXT).status_code == 404
        assert "model_repository" in httpx.get(server.url + "/v2", headers=AUTH).json()["extensions"]

        for name in ("cls", "emb"):
            assert call(server, f"/v2/repository/models/{name}/load").status_code == 200
        everywhere(server, "/v2/models/cls/predict", TEXT, 200)
        assert {n: e["state"] for n, e in index(server).items()} == {"cls": "READY", "emb": "READY"}
        assert call(server, "/v2/repository/models/nope/load").status_code == 404
        assert call(server, "/v2/repository/index", "not json").status_code == 400

        # a folder that cannot load: 400 with the reason, listed UNAVAILABLE with it, nothing else changes
        corrupt(add(repo, "broken", sources["emb"]))
        r = call(server, "/v2/repository/models/broken/load")
        assert r.status_code == 400 and "failed to load 'broken'" in r.json()["error"], r.text
        assert index(server)["broken"]["state"] == "UNAVAILABLE"
        assert "load failed" in index(server)["broken"]["reason"]
        everywhere(server, "/v2/models/broken/predict", TEXT, 404)

        # a failed reload keeps the loaded version serving: a missing model file, a manifest of another version
        before = call(server, "/v2/models/emb/infer", {"inputs": [
            {"name": "TEXT", "datatype": "BYTES", "shape": [1], "data": ["a good day"]}]}).json()
        for onnx in (repo / "emb").glob("*.onnx"):
            onnx.unlink()
        r = call(server, "/v2/repository/models/emb/load")
        assert r.status_code == 400 and "emb" in r.json()["error"], r.text
        shutil.rmtree(repo / "emb")
        add(repo, "emb", sources["emb"])
        manifest = json.loads((repo / "emb" / "kiln.json").read_text())
        (repo / "emb" / "kiln.json").write_text(json.dumps({**manifest, "format_version": 99}))
        r = call(server, "/v2/repository/models/emb/load")
        assert r.status_code == 400 and "format" in r.json()["error"].lower(), r.text
        after = call(server, "/v2/models/emb/infer", {"inputs": [
            {"name": "TEXT", "datatype": "BYTES", "shape": [1], "data": ["a good day"]}]})
        assert after.status_code == 200 and after.json()["outputs"] == before["outputs"]
        assert index(server)["emb"]["state"] == "READY"

        assert loaded_info(server) == {"cls": 1.0, "emb": 1.0}  # the failed reloads left emb's as it was
        assert call(server, "/v2/repository/models/cls/unload").status_code == 200
        everywhere(server, "/v2/models/cls/predict", TEXT, 404)
        assert loaded_info(server) == {"cls": 0.0, "emb": 1.0}
        assert index(server)["cls"] == {"name": "cls", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"}
        assert set(index(server, ready=True)) == {"emb"}
        assert call(server, "/v2/repository/models/cls/unload").status_code == 200  # not loaded: nothing to do
        assert call(server, "/v2/repository/models/nope/unload").status_code == 404
    finally:
        code, err = server.stop()
    assert code == 0, err[-2000:]


def test_mode_none_serves_the_repository_and_refuses_load_and_unload(tmp_path, sources):
    """In process (the routes are the same as in explicit mode above): a bad mode is refused too."""
    from modelkiln.errors import ErrorKind, KilnError, ModelControlError
    from modelkiln.serve.dataplane import build_dataplane
    from modelkiln.serve.settings import ServeSettings

    repo = tmp_path / "repo"
    repo.mkdir()
    add(repo, "cls", sources["cls"])
    plane = build_dataplane(ServeSettings(model_repository=str(repo), warmup=False, instances=1, threads=1))
    try:
        assert [(e.name, e.state) for e in asyncio.run(plane.repository_index())] == [("cls", "READY")]
        for action in (plane.load_model, plane.unload_model):
            with pytest.raises(ModelControlError, match="model control mode none") as refused:
                asyncio.run(action("cls"))
            assert refused.value.kind is ErrorKind.METHOD_NOT_ALLOWED
    finally:
        plane.stop()
    with pytest.raises(KilnError, match="model_control_mode must be 'none', 'explicit' or 'poll'"):
        ServeSettings().replace(model_repository=str(repo), model_control_mode="sometimes")
    with pytest.raises(KilnError, match="needs --model-repository"):
        build_dataplane(ServeSettings(model_control_mode="explicit"))


def test_a_load_whose_caller_left_is_not_installed_and_frees_its_threads(tmp_path, sources):
    """gRPC cancels a handler when its client cancels: the build still ends, then is released."""
    import threading

    from modelkiln.serve.dataplane import build_dataplane
    from modelkiln.serve.settings import ServeSettings

    repo = tmp_path / "repo"
    repo.mkdir()
    add(repo, "cls", sources["cls"])
    plane = build_dataplane(ServeSettings(model_repository=str(repo), model_control_mode="explicit",
                                          warmup=False, instances=1, threads=1))

    def engine_threads() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name.startswith("engine-cls")]

    async def scenario() -> None:
        load = asyncio.create_task(plane.load_model("cls"))
        while "cls" not in plane.repository.loading:  # the build is under way on its worker thread
            await asyncio.sleep(0)
        load.cancel()
        with pytest.raises(asyncio.CancelledError):
            await load
        await asyncio.to_thread(wait_until, lambda: not engine_threads() and not plane.repository.loading)
        assert plane.models == {}
        await plane.load_model("cls")  # and a later load works
        assert list(plane.models) == ["cls"] and engine_threads() == ["engine-cls-0"]
        await plane.unload_model("cls")
        assert plane.models == {}
        await asyncio.to_thread(wait_until, lambda: not engine_threads())  # stopped threads end at their next wake

    asyncio.run(scenario())


async def hammer(url: str, model: str, stop: asyncio.Event, clients: int) -> Counter:
    """``clients`` concurrent callers of ``model`` until ``stop``: a count of statuses (or of
    exception names: a hang would show as a ReadTimeout)."""
    outcomes: Counter = Counter()

    async def client(http: httpx.AsyncClient) -> None:
        while not stop.is_set():
            try:
                r = await http.post(f"{url}/v2/models/{model}/predict", json=TEXT, headers=AUTH)
                outcomes[r.status_code] += 1
            except httpx.HTTPError as exc:
                outcomes[type(exc).__name__] += 1

    async with httpx.AsyncClient(timeout=10, limits=httpx.Limits(max_connections=clients)) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    return outcomes


@per_workers
def test_load_and_unload_while_clients_call_another_model_and_the_one_unloaded(tmp_path, sources, workers):
    """The issue's load test: clients keep calling 'steady' and 'victim' while 'emb' is loaded,
    'victim' unloaded, loaded again and unloaded again. 'steady' never fails; 'victim' answers
    200 or a clean 404, never a 5xx or a hang."""
    repo = tmp_path / "repo"
    repo.mkdir()
    for name, source in (("steady", "cls"), ("victim", "cls"), ("emb", "emb")):
        add(repo, name, sources[source])
    server = start(repo, "explicit", "--warmup", workers=workers)
    try:
        for name in ("steady", "victim"):
            assert call(server, f"/v2/repository/models/{name}/load").status_code == 200

        async def scenario() -> tuple[Counter, Counter, list[int]]:
            stop = asyncio.Event()
            steady = asyncio.create_task(hammer(server.url, "steady", stop, clients=8))
            victim = asyncio.create_task(hammer(server.url, "victim", stop, clients=4))
            statuses = []
            async with httpx.AsyncClient(timeout=60, headers=AUTH) as http:
                for action, name in (("load", "emb"), ("unload", "victim"), ("load", "victim"),
                                     ("unload", "victim"), ("unload", "emb")):
                    await asyncio.sleep(0.4)
                    statuses.append((await http.post(f"{server.url}/v2/repository/models/{name}/{action}")).status_code)
            await asyncio.sleep(0.4)
            stop.set()
            return await steady, await victim, statuses

        steady, victim, statuses = asyncio.run(scenario())
        assert statuses == [200] * 5
        assert set(steady) == {200} and steady[200] > 50, steady
        assert set(victim) <= {200, 404} and victim[200] > 0 and victim[404] > 0, victim
        assert {n: e["state"] for n, e in index(server).items()} == {
            "steady": "READY", "victim": "UNAVAILABLE", "emb": "UNAVAILABLE"}
    finally:
        code, err = server.stop()
    assert code == 0, err[-2000:]


@per_workers
def test_poll_picks_up_added_changed_and_removed_folders_while_serving(tmp_path, sources, workers):
    """Poll mode with clients calling 'steady' all along: a new folder is loaded, a changed one
    ('steady' itself) reloaded without a gap, a removed one unloaded; the API refuses load/unload."""
    repo = tmp_path / "repo"
    repo.mkdir()
    add(repo, "steady", sources["cls"])
    server = start(repo, "poll", "--repository-poll-s", "0.2", workers=workers)
    try:
        assert call(server, "/v2/repository/models/steady/load").status_code == 405

        def served_count() -> int:
            r = httpx.get(server.url + "/v2/models/steady/stats", headers=AUTH)
            return r.json()["model_stats"][0]["inference_count"]

        async def scenario() -> Counter:
            stop = asyncio.Event()
            steady = asyncio.create_task(hammer(server.url, "steady", stop, clients=4))
            await asyncio.to_thread(add, repo, "emb", sources["emb"])
            await asyncio.to_thread(wait_until, lambda: index(server).get("emb", {}).get("state") == "READY")
            await asyncio.to_thread(everywhere, server, "/v2/models/emb/predict", TEXT, 200)

            # a changed manifest: reloaded. The new model's statistics start from zero, so the
            # count (inputs answered, growing by ~100s a second) going down shows the swap.
            await asyncio.sleep(1.0)
            before = served_count()
            manifest = repo / "steady" / "kiln.json"
            manifest.write_text(manifest.read_text() + "\n")
            await asyncio.to_thread(wait_until, lambda: served_count() < before)

            await asyncio.to_thread(shutil.rmtree, repo / "emb")
            await asyncio.to_thread(wait_until, lambda: "emb" not in index(server))
            await asyncio.to_thread(everywhere, server, "/v2/models/emb/predict", TEXT, 404)

            corrupt(add(repo, "broken", sources["emb"]))  # a folder that fails to load: logged, not served
            await asyncio.to_thread(wait_until, lambda: "load failed" in index(server)["broken"]["reason"])
            stop.set()
            return await steady

        steady = asyncio.run(scenario())
        assert set(steady) == {200} and steady[200] > 20, steady
        assert {n: e["state"] for n, e in index(server).items()} == {"steady": "READY", "broken": "UNAVAILABLE"}
        assert loaded_info(server) == {"steady": 1.0, "emb": 0.0}  # reloaded: the new one's 1, the old one's gone
    finally:
        code, err = server.stop()
    assert code == 0, err[-2000:]
    assert "reloaded model steady" in err and "unloaded model emb" in err
