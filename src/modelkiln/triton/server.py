"""Start and stop a local ``tritonserver``: the 2.51 binary bundled in the ``nvidia-pytriton``
wheel (python backend only, CPU). Used by the tests, the benchmark and ``kiln loadtest``.

What it takes to run that binary outside pytriton:
- a backend directory whose ``python/`` holds ``libtriton_python.so`` and the
  ``triton_python_backend_stub`` built for *our* Python version (the wheel ships one per version);
- ``LD_LIBRARY_PATH`` with the wheel's ``nvidia_pytriton.libs`` (libtritonserver and friends) and
  our Python's LIBDIR (the stub links libpython3.X);
- our interpreter's ``bin`` first on ``PATH``: the stub embeds Python, which derives ``sys.prefix``
  from the ``python3`` it finds there, so a virtualenv's site-packages (numpy, tokenizers,
  onnxruntime) are importable inside the models without PYTHONPATH tricks."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import KilnError
from ..net import free_port


class TritonServerError(KilnError):
    """tritonserver is not installed, did not start, or did not get ready in time."""


@dataclass(frozen=True)
class Distribution:
    binary: Path
    python_backend: Path  # folder with libtriton_python.so
    stub: Path  # triton_python_backend_stub for this Python version
    libs: Path  # nvidia_pytriton.libs


def find_distribution() -> Distribution:
    try:
        import pytriton
    except ImportError:
        raise TritonServerError("tritonserver not found: pip install nvidia-pytriton (it bundles tritonserver)") from None
    root = Path(pytriton.__file__).parent
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    dist = Distribution(
        binary=root / "tritonserver" / "bin" / "tritonserver",
        python_backend=root / "tritonserver" / "backends" / "python",
        stub=root / "tritonserver" / "python_backend_stubs" / version / "triton_python_backend_stub",
        libs=root.parent / "nvidia_pytriton.libs",
    )
    for path in (dist.binary, dist.python_backend / "libtriton_python.so", dist.stub, dist.libs):
        if not path.exists():
            raise TritonServerError(f"the nvidia-pytriton install lacks {path} (python {version} not supported?)")
    return dist


@dataclass
class TritonServer:
    process: subprocess.Popen
    http_port: int
    grpc_port: int
    metrics_port: int
    log_path: Path
    workdir: Path  # backend folder and log; removed by stop()
    keep_log: bool = False
    _stopped: bool = field(default=False, repr=False)

    @property
    def url(self) -> str:
        """host:port for ``tritonclient.http.InferenceServerClient``."""
        return f"127.0.0.1:{self.http_port}"

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, timeout: float = 30.0) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # graceful: unloads models, stops the stubs
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)  # its own session: the server and its stubs only
                self.process.wait()
        if not self.keep_log:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> TritonServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _backend_dir(dist: Distribution, workdir: Path) -> Path:
    python = workdir / "backends" / "python"
    python.mkdir(parents=True)
    for item in dist.python_backend.iterdir():
        if item.is_file():
            os.symlink(item, python / item.name)
    shutil.copy2(dist.stub, python / "triton_python_backend_stub")
    return workdir / "backends"


def server_env(dist: Distribution) -> dict[str, str]:
    env = dict(os.environ)
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(dist.libs), libdir, env.get("LD_LIBRARY_PATH", "")) if p)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.setdefault("TOKENIZERS_PARALLELISM", "false")  # the stubs are forked processes
    return env


def start(repository: Path | str | Sequence[Path | str], timeout: float = 120.0, extra_args: tuple[str, ...] = (),
          keep_log: bool = False, metrics: bool = False) -> TritonServer:
    """Start tritonserver on ``repository`` (one folder, or several served together; free ports, own process group) and wait until every
    model is ready. Raises TritonServerError with the log's tail if it exits or times out.
    ``metrics``: serve Prometheus metrics on ``metrics_port`` (queue/compute times for `kiln loadtest`)."""
    dist = find_distribution()
    workdir = Path(tempfile.mkdtemp(prefix="kiln-triton-"))
    http_port, grpc_port, metrics_port = (free_port() for _ in range(3))
    log_path = workdir / "tritonserver.log"
    repositories = [repository] if isinstance(repository, (str, Path)) else list(repository)
    cmd = [
        str(dist.binary), *(f"--model-repository={Path(r).resolve()}" for r in repositories),
        f"--backend-directory={_backend_dir(dist, workdir)}",
        f"--http-port={http_port}", f"--grpc-port={grpc_port}", f"--metrics-port={metrics_port}",
        # Triton waits up to exit-timeout for clients to close keep-alive connections on SIGTERM;
        # a local test/bench server should go down promptly.
        f"--allow-metrics={str(metrics).lower()}", "--allow-cpu-metrics=false",
        "--exit-on-error=true", "--exit-timeout-secs=3",
        # the python backend names its shared-memory regions triton_python_backend_shm_region_<n>, <n>
        # counted per server: a second server on the machine took the first's names and its stubs
        # crashed at start ("Unable to initialize shared memory key", then a double free)
        f"--backend-config=python,shm-region-prefix-name=kiln_{workdir.name}_", *extra_args,
    ]
    with log_path.open("wb") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=server_env(dist),
                                   start_new_session=True, cwd=workdir)
    server = TritonServer(process, http_port, grpc_port, metrics_port, log_path=log_path, workdir=workdir,
                          keep_log=keep_log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = server.log_tail()
            server.keep_log = True
            raise TritonServerError(f"tritonserver exited with {process.returncode} (log: {log_path}):\n{tail}")
        try:
            with urllib.request.urlopen(f"http://{server.url}/v2/health/ready", timeout=2) as r:
                if r.status == 200:
                    return server
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(0.25)
    tail = server.log_tail()
    server.keep_log = True
    server.stop()
    raise TritonServerError(f"tritonserver was not ready after {timeout:.0f}s (log: {log_path}):\n{tail}")
