"""Host memory for KV caches, shared by every engine that keeps its cache in RAM: reservations that
cost address space until written, pages given back when a row ends, and the default budget.

A reservation is an anonymous memory map, committed by the operating system only where it is
written, so reserving the longest context for every row costs address space, not RAM, and a finished
row's pages go back to the system (``madvise(MADV_DONTNEED)``)."""

from __future__ import annotations

import mmap
import os
import sys

PAGE = mmap.PAGESIZE
# Reserve address space without committing memory for it, so the kernel's overcommit check does not
# refuse a reservation larger than RAM: what is used is bounded by the engine core's KV budget, not by
# the reservation. (Linux's MAP_NORESERVE; Python's mmap module names it from 3.13 only.)
_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)


def reserve(size: int) -> mmap.mmap:
    """``size`` bytes of zeroed anonymous memory, committed by the OS page by page as written."""
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0) | _NORESERVE
    return mmap.mmap(-1, max(1, size), flags=flags) if flags else mmap.mmap(-1, max(1, size))


def give_back(memory: mmap.mmap, start: int, size: int) -> None:
    """Return the pages of [start, start + size) to the OS (they read as zeros afterwards); a range
    that is not whole pages is kept (it shares pages with its neighbours)."""
    if start % PAGE or size % PAGE:
        return
    memory.madvise(mmap.MADV_DONTNEED, start, size)


KV_MEMORY_SHARE = 4  # the default KV budget: a quarter of the memory this process may use


def usable_memory() -> int:
    """Bytes of memory this process may use: the machine's, or less under a cgroup limit (a
    container's memory limit, Kubernetes' ``resources.limits.memory``)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8 << 30
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):  # cgroup v2, v1
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def host_kv_capacity(bytes_per_token: int, most: int) -> int:
    """Tokens of KV a host engine may hold: ``KV_MEMORY_SHARE`` of the usable memory, at most ``most``."""
    return max(1, min(most, usable_memory() // KV_MEMORY_SHARE // max(bytes_per_token, 1)))
