"""`read_ahead(items, depth)`: `items` produced on a background thread at most `depth` ahead, in order; a producer's
exception is re-raised in the consumer; the thread starts at the first item and is joined when the iterator ends,
is closed or is collected."""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")
_END = object()


def _produce(items: Iterable, q: queue.Queue, stop: threading.Event) -> None:
    """The thread's body: (item, None), then (_END, the error or None). A put blocked on a full queue returns once
    the consumer drains it on close."""
    try:
        for item in items:
            if stop.is_set():
                return
            q.put((item, None))
        q.put((_END, None))
    except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which re-raises it
        q.put((_END, exc))
    finally:
        if (close := getattr(items, "close", None)) is not None:
            close()


def read_ahead(items: Iterable[T], depth: int = 2, name: str = "read-ahead") -> Iterator[T]:
    q: queue.Queue = queue.Queue(maxsize=max(1, depth))
    stop = threading.Event()
    thread = threading.Thread(target=_produce, args=(items, q, stop), name=name, daemon=True)
    thread.start()
    try:
        while (got := q.get())[0] is not _END:
            yield got[0]
        if got[1] is not None:
            raise got[1]
    finally:  # queued items are dropped
        stop.set()
        while thread.is_alive():
            with contextlib.suppress(queue.Empty):
                q.get_nowait()
            thread.join(timeout=0.05)
