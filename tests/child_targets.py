"""Functions for tests/bench/test_isolation.py to run in a child process (the child imports them by name,
so they live in a module of their own): one for each way a peer engine ends."""

from __future__ import annotations

import os
import signal
import time

from modelkiln.errors import KilnError


def echo(argument):
    return {"got": argument, "pid": os.getpid()}


def segfault(argument):
    print("native library output on stdout")
    os.kill(os.getpid(), signal.SIGSEGV)


def hang(argument):
    time.sleep(600)


def missing_dependency(argument):
    import a_module_nobody_installed  # noqa: F401


def raises(argument):
    raise ValueError(f"bad value {argument}\nsecond line")


def expected_error(argument):
    raise KilnError("the source model of 'x' is not available; pass --no-reference")


def exits(argument):
    os._exit(3)
