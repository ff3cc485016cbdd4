"""Timers: the scheduler's own clock events, in one heap.

SUMMARY
    timers = Timers()
    timers.set(at, Timer.SLOT, blocker)     (and the other kinds)
    for timer in timers.due(now, live): ...
    timers.next_at(live)                    for next_wakeup()

DESCRIPTION
    The scheduler never reads a clock: it is told ``now`` with every event
    and answers with the time it next needs to be called (next_wakeup).
    Its timers are what it must do at a time of its own: a rate window or
    connect interval frees a slot, a suspension expires, a dead
    destination comes back, a condition added at run time expires.

STRATEGIES
    Lazy cancellation.  A timer is never removed from the heap; when it
    comes due, the scheduler asks whether it still stands (``live``) --
    the blocker's timer_at is still that time, the suspension is still in
    force with that expiry -- and skips it otherwise.  Setting and
    cancelling are therefore O(log n) and O(1).

    Ties break by the order timers were set, so that two runs with the
    same events fire them in the same order.

SEE ALSO
    sluice.scheduler.scheduler (what each kind does)
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from enum import Enum
from typing import Any, NamedTuple

__all__ = ["Timer", "Timers"]


class Timer(Enum):
    """What a timer does when it comes due."""

    SLOT = "slot"  # a blocker's rate window or connect interval frees a slot
    SUSPENSION = "suspension"  # a suspension expires
    DEAD = "dead"  # a dead destination comes back
    CONDITION = "condition"  # a condition added at run time expires


class Due(NamedTuple):
    at: float
    seq: int
    kind: Timer
    obj: Any


class Timers:
    """A heap of (at, seq, kind, object)."""

    __slots__ = ("heap", "seq")

    def __init__(self) -> None:
        self.heap: list[Due] = []
        self.seq = 0

    def set(self, at: float, kind: Timer, obj: Any) -> None:
        """Set a timer of ``kind`` for ``obj`` at ``at``."""
        self.seq += 1
        heapq.heappush(self.heap, Due(at, self.seq, kind, obj))

    def due(self, now: float, live: Callable[[Due], bool]) -> Iterator[Due]:
        """The live timers due by ``now``, in order; each is gone once yielded."""
        heap = self.heap
        while heap and heap[0].at <= now:
            timer = heapq.heappop(heap)
            if live(timer):
                yield timer

    def cancel(self, kind: Timer, undo: Callable[[Due], None]) -> None:
        """Void every timer of ``kind``: ``undo`` each (so ``live`` refuses it), and drop them."""
        kept = []
        for timer in self.heap:
            if timer.kind is kind:
                undo(timer)
            else:
                kept.append(timer)
        heapq.heapify(kept)
        self.heap = kept

    def next_at(self, live: Callable[[Due], bool]) -> float | None:
        """When the earliest live timer is due (dead ones on top are dropped)."""
        heap = self.heap
        while heap and not live(heap[0]):
            heapq.heappop(heap)
        return heap[0].at if heap else None
