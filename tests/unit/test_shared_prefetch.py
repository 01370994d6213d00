"""The one read-ahead every stage uses (dilforge_shared.prefetch.read_ahead): items in order, at most `depth`
ahead, a producer's exception re-raised in the consumer, and the thread stopped and joined on close, on
exhaustion and when the iterator is abandoned."""

from __future__ import annotations

import gc
import threading
import time

import pytest
from dilforge_shared.prefetch import read_ahead


def alive(name: str) -> bool:
    return any(t.name == name and t.is_alive() for t in threading.enumerate())


def counting(produced: list, n: int = 1000):
    for i in range(n):
        produced.append(i)
        yield i


def test_items_arrive_in_order_and_the_thread_ends_with_them():
    it = read_ahead(iter(range(100)), depth=3, name="ra-order")
    assert list(it) == list(range(100))
    assert not alive("ra-order")
    assert list(it) == []  # exhausted stays exhausted


def test_the_producer_stays_at_most_depth_ahead_and_close_joins_it():
    produced: list[int] = []
    closed = []

    def items():
        try:
            yield from counting(produced)
        finally:
            closed.append(True)

    it = read_ahead(items(), depth=2, name="ra-bounded")
    assert next(it) == 0
    time.sleep(0.3)
    # 1 consumed + 2 queued + 1 waiting to be put: never more, however long the consumer takes
    assert len(produced) <= 4
    it.close()
    assert not alive("ra-bounded")
    assert closed == [True]  # the source was closed too (its finally ran)
    frozen = len(produced)
    time.sleep(0.2)
    assert len(produced) == frozen  # nothing changes after close
    with pytest.raises(StopIteration):
        next(it)


def test_a_producer_error_is_raised_in_the_consumer_after_the_items_before_it():
    def items():
        yield 1
        yield 2
        raise OSError("disk gone")

    it = read_ahead(items(), depth=4, name="ra-error")
    assert next(it) == 1 and next(it) == 2
    with pytest.raises(OSError, match="disk gone"):
        next(it)
    assert not alive("ra-error")


def test_an_abandoned_read_ahead_stops_its_thread():
    produced: list[int] = []
    it = read_ahead(counting(produced), depth=2, name="ra-abandoned")
    assert next(it) == 0
    del it
    gc.collect()
    deadline = time.monotonic() + 5
    while alive("ra-abandoned") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive("ra-abandoned")
    assert len(produced) < 10
