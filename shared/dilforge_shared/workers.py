"""Worker processes of a stage: how many it may run (`available_cpus`) and `die_with_parent`, so a stage killed
even by `kill -9` leaves none behind."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent: int, sig: int = signal.SIGKILL) -> None:
    """In a child: the kernel sends it `sig` when `parent` dies; a parent already gone ends it at once."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    if os.getppid() != parent:
        os._exit(1)


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask: a container's cpuset), not the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
