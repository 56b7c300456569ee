"""The model cache: conversions kept so that every command can start from the model you have.

``kiln serve model.gguf`` (or a Hugging Face folder, or a hub id) converts the model once, with
the defaults, into ``$KILN_CACHE/models/<key>`` and serves that artifact; later runs find it and
start at once. Converting takes minutes and a served artifact must not change under a server, so
the cache is strict about three things:

- **The key** is everything that decides the artifact: the source's resolved path and a
  fingerprint of its content (a hub id: its revision), modelkiln's version, and the convert
  options given (``--task``, ``--precision``...; an option left at its default is not part of
  it). A changed source gets a new key, hence a new conversion; an old entry stays until
  ``kiln cache rm`` (``kiln cache ls`` marks it stale).
- **The fingerprint is fast, not a full hash**: the size and mtime of every file and a SHA-256 of
  its first and last MiB (which hold a GGUF file's header and metadata, and a safetensors file's
  header). Hashing all of a 100 MB GGUF file would cost a fraction of a second, an 8B model's
  5 GB several seconds (more from a cold disk) on every start. An edit that keeps a file's size,
  mtime and first and last MiB goes unseen; ``touch`` (or a copy that does not keep mtimes)
  converts again.
- **Atomic and once**: the conversion writes a hidden temporary folder beside the entry and
  renames it into place at the end (``atomic.atomic_folder``), so a killed conversion leaves
  nothing that looks like an artifact; an exclusive ``fcntl.flock`` on the key makes a second
  process starting at the same time wait, then find the artifact the first one wrote.

``model_arg.artifact_path`` is what commands call; this module holds the cache itself.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import KilnError, ModelLoadError
from .manifest import Manifest, is_artifact

SAMPLE_BYTES = 1 << 20  # hashed from the start and from the end of every file
Say = Callable[[str], None]


def say_on_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def cache_root() -> Path:
    """``$KILN_CACHE``, else ``$KILN_CACHE_DIR`` (the name the default model's cache had first), else
    ``$XDG_CACHE_HOME/modelkiln``, else ``~/.cache/modelkiln``."""
    for var in ("KILN_CACHE", "KILN_CACHE_DIR"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser().absolute()
    return (Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "modelkiln").expanduser().absolute()


def models_dir() -> Path:
    return cache_root() / "models"


# --- what a source is ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    """A model to convert, as the cache keys it."""

    ref: str  # as given
    kind: str  # "gguf", "folder" or "hub"
    location: str  # the resolved path, or the hub id
    fingerprint: str  # content fingerprint, or "revision <sha>"
    name: str  # the artifact's model name: the file's stem, the folder's name, the hub id's last part


def _sample_file(h: Any, path: Path, label: str) -> None:
    st = path.stat()
    h.update(f"{label}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    with path.open("rb") as f:
        h.update(f.read(SAMPLE_BYTES))
        if st.st_size > SAMPLE_BYTES:
            f.seek(max(SAMPLE_BYTES, st.st_size - SAMPLE_BYTES))
            h.update(f.read(SAMPLE_BYTES))


def fingerprint(path: Path) -> str:
    """A file's, or every file's in a folder (hidden ones left out: .git, .cache), size, mtime and
    first and last MiB, hashed."""
    h = hashlib.sha256()
    if path.is_file():
        _sample_file(h, path, path.name)
        return h.hexdigest()
    for folder, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(f for f in files if not f.startswith(".")):
            file = Path(folder) / name
            if file.is_file():
                _sample_file(h, file, str(file.relative_to(path)))
    return h.hexdigest()


def _hub_revision(repo_id: str) -> str:
    """The commit the hub serves for ``repo_id`` now (offline: the one the local hub cache holds)."""
    from .convert.source import check_hub_reachable, hub_offline

    if hub_offline():
        from huggingface_hub import constants

        ref = Path(constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}" / "refs" / "main"
        if not ref.is_file():
            raise ModelLoadError(f"{repo_id} is not in the local hub cache ({constants.HF_HUB_CACHE}) and "
                                 "HF_HUB_OFFLINE is set")
        return ref.read_text().strip()
    check_hub_reachable(repo_id)
    from huggingface_hub import HfApi

    try:
        return str(HfApi().model_info(repo_id, timeout=10).sha)
    except Exception as exc:  # not found, gated, a timeout: huggingface_hub raises many kinds
        raise ModelLoadError(f"cannot look {repo_id} up on the Hugging Face hub: {str(exc).splitlines()[0]}") from exc


def find_source(ref: str) -> Source | None:
    """What ``ref`` names: a GGUF file, a model folder, or a hub id; None for a path that does not
    exist (the command reports it as it always has). Raises for a file or folder that is no model."""
    from .convert.source import find_gguf, is_hub_id

    path = Path(ref).expanduser()
    if path.exists():
        resolved = path.resolve()
        if path.is_file():
            find_gguf(ref)  # a file that is not GGUF fails here, with its first bytes named
            return Source(ref, "gguf", str(resolved), fingerprint(resolved), resolved.stem)
        if not (path / "config.json").is_file() and find_gguf(ref) is None:
            raise ModelLoadError(f"{ref} is not a modelkiln artifact (no kiln.json) nor a model (no config.json, "
                                 "no .gguf file)")
        return Source(ref, "folder", str(resolved), fingerprint(resolved), resolved.name)
    if ref.endswith(".gguf") or not is_hub_id(ref):
        return None
    return Source(ref, "hub", ref, f"revision {_hub_revision(ref)}", ref.rsplit("/", 1)[-1])


def describe(ref: str) -> Source:
    source = find_source(ref)
    if source is None:
        raise ModelLoadError(f"{ref} does not exist")
    return source


# --- keys and entries ---------------------------------------------------------------------------


def key_options(options: Mapping[str, object]) -> dict[str, str]:
    """The convert options as the key holds them: strings, ``precision``'s list in one order."""
    out = {name: str(value) for name, value in options.items() if value is not None}
    if "precision" in out:
        out["precision"] = ",".join(sorted({p.strip() for p in out["precision"].split(",") if p.strip()}))
    return out


def cache_key(source: Source, options: Mapping[str, object]) -> str:
    from . import __version__

    material = {"kind": source.kind, "location": source.location, "fingerprint": source.fingerprint,
                "modelkiln": __version__, "options": key_options(options)}
    digest = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:16]
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", source.name).strip(".-")[:60] or "model"
    return f"{slug}-{digest}"


