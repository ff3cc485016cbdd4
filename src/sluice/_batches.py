"""Natural batching: a worker thread takes what queued up while it was busy.

SUMMARY
    items, stop = take_queued(queue, first, stop=None, limit=None)

DESCRIPTION
    Every worker thread of Sluice that turns a burst into one unit of work
    (a store's committer, the SQLite WAL syncer, the spool's janitor) waits
    for one item on a SimpleQueue, then takes whatever else is already
    queued -- no artificial wait -- up to a limit, and stops at the sentinel
    that tells it to end.  The rule lives here once.

SEE ALSO
    sluice.store._commit (GroupCommitter), sluice.store._sqlite_db
    (WalSyncer), sluice.spool.fs (delete_soon).
"""

from __future__ import annotations

import queue as queuelib
from typing import Any, TypeVar

__all__ = ["take_queued"]

T = TypeVar("T")


def take_queued(q: queuelib.SimpleQueue[Any], first: T, stop: object = None,
                limit: int | None = None) -> tuple[list[T], bool]:
    """``first`` and the items queued after it, and whether ``stop`` was met.

    Takes without waiting, until the queue is empty, ``stop`` comes (it is
    not returned, and nothing after it is taken) or ``limit`` items are in
    the list.  ``first`` is the item the caller waited for, never ``stop``.
    """
    items: list[T] = [first]
    while limit is None or len(items) < limit:
        try:
            nxt = q.get_nowait()
        except queuelib.Empty:
            break
        if nxt is stop:
            return items, True
        items.append(nxt)
    return items, False
