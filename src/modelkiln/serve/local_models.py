"""The model repository's changes carried out in this process's data plane (``repository.ModelSet``).

A new model is built and warmed up on a worker thread (the event loop keeps serving), then the
data plane's model map is replaced by a new dict in one assignment (readers see the old map or
the new one, never half of a change). A model leaves the map first (new requests get 404), then
the requests it already accepted finish (``ServedModel.in_flight``), then its batcher stops and
its sessions go, off the event loop."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Mapping
from typing import Protocol

from ..errors import ArtifactError, KilnError
from .metrics import Metrics
from .served import ServedModel, served_model
from .settings import ModelSpec, ServeSettings


class ModelMap(Protocol):
    """What changes in the data plane (``DataPlane``): its model map, replaced by a new dict in
    one assignment, never mutated; and the metrics a new model reports to."""

    models: dict[str, ServedModel]
    metrics: Metrics
    settings: ServeSettings


def _release_when_built(built: asyncio.Future) -> None:
    """(Event loop, when a build nobody awaits any more ends.) Release its model off the loop."""
    if not built.cancelled() and built.exception() is None:
        threading.Thread(target=built.result().release, name="release-unwanted-model", daemon=True).start()


class LocalModels:
    """``repository.ModelSet`` over a data plane's model map."""

    def __init__(self, plane: ModelMap):
        self.plane = plane

    def served(self) -> Mapping[str, bool]:
        return {name: m.ready for name, m in self.plane.models.items()}

    async def install(self, spec: ModelSpec, loading: set[str]) -> None:
        """Build and warm up the model on a worker thread, then swap it in (and retire the one it
        replaces). ``loading`` holds the name while the build runs."""
        loading.add(spec.name)
        built = asyncio.get_running_loop().run_in_executor(None, self.build, spec)
        abandoned = False
        try:
            # shielded: if the caller goes away (a client hanging up, shutdown) the build still
            # ends, and the model it made is released instead of leaking its batcher threads;
            # the name shows as loading until then
            model = await asyncio.shield(built)
        except asyncio.CancelledError:
            abandoned = True

            def release(done: asyncio.Future) -> None:
                loading.discard(spec.name)
                _release_when_built(done)

            built.add_done_callback(release)
            raise
        finally:
            if not abandoned:
                loading.discard(spec.name)
        old = self.plane.models.get(spec.name)
        self.plane.models = {**self.plane.models, spec.name: model}  # one assignment: readers see old or new
        if old is not None:
            await self.retire(old)

    async def remove(self, name: str) -> None:
        model = self.plane.models.get(name)
        if model is None:
            return
        self.plane.models = {k: v for k, v in self.plane.models.items() if k != name}  # new requests: 404 now
        await self.retire(model)

    def build(self, spec: ModelSpec) -> ServedModel:
        """(Worker thread.) A loaded, warmed-up model, or ArtifactError saying why not."""
        try:
            model = served_model(spec, self.plane.settings, self.plane.metrics)
        except KilnError:
            raise
        except Exception as exc:
            raise ArtifactError(f"{type(exc).__name__}: {exc}") from exc
        try:
            model.load()
        except BaseException as exc:
            model.release()
            if isinstance(exc, KilnError):
                raise
            if isinstance(exc, Exception):  # onnxruntime / tokenizers on a corrupt or missing file
                raise ArtifactError(f"{type(exc).__name__}: {str(exc)[:500]}") from exc
            raise
        return model

    async def retire(self, model: ServedModel) -> None:
        """Let the requests it accepted finish (they time out after request_timeout_s at worst),
        then stop its batcher and drop its sessions off the event loop."""
        deadline = time.monotonic() + self.plane.settings.request_timeout_s + 5.0
        while model.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(model.release)