def entry_path(source: Source, options: Mapping[str, object]) -> Path:
    return models_dir() / cache_key(source, options)


def _record_path(entry: Path) -> Path:
    return entry.parent / f"{entry.name}.json"


def _lock_path(entry: Path) -> Path:
    return entry.parent / ".locks" / f"{entry.name}.lock"


def _leftovers(entry: Path) -> list[Path]:
    """The hidden folders a conversion of ``entry`` writes on its way (atomic_folder's)."""
    return sorted(p for pattern in (".{}.tmp-*", ".{}.old-*") for p in entry.parent.glob(pattern.format(entry.name)))


@contextlib.contextmanager
def entry_lock(entry: Path, say: Say, what: str, blocking: bool = True) -> Iterator[bool]:
    """Hold ``entry``'s lock (exclusive ``flock``; the kernel releases it when the holder dies).
    Blocking: says whom it waits for, then waits; yields True. Not blocking: yields whether it got it."""
    lock = _lock_path(entry)
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not blocking:
                yield False
                return
            f.seek(0)
            holder = f.read().strip() or "?"
            say(f"waiting for process {holder}, which is converting {what} into {entry}")
            fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        try:
            yield True
        finally:
            f.seek(0)
            f.truncate()


def convert_into_cache(ref: str, options: Mapping[str, object], convert: Callable[[Path, Source], None],
                       force: bool = False, say: Say = say_on_stderr) -> Path:
    """The cached artifact of ``ref`` with ``options``, converted by ``convert(out, source)`` unless
    it is there already (``force``: converted again). ``convert`` must write ``out`` atomically, as
    ``kiln convert`` does."""
    source = describe(ref)
    entry = entry_path(source, options)
    with entry_lock(entry, say, ref):
        if is_artifact(entry) and not force:
            say(f"{ref} is converted already: {entry} (kiln convert --force converts it again)")
            return entry
        for left in _leftovers(entry):  # under the lock, every one of them was abandoned
            shutil.rmtree(left, ignore_errors=True)
        record = {"key": entry.name, "source": ref, "kind": source.kind, "location": source.location,
                  "fingerprint": source.fingerprint, "options": key_options(options), "modelkiln": _version(),
                  "converted": time.strftime("%Y-%m-%d %H:%M:%S")}
        _record_path(entry).write_text(json.dumps(record, indent=2) + "\n")
        say(f"converting {ref} into the model cache: {entry}")
        convert(entry, source)
    return entry


