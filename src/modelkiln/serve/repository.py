"""Triton's model repository on a folder: every artifact folder in it is a model named after the
folder, loaded and unloaded while the server runs.

Control modes (``--model-control-mode``, as Triton's):
- ``none``: every folder is loaded at start; load/unload answer ModelControlError (405).
- ``explicit``: nothing from the folder is loaded at start (Triton without ``--load-model``);
  ``POST /v2/repository/models/{m}/load`` / ``unload`` (and gRPC's RepositoryModelLoad/Unload)
  do it. Models given on the command line are served as usual and may be unloaded too.
- ``poll``: every folder is loaded at start, and every ``repository_poll_s`` seconds new folders
  are loaded, changed ones (a different ``kiln.json`` or model file) reloaded and removed ones
  unloaded; the API refuses load/unload then, as Triton does ("not allowed if polling is enabled").

This module decides what is served (modes, checks, poll's comparisons, why a folder is not
loaded); a ``ModelSet`` carries each decision out: ``local_models.LocalModels`` in this process's
data plane, or, with ``--workers N``, ``workers.WorkerModels`` in every worker process at once (so
a load answered 200 is served by all of them). How a change happens without hurting other
requests is ``LocalModels``': the new model is built and warmed up on a worker thread, then swapped
in; an unload takes the model out first (new requests get 404) and waits for the requests it
already accepted. A reload installs the new model before the old one leaves, so there is no gap.
A load that fails raises ArtifactError (400) and changes nothing."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ..errors import ArtifactError, KilnError, ModelControlError, ModelNotFoundError
from ..manifest import MANIFEST_NAME
from .settings import ModelSpec, ServeSettings
from .types import MODEL_VERSION, RepositoryModel

log = logging.getLogger("modelkiln.serve")

CONTROL_MODES = ("none", "explicit", "poll")


@dataclass(frozen=True)
class Folder:
    """One artifact folder of the repository and a fingerprint of its contents (``kiln.json``'s
    bytes and every file's size and modification time), which poll mode compares."""

    name: str
    path: Path
    fingerprint: str


def artifact_names(root: Path) -> list[str]:
    """The model names in the repository: sub-folders holding a ``kiln.json`` (others are ignored)."""
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError:
        return []
    return [e.name for e in entries
            if e.is_dir() and not e.name.startswith(".") and os.path.isfile(os.path.join(e.path, MANIFEST_NAME))]


def fingerprint(folder: Path) -> str:
    digest = hashlib.sha256()
    try:
        digest.update((folder / MANIFEST_NAME).read_bytes())
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                stat = path.stat()
                digest.update(f"{path.relative_to(folder)}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
    except OSError as exc:  # a folder removed or rewritten while scanned: changed, the next scan settles it
        digest.update(repr(exc).encode())
    return digest.hexdigest()


def scan(root: Path) -> dict[str, Folder]:
    """Blocking (reads every manifest): call from a worker thread while serving."""
    return {name: Folder(name, root / name, fingerprint(root / name)) for name in artifact_names(root)}


class ModelSet(Protocol):
    """Where the repository's decisions take effect: the models being served, by name (True when
    ready), a folder installed (built, then swapped in for any model of its name; ArtifactError
    when it cannot be loaded, and then nothing changed), a model removed (after the requests it
    accepted). ``loading`` names a build that goes on after its caller left (see ``LocalModels``)."""

    def served(self) -> Mapping[str, bool]: ...
    async def install(self, spec: ModelSpec, loading: set[str]) -> None: ...
    async def remove(self, name: str) -> None: ...


class ModelRepository:
    """The load/unload/poll decisions over a ``ModelSet`` (``attach`` it first)."""

    def __init__(self, settings: ServeSettings, root: Path | None):
        mode = settings.model_control_mode
        if mode not in CONTROL_MODES:
            raise KilnError(f"model control mode must be one of {', '.join(CONTROL_MODES)}, not {mode!r}")
        if root is not None and not root.is_dir():
            raise KilnError(f"model repository {root} is not a folder")
        if root is None and mode != "none":
            raise KilnError(f"model control mode {mode} needs --model-repository")
        if settings.repository_poll_s <= 0:
            raise KilnError("repository_poll_s must be positive")
        self.settings = settings
        self.root = root
        self.mode = mode
        self.models: ModelSet | None = None
        self.loaded: dict[str, str] = {}  # repository models being served → the fingerprint loaded
        self.reasons: dict[str, str] = {}  # why a repository model is not (or not newly) loaded
        self.failed: dict[str, str] = {}  # poll: fingerprint of a folder whose load failed (not retried)
        self.loading: set[str] = set()
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._poller: asyncio.Task | None = None

    # -- start ----------------------------------------------------------------------------------
    def startup_folders(self) -> list[Folder]:
        """The folders to load before serving: all of them, but none in explicit mode."""
        if self.root is None or self.mode == "explicit":
            return []
        return list(scan(self.root).values())

    def spec(self, folder: Folder) -> ModelSpec:
        return ModelSpec(name=folder.name, path=str(folder.path), variant=self.settings.variant)

    def attach(self, models: ModelSet, loaded: list[Folder]) -> None:
        self.models = models
        self.loaded = {f.name: f.fingerprint for f in loaded}

    async def start(self) -> None:
        if self.mode == "poll" and self._poller is None:
            self._poller = asyncio.create_task(self._poll_forever(), name="model-repository-poll")

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            try:
                await self._poller
            except asyncio.CancelledError:
                pass
            self._poller = None

    # -- the repository extension -----------------------------------------------------------------
    async def index(self, ready_only: bool = False) -> list[RepositoryModel]:
        """Every served model, and every repository folder not loaded (UNAVAILABLE, with why)."""
        return await asyncio.to_thread(self._index, ready_only)  # reads the folder: off the event loop

    def _index(self, ready_only: bool) -> list[RepositoryModel]:
        assert self.models is not None
        served = self.models.served()
        entries = {name: RepositoryModel(name, MODEL_VERSION, "READY" if ready else "UNAVAILABLE",
                                         "" if ready else "not ready")
                   for name, ready in served.items()}
        for name in artifact_names(self.root) if self.root is not None else []:
            if name in self.loading and name not in served:
                entries[name] = RepositoryModel(name, MODEL_VERSION, "LOADING", "")
            elif name not in served:
                entries[name] = RepositoryModel(name, MODEL_VERSION, "UNAVAILABLE",
                                                self.reasons.get(name, "not loaded"))
        index = [entries[name] for name in sorted(entries)]
        return [e for e in index if e.state == "READY"] if ready_only else index

    async def load(self, name: str) -> None:
        self._check_api("load", name)
        if self.root is None or name not in artifact_names(self.root):
            raise ModelNotFoundError(f"no model '{name}' in the repository {self.root}")
        folder = self.root / name
        folder_now = await asyncio.to_thread(lambda: Folder(name, folder, fingerprint(folder)))
        await self._load(folder_now)

    async def unload(self, name: str) -> None:
        self._check_api("unload", name)
        assert self.models is not None
        served = self.models.served()
        if name not in served:
            if self.root is not None and name in artifact_names(self.root):
                return  # in the repository, not loaded: nothing to do (Triton answers success too)
            raise ModelNotFoundError(f"unknown model '{name}' (serving: {', '.join(served) or 'none'})")
        await self._unload(name, "unloaded")

    def _check_api(self, action: str, name: str) -> None:
        if self.mode != "explicit":
            why = ("models are fixed at start" if self.mode == "none"
                   else "the repository is polled: change its folders instead")
            raise ModelControlError(f"cannot {action} '{name}': {why} (model control mode {self.mode})")

    # -- load and unload ------------------------------------------------------------------------
    async def _load(self, folder: Folder) -> None:
        """Install the folder's model (replacing one of the same name). Raises ArtifactError, leaving
        the served set as it was, when the folder cannot be loaded."""
        assert self.models is not None
        async with self._locks[folder.name]:
            if self.loaded.get(folder.name) == folder.fingerprint and folder.name in self.models.served():
                return  # already serving exactly this folder
            replacing = folder.name in self.models.served()
            started = time.perf_counter()
            try:
                await self.models.install(self.spec(folder), self.loading)
            except KilnError as exc:
                self.reasons[folder.name] = f"load failed: {exc}"
                raise ArtifactError(f"failed to load '{folder.name}': {exc}") from exc
            self.loaded[folder.name] = folder.fingerprint
            self.reasons.pop(folder.name, None)
            self.failed.pop(folder.name, None)
            log.info("%s model %s from %s in %.1fs", "reloaded" if replacing else "loaded", folder.name, folder.path,
                     time.perf_counter() - started)

    async def _unload(self, name: str, reason: str) -> None:
        assert self.models is not None
        async with self._locks[name]:
            if name not in self.models.served():
                return
            self.loaded.pop(name, None)
            self.reasons[name] = reason
            await self.models.remove(name)
            log.info("unloaded model %s", name)

    # -- poll mode ------------------------------------------------------------------------------
    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.repository_poll_s)
            try:
                await self.poll()
            except Exception:  # a scan must never end the poller; say why and try at the next tick
                log.exception("polling the model repository %s failed", self.root)

    async def poll(self) -> None:
        """One scan: unload removed folders, load new ones, reload changed ones. A folder that
        fails to load is logged once and retried only when it changes again."""
        assert self.root is not None
        found = await asyncio.to_thread(scan, self.root)
        for name in sorted(set(self.loaded) - set(found)):
            await self._unload(name, "removed from the repository")
        for name, folder in found.items():
            if self.loaded.get(name) == folder.fingerprint or self.failed.get(name) == folder.fingerprint:
                continue
            try:
                await self._load(folder)
            except ArtifactError as exc:
                self.failed[name] = folder.fingerprint
                log.warning("%s (the served set is unchanged)", exc)
