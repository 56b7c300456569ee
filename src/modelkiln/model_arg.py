"""A command's MODEL argument: an artifact folder as it is, or a model (a GGUF file, a Hugging Face
folder, a hub id) turned into its cached artifact, converted the first time (``model_cache.py``).

Every command that reads an artifact (serve, generate, bench, eval, tune, triton, ray) calls
``artifact_path``. The conversion runs ``kiln convert`` in a child process, its progress on this
process's stderr: the command's own process never imports torch (a server stays lean, and
``kiln generate``'s and ``kiln ray config``'s stdout stays theirs). A cache hit costs a
fingerprint of the source (milliseconds) and no child.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import typer

from .manifest import is_artifact
from .errors import KilnError

# The convert options other commands pass on (a model given as an artifact ignores them); their
# typer options, shared by every such command.
TASK_HELP = ("When MODEL is a model, not an artifact: its task for the conversion, as kiln convert --task "
             "(default: auto).")
PRECISION_HELP = ("When MODEL is a model, not an artifact: the variants to build, as kiln convert --precision "
                  "(default: kiln convert's).")


TASK = typer.Option(None, "--task", help=TASK_HELP, show_default=False)
PRECISION = typer.Option(None, "--precision", help=PRECISION_HELP, show_default=False)


def convert_options(task: Optional[str] = None, precision: Optional[str] = None,
                    name: Optional[str] = None) -> dict[str, str]:
    """The options a conversion is given (and its cache key holds): those given, less kiln convert's
    defaults (``--task auto``, an empty ``--precision``), as kiln convert leaves those out itself."""
    return {option: value for option, value in (("task", task), ("precision", precision), ("name", name))
            if value and not (option == "task" and value == "auto")}


def artifact_path(ref: str, task: Optional[str] = None, precision: Optional[str] = None,
                  name: Optional[str] = None) -> Path:
    """``ref`` itself when it is an artifact folder (or names nothing here: the command reports that
    as before); else its cached conversion, converted now when there is none (``name``: the model's
    name in it, by default the file's or folder's)."""
    from .model_cache import describe, entry_path, find_source, say_on_stderr as say

    if is_artifact(ref):
        if task or precision:
            say(f"note: {ref} is an artifact already; --task and --precision apply to models converted on the fly")
        return Path(ref)
    source = find_source(ref)
    if source is None:
        return Path(ref)
    options = convert_options(task, precision, name)
    entry = entry_path(source, options)
    if is_artifact(entry):
        say(f"using the cached conversion of {ref}: {entry}")
        return entry
    from .extras import require_extra

    require_extra("convert", f"converting {ref} (a model, not an artifact folder)",
                  "or pass an artifact folder written by kiln convert")
    flags = [part for option, value in options.items() for part in (f"--{option}", value)]
    env = {**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    # kiln convert's table and "Wrote" line go to stderr too: stdout is the command's own
    done = subprocess.run([sys.executable, "-m", "modelkiln", "convert", source.location, *flags], stdout=2, env=env)
    if done.returncode != 0:
        raise KilnError(f"converting {ref} failed (kiln convert exited with {done.returncode}; see above)")
    entry = entry_path(describe(ref), options)
    if not is_artifact(entry):
        raise KilnError(f"{ref} changed while it was converted; run the command again")
    return entry


def model_argument(arg: str, task: Optional[str] = None, precision: Optional[str] = None) -> str:
    """``PATH`` or ``NAME=PATH`` (kiln serve's and kiln ray's model arguments) with PATH an artifact."""
    name, sep, path = arg.partition("=")
    if not sep:
        return str(artifact_path(arg, task, precision))
    return f"{name}={artifact_path(path, task, precision)}" if path else arg
