"""take_queued: what a worker thread takes after the item it waited for."""

from __future__ import annotations

import queue

from sluice._batches import take_queued


def _q(*items: object) -> queue.SimpleQueue[object]:
    q: queue.SimpleQueue[object] = queue.SimpleQueue()
    for item in items:
        q.put(item)
    return q


def test_takes_everything_queued_without_waiting() -> None:
    q = _q(2, 3)
    assert take_queued(q, 1) == ([1, 2, 3], False)
    assert q.empty()


def test_stops_at_the_sentinel_and_leaves_what_follows() -> None:
    stop = object()
    q = _q(2, stop, 4)
    assert take_queued(q, 1, stop) == ([1, 2], True)
    assert q.get_nowait() == 4


def test_none_is_the_default_sentinel() -> None:
    assert take_queued(_q(None, 5), 1) == ([1], True)


def test_a_limit_leaves_the_rest_queued() -> None:
    q = _q(2, 3, 4)
    assert take_queued(q, 1, limit=2) == ([1, 2], False)
    assert [q.get_nowait(), q.get_nowait()] == [3, 4]
