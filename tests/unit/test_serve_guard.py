"""The serve guard's body reading: an over-cap body is refused with 413, after being read to its end when it is
small enough to drain (a client still sending it gets the answer, not a broken pipe), at once when it is not."""

from __future__ import annotations

import asyncio

import pytest
from dilforge_serve.app import BadRequest, read_body


def messages(sizes: list[int]):
    """An ASGI receive() over body chunks of these sizes; records how many were read."""
    queue = [{"type": "http.request", "body": b"a" * n, "more_body": i < len(sizes) - 1} for i, n in enumerate(sizes)]
    read = []

    async def receive():
        message = queue.pop(0) if queue else {"type": "http.disconnect"}
        read.append(message)
        return message

    return receive, read


def test_a_body_within_the_cap_is_read_whole():
    receive, _ = messages([3, 4])
    assert asyncio.run(read_body(receive, 7, limit=10)) == b"a" * 7


@pytest.mark.parametrize("declared", [24, None])  # by Content-Length, or chunked past the cap
def test_an_over_cap_body_is_read_to_its_end_before_the_413(declared):
    receive, read = messages([6, 6, 6, 6])
    with pytest.raises(BadRequest) as err:
        asyncio.run(read_body(receive, declared, limit=10, drain=100))
    assert err.value.status == 413 and "exceeds 10 bytes" in err.value.message
    assert len(read) == 4 and read[-1]["more_body"] is False  # drained: the client finished sending


def test_a_body_past_the_drain_budget_is_refused_without_reading_it():
    receive, read = messages([6, 6, 6, 6])
    with pytest.raises(BadRequest):
        asyncio.run(read_body(receive, 24, limit=10, drain=20))
    assert read == []