def _version() -> str:
    from . import __version__

    return __version__


# --- what is there, and freeing it ---------------------------------------------------------------


@dataclass
class Entry:
    key: str
    path: Path
    name: str  # the model name served
    source: str
    options: str  # the convert options given, "" for the defaults
    bytes: int
    status: str  # ready, stale (...), converting, interrupted
    converted: str


def _size(paths: list[Path]) -> int:
    total = 0
    for path in paths:
        for folder, _, files in os.walk(path):
            for name in files:
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(folder, name)).st_size
    return total


def _status(entry: Path, record: dict[str, Any]) -> str:
    if not is_artifact(entry):
        with entry_lock(entry, say_on_stderr, "", blocking=False) as free:
            return "interrupted" if free else "converting"
    if record.get("modelkiln") and record["modelkiln"] != _version():
        return f"stale: modelkiln {record['modelkiln']}"
    if record.get("kind") in ("gguf", "folder"):
        location = Path(record["location"])
        if not location.exists():
            return "stale: source gone"
        if fingerprint(location) != record.get("fingerprint"):
            return "stale: source changed"
    return "ready"


def list_entries() -> list[Entry]:
    root = models_dir()
    if not root.is_dir():
        return []
    keys = {p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")}
    keys |= {p.name[: -len(".json")] for p in root.glob("*.json")}
    entries = []
    for key in sorted(keys):
        entry = root / key
        try:
            record = json.loads(_record_path(entry).read_text())
        except (OSError, json.JSONDecodeError):
            record = {}
        name, source = "?", record.get("source", "?")
        if is_artifact(entry):
            with contextlib.suppress(KilnError):
                manifest = Manifest.load(entry)
                name, source = manifest.name, record.get("source") or str(manifest.source.get("model", "?"))
        options = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in record.get("options", {}).items())
        entries.append(Entry(key, entry, name, source, options, _size([entry, *_leftovers(entry)]),
                             _status(entry, record), record.get("converted", "?")))
    return entries


def remove_entry(key: str) -> int:
    """Delete one entry (its artifact, record and leftovers); the bytes freed. Refused while a
    process converts it."""
    entry = models_dir() / key
    if not entry.is_dir() and not _record_path(entry).exists() and not _leftovers(entry):
        known = ", ".join(e.key for e in list_entries()) or "the cache is empty"
        raise KilnError(f"no cache entry {key} ({known})")
    with entry_lock(entry, say_on_stderr, key, blocking=False) as free:
        if not free:
            raise KilnError(f"{key} is being converted by another process; not removed")
        freed = _size([entry, *_leftovers(entry)])
        for path in (entry, *_leftovers(entry)):
            shutil.rmtree(path, ignore_errors=True)
        _record_path(entry).unlink(missing_ok=True)
    return freed
