"""Worker processes: how many this process may run (`available_cpus`), and children that die with their parent (a
stage or command killed even by `kill -9` leaves no worker behind)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent: int, sig: int = signal.SIGKILL) -> None:
    """Call in a child (forked worker, or a preexec_fn): the kernel sends it `sig` when `parent` dies, and a parent
    already gone before the call ends it at once (the ppid check closes the race)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    if os.getppid() != parent:
        os._exit(1)


def available_cpus() -> int:
    """CPUs this process may run on: its affinity mask (a container's cpuset, taskset), not the machine's count.
    CPU-bound stage work (tokenising, counting) sizes its worker processes by it."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
