"""`ReadAhead(items, depth)`: `items` produced on a background thread at most `depth` ahead, in order; a producer's
exception is re-raised in the consumer; `close()` (also on exhaustion or collection) joins the thread."""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterable, Iterator
from typing import Generic, TypeVar

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
