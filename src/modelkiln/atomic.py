"""Writing a folder all at once: used by `kiln convert` (artifacts) and `kiln triton` (repositories)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .errors import OutputNotWritableError


def check_output(out: Path, force: bool) -> None:
    """Fail early (before any slow work) when ``out`` exists and may not be replaced."""
    if out.resolve().exists() and not force:
        raise OutputNotWritableError(f"{out.resolve()} already exists (pass --force to replace it)")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def remove_abandoned(out: Path) -> None:
    """Delete the temporary folders a killed writer of ``out`` left (SIGKILL, power loss: no
    cleanup ran). Their names carry the writer's process id; a folder whose writer still runs is kept."""
    for stale in out.parent.glob(f".{out.name}.tmp-*-*"):
        pid = stale.name[len(f".{out.name}.tmp-"):].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)


def _umask() -> int:
    """The process's umask, read without setting it (os.umask sets it: a race with other threads)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


def _readable_by_all(folder: Path) -> None:
    """Every folder and file as a new one of the user's gets them (the umask's modes): mkdtemp makes the
    folder owner-only, and onnx writes external data files 0600; an artifact or repository is meant
    to be read by other users and containers too."""
    umask = _umask()
    for root, _, files in os.walk(folder):
        os.chmod(root, 0o777 & ~umask)
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):  # a link's mode is its target's: never reach outside the folder
                os.chmod(path, 0o666 & ~umask)


@contextlib.contextmanager
def atomic_folder(out: Path, force: bool) -> Iterator[Path]:
    """Yield a temporary folder beside ``out``; on success it replaces ``out`` by rename, on any
    failure (including Ctrl-C) it is deleted, so ``out`` is never half-written. A writer killed
    outright leaves its hidden temporary folder; the next write of ``out`` removes it."""
    out = out.resolve()
    check_output(out, force)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_abandoned(out)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))
    except OSError as exc:
        raise OutputNotWritableError(f"cannot write to {out.parent}: {exc.strerror or exc}") from exc
    try:
        yield tmp
        _readable_by_all(tmp)
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / out.name)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
