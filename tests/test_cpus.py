"""The CPU budget (modelkiln.cpus): the affinity mask, the cgroup v2 / v1 CPU quota (read from fake
/proc and /sys/fs/cgroup files built here), a ``--cpus`` that may only lower it, and real
``taskset -c 0`` children whose budget, and whose server's engine layout, is one CPU."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import SRC
from modelkiln import cpus
from modelkiln.cpus import CpuBudget, Quota, available_cpus, cgroup_quota, cpu_budget, quota_cpus
from modelkiln.errors import KilnError
from modelkiln.machine import cpu_description, cpu_flags, matrix_engine
from modelkiln.serve.settings import ServeSettings


def fake_proc(tmp_path: Path, mountinfo: list[str], membership: list[str]) -> Path:
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "mountinfo").write_text("\n".join(mountinfo) + "\n")
    (proc / "cgroup").write_text("\n".join(membership) + "\n")
    return proc


def write(path: Path, text: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    for line in text.splitlines():
        name, value = line.split("=", 1)
        (path / name).write_text(value + "\n")


def test_cgroup_v2_cpu_max_of_the_process_and_its_ancestors(tmp_path):
    root = tmp_path / "cgroup"
    proc = fake_proc(tmp_path, [f"41 31 0:38 / {root} rw,relatime - cgroup2 cgroup2 rw"], ["0::/kiln.slice/serve"])
    write(root / "kiln.slice" / "serve", "cpu.max=250000 100000")
    write(root / "kiln.slice", "cpu.max=max 100000")
    assert cgroup_quota(proc) == Quota(2.5, "cpu.max")
    write(root / "kiln.slice", "cpu.max=150000 100000")  # a parent's limit binds its children
    assert cgroup_quota(proc) == Quota(1.5, "cpu.max")
    write(root / "kiln.slice", "cpu.max=max 100000")
    write(root / "kiln.slice" / "serve", "cpu.max=max 100000")
    assert cgroup_quota(proc) is None


def test_cgroup_v1_quota_and_a_container_that_sees_the_hosts_path(tmp_path):
    mount = tmp_path / "cpu,cpuacct"
    mountinfo = [f"32 31 0:29 / {mount} rw,relatime - cgroup cgroup rw,cpu,cpuacct",
                 f"35 31 0:32 / {tmp_path / 'memory'} rw,relatime - cgroup cgroup rw,memory"]
    # In a container without its own cgroup namespace, /proc/self/cgroup names the host's path
    # (/docker/abc) while the container's cgroup is mounted at the mount point itself.
    proc = fake_proc(tmp_path, mountinfo, ["4:memory:/docker/abc", "3:cpu,cpuacct:/docker/abc"])
    write(mount, "cpu.cfs_quota_us=200000\ncpu.cfs_period_us=100000")
    assert cgroup_quota(proc) == Quota(2.0, "cpu.cfs_quota_us")
    write(mount, "cpu.cfs_quota_us=-1\ncpu.cfs_period_us=100000")
    assert cgroup_quota(proc) is None


def test_no_cgroup_files_means_no_quota(tmp_path):
    assert cgroup_quota(tmp_path / "nowhere") is None
    proc = fake_proc(tmp_path, ["22 1 0:21 / /proc rw - proc proc rw"], ["0::/"])
    assert cgroup_quota(proc) is None


def test_a_quota_is_whole_cpus_rounded_down_and_at_least_one():
    assert [quota_cpus(Quota(c, "cpu.max")) for c in (0.5, 1.0, 1.5, 2.999, 3.0, 16.0)] == [1, 1, 1, 2, 3, 16]


def test_the_budget_is_the_smallest_limit_and_says_which(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setattr(cpus, "affinity_cpus", lambda: 16)
    monkeypatch.setattr(cpus, "cgroup_quota", lambda: None)
    assert available_cpus() == CpuBudget(16, "all cores")
    monkeypatch.setattr(cpus, "affinity_cpus", lambda: 2)
    assert available_cpus() == CpuBudget(2, "affinity")
    assert str(available_cpus()) == "2 (affinity)"
    monkeypatch.setattr(cpus, "cgroup_quota", lambda: Quota(1.5, "cpu.max"))
    assert available_cpus() == CpuBudget(1, "cgroup cpu.max")
    monkeypatch.setattr(cpus, "cgroup_quota", lambda: Quota(8.0, "cpu.cfs_quota_us"))
    assert available_cpus() == CpuBudget(2, "affinity")  # the quota is looser than the mask


def test_cpus_may_only_lower_the_budget(monkeypatch):
    monkeypatch.setattr(cpus, "available_cpus", lambda: CpuBudget(4, "cgroup cpu.max"))
    assert cpu_budget() == CpuBudget(4, "cgroup cpu.max")
    assert cpu_budget(2) == CpuBudget(2, "--cpus")
    with pytest.raises(KilnError, match=r"^--cpus 8 is more than the 4 CPUs this process may use \(cgroup cpu.max\)$"):
        cpu_budget(8)


def test_engine_layout_without_cpus_comes_from_the_budget(monkeypatch):
    monkeypatch.setattr(cpus, "affinity_cpus", lambda: 1)
    monkeypatch.setattr(cpus, "cgroup_quota", lambda: None)
    assert ServeSettings().engine_layout() == (1, 1, 0)


taskset = pytest.mark.skipif(shutil.which("taskset") is None or len(os.sched_getaffinity(0)) < 2,
                             reason="needs taskset and at least 2 CPUs to pin to fewer")


@taskset
def test_a_pinned_child_has_a_budget_of_its_cpus():
    code = "from modelkiln.cpus import available_cpus; print(available_cpus())"
    done = subprocess.run(["taskset", "-c", "0", sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(SRC)}, timeout=60)
    assert done.stdout.strip() == "1 (affinity)", done.stderr


@taskset
def test_a_pinned_server_sizes_its_engines_from_one_cpu_and_refuses_more(zoo):
    artifact = zoo.artifact("bert", "sentence-embeddings", precisions=("fp32",))
    pinned = ["taskset", "-c", "0", sys.executable, "-m", "modelkiln"]
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    refused = subprocess.run([*pinned, "serve", str(artifact), "--cpus", "2"], capture_output=True, text=True,
                             env=env, timeout=120)
    assert refused.returncode == 2
    assert "--cpus 2 is more than the 1 CPUs this process may use (affinity)" in refused.stderr
    with socket.socket() as taken:  # the server loads, says its budget and layout, then cannot bind
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        done = subprocess.run([*pinned, "serve", str(artifact), "--port", str(taken.getsockname()[1])],
                              capture_output=True, text=True, env=env, timeout=120)
    assert "CPU budget: 1 (affinity)" in done.stderr
    assert "1 instance(s) x 1 thread(s), alone: 0 thread(s)" in done.stderr, done.stderr[-2000:]
    assert f"variant fp32 on {matrix_engine('fp32', 'cpu', cpu_flags())}," in done.stderr  # the unit it runs on


@taskset
def test_bench_threads_default_to_the_budget(zoo, tmp_path):
    artifact = zoo.artifact("bert", "sentence-embeddings", precisions=("fp32",))
    out = tmp_path / "bench.json"
    done = subprocess.run(["taskset", "-c", "0", sys.executable, "-m", "modelkiln", "bench", str(artifact),
                           "--batch", "1", "--seq", "16", "--variants", "fp32", "--no-reference", "--min-iters", "3",
                           "--min-seconds", "0.01", "--json", str(out)],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(SRC)}, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    machine = json.loads(out.read_text())["machine"]
    assert machine["threads"] == 1 and machine["cores"] == 1


def test_default_layout_two_thread_sessions_and_a_worker_per_four_cpus():
    assert ServeSettings(cpus=2).engine_layout() == (2, 1, 2)  # as before on 2 cores
    assert ServeSettings(cpus=3).engine_layout() == (3, 1, 3)
    assert ServeSettings(cpus=4).engine_layout() == (2, 2, 4)
    assert ServeSettings(cpus=16).engine_layout() == (8, 2, 16)
    assert ServeSettings(cpus=16, threads=1).engine_layout()[:2] == (16, 1)
    assert ServeSettings(cpus=16, instances=4).engine_layout()[:2] == (4, 4)
    assert [ServeSettings(cpus=c).worker_count(generation=False) for c in (1, 2, 3, 4, 8, 16, 64)] == [1, 1, 1, 1, 2, 4, 16]
    assert ServeSettings(cpus=16).worker_count(generation=True) == 1
    assert ServeSettings(cpus=2, workers=2).worker_count(generation=False) == 2


def test_a_server_says_when_the_default_variant_was_timed_on_another_cpu(zoo, tmp_path, caplog):
    """The default variant is the fastest on the CPU the artifact was converted on (a CI runner's AMD EPYC, say);
    served on another (an AMX Xeon) another variant may be faster: the server says so, unless one is named."""
    from modelkiln.serve.metrics import Metrics
    from modelkiln.serve.served import served_model
    from modelkiln.serve.settings import ModelSpec

    artifact = tmp_path / "elsewhere"
    shutil.copytree(zoo.artifact("bert", "sentence-embeddings"), artifact)
    manifest = json.loads((artifact / "kiln.json").read_text())
    here = served_model(ModelSpec("here", str(artifact)), ServeSettings(), Metrics())
    assert "were timed on" not in caplog.text  # converted on this machine
    manifest["machine"] = {"cpu": "Some Other CPU", "isa": "AVX2 FMA", "cores": 2}
    (artifact / "kiln.json").write_text(json.dumps(manifest))
    served_model(ModelSpec("away", str(artifact)), ServeSettings(), Metrics())
    assert (f"model away: its variants were timed on Some Other CPU (AVX2 FMA), this host is "
            f"{cpu_description()['cpu']} ({cpu_description()['isa']}): variant {here.variant.name} is that machine's "
            "choice") in caplog.text
    caplog.clear()
    served_model(ModelSpec("named", str(artifact), variant=here.variant.name), ServeSettings(), Metrics())
    assert "were timed on" not in caplog.text  # a variant named: nothing to say
    manifest["variants"] = [v for v in manifest["variants"] if v["name"] == here.variant.name]
    (artifact / "kiln.json").write_text(json.dumps(manifest))
    served_model(ModelSpec("alone", str(artifact)), ServeSettings(), Metrics())
    assert "were timed on" not in caplog.text  # one variant: no other to choose
