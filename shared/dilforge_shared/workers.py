"""Stage work beside the main thread: worker processes (`available_cpus`; `die_with_parent`, so a stage killed even
by `kill -9` leaves none behind) and `ReadAhead(items, depth)`: `items` produced on a background thread at most
`depth` ahead, in order, errors re-raised in the consumer; `close()` (also on exhaustion or collection) joins it."""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import signal
import sys
import threading
from collections.abc import Iterable, Iterator
from typing import Generic, TypeVar

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


T = TypeVar("T")
_ITEM, _END, _ERROR = 0, 1, 2


def _produce(items: Iterable, q: queue.Queue, stop: threading.Event) -> None:
    """The thread's body; it holds no reference to the ReadAhead, so an abandoned one can be collected. A put
    blocked on a full queue returns once `close` drains it."""
    try:
        for item in items:
            if stop.is_set():
                return
            q.put((_ITEM, item))
        q.put((_END, None))
    except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which re-raises it
        q.put((_ERROR, exc))
    finally:
        if (close := getattr(items, "close", None)) is not None:
            close()


class ReadAhead(Generic[T]):
    def __init__(self, items: Iterable[T], depth: int = 2, name: str = "read-ahead"):
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=_produce, args=(items, self._queue, self._stop), name=name, daemon=True)
        self._thread.start()

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        if self._done:
            raise StopIteration
        kind, payload = self._queue.get()
        if kind == _ITEM:
            return payload
        self.close()
        if kind == _ERROR:
            raise payload
        raise StopIteration

    def close(self) -> None:
        """Stop the producer and join it (idempotent); queued items are dropped."""
        self._done = True
        self._stop.set()
        while self._thread.is_alive():
            with contextlib.suppress(queue.Empty):
                self._queue.get_nowait()
            self._thread.join(timeout=0.05)

    def __enter__(self) -> ReadAhead[T]:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
