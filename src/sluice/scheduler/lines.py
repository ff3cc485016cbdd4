"""Lines: the ring of ready sub-queues, and the lines that wait on blockers.

SUMMARY
    lines = Lines(set_timer)
    lines.ready(sq)                  it has work and nothing holds it
    sq = lines.next()                whose turn it is (woken first)
    lines.park(sq, blockers, woken, now)    / lines.unpark(sq)
    lines.release(blocker, now)      it has room: wake that many waiters
    lines.dirty[blocker] = None; lines.release_dirty(now)

DESCRIPTION
    A *blocker* is anything a sub-queue can wait on: a counter entry over
    a threshold (sluice.scheduler.limits.Entry), a suspension, or a
    destination whose concurrency window is full.  A sub-queue whose head
    cannot go is parked in the lines of the blockers that hold it (one per
    source IP of a pool that cannot send) and is not looked at again until
    one of them lets one more through: a delivery finishing, a rate window
    passing, an interval elapsing, a suspension lifted or expiring.

STRATEGIES
    Round robin (Postfix fairness).  Ready sub-queues take turns in a ring,
    one delivery each; priority 1 before priority 0; a sub-queue woken by
    a blocker goes before the ring, so that a freed slot goes to the one
    that waited for it.

    Parking, not scanning.  A blocker with n free slots wakes at most n of
    its waiters, oldest first (``pending`` counts those woken and not yet
    looked at, so one slot is never promised twice), and a woken
    sub-queue that finds the slot taken keeps its place at the head of the
    line.  Pickup cost therefore does not depend on the number of queued
    jobs or parked sub-queues.

    Timed blockers set a timer.  A blocker with no free slot that knows
    when it will have one (free_at(): a rate window, an interval, an
    expiry) asks for a timer then; the scheduler's timer calls release().

INVARIANTS
    A sub-queue is in at most one place: the ring, a woken queue, or the
    lines of the blockers in its ``parked_on``.  A blocker's ``pending``
    is at most the sub-queues it woke that have not been visited.

SEE ALSO
    sluice.scheduler.scheduler (who drives it), sluice.scheduler.subqueues
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sluice.scheduler.subqueues import SubQueue

__all__ = ["Blocker", "Lines"]

Line = OrderedDict["SubQueue", None]


class Blocker:
    """Something that can hold sub-queues; it keeps them in line, per priority."""

    __slots__ = ("pending", "timer_at", "waiters")

    def __init__(self) -> None:
        self.waiters: tuple[Line, Line] | None = None  # per priority, made on first use
        self.pending = 0  # woken, not yet looked at
        self.timer_at: float | None = None

    def free(self, now: float) -> int:
        """How many more it lets through now."""
        raise NotImplementedError

    def free_at(self, now: float) -> float | None:
        """When a timed limit lets one more through; None = an event will."""
        return None

    def waiting(self) -> int:
        waiters = self.waiters
        return 0 if waiters is None else len(waiters[0]) + len(waiters[1])

    def line(self, priority: int) -> Line:
        if self.waiters is None:
            self.waiters = (OrderedDict(), OrderedDict())
        return self.waiters[priority]

    def members(self) -> list[SubQueue]:
        """Its waiters, priority 1 first, oldest first."""
        if self.waiters is None:
            return []
        return [*self.waiters[1], *self.waiters[0]]


class Lines:
    """The ready ring, the woken sub-queues, and the waiters of every blocker."""

    __slots__ = ("dirty", "ring", "set_timer", "woken")

    def __init__(self, set_timer: Callable[[Blocker, float], None]) -> None:
        self.set_timer = set_timer
        # Indexed by priority.
        self.ring: tuple[deque[SubQueue], deque[SubQueue]] = (deque(), deque())
        self.woken: tuple[deque[SubQueue], deque[SubQueue]] = (deque(), deque())
        # Blockers that finished deliveries freed, to release once per step.
        self.dirty: dict[Blocker, None] = {}

    def ready(self, sq: SubQueue) -> None:
        """``sq`` may go: to the back of the ring (unless it waits or is there)."""
        if not sq.in_ring and not sq.parked_on:
            self.ring[sq.priority].append(sq)
            sq.in_ring = True

    def next(self) -> SubQueue | None:
        """The next sub-queue to visit: woken first, then the ring; priority 1 first."""
        for p in (1, 0):
            for queue in (self.woken[p], self.ring[p]):
                if queue:
                    sq = queue.popleft()
                    sq.in_ring = False
                    return sq
        return None

    def park(self, sq: SubQueue, blockers: list[Blocker], woken: Blocker | None,
             now: float) -> None:
        """``sq`` waits on ``blockers``; at the head of ``woken``'s line (it
        was woken there and keeps its place), at the back of the others."""
        p = sq.priority
        for blocker in blockers:
            line = blocker.line(p)
            line[sq] = None
            if blocker is woken:
                line.move_to_end(sq, last=False)
            at = blocker.free_at(now)
            if at is not None:
                self.set_timer(blocker, at)
        sq.parked_on = tuple(blockers)

    def unpark(self, sq: SubQueue) -> None:
        p = sq.priority
        for blocker in sq.parked_on:
            blocker.line(p).pop(sq, None)
        sq.parked_on = ()

    def release(self, blocker: Blocker, now: float) -> None:
        """Wake as many waiters as ``blocker`` has free slots not yet promised."""
        if not blocker.waiting():
            return
        free = blocker.free(now)
        room = free - blocker.pending
        for p in (1, 0):
            line = blocker.line(p)
            while room > 0 and line:
                sq, _ = line.popitem(last=False)
                for other in sq.parked_on:
                    if other is not blocker:
                        other.line(p).pop(sq, None)
                sq.parked_on = ()
                sq.woken_by = blocker
                sq.in_ring = True
                self.woken[p].append(sq)
                blocker.pending += 1
                room -= 1
        # Only a blocker without a free slot can be held by a timed limit.
        if free <= 0 and blocker.waiting():
            at = blocker.free_at(now)
            if at is not None:
                self.set_timer(blocker, at)

    def release_dirty(self, now: float) -> None:
        """The releases of finished deliveries, one per blocker, in the order
        they were freed: a batch of results wakes the same waiters as one
        release each would."""
        dirty = self.dirty
        while dirty:
            blocker = next(iter(dirty))
            del dirty[blocker]
            self.release(blocker, now)

    def requeue(self, sq: SubQueue, woken: Blocker, now: float) -> bool:
        """After ``sq`` took the slot ``woken`` promised: if that blocker has
        no other room, ``sq`` goes to the back of its line (looking at it
        again now would only find it full) and True; else False."""
        free = woken.free(now)
        if free - woken.pending > 0:
            return False
        woken.line(sq.priority)[sq] = None
        sq.parked_on = (woken,)
        if free <= 0:
            at = woken.free_at(now)
            if at is not None:
                self.set_timer(woken, at)
        return True

    def clear(self) -> None:
        """Forget every line and promise (a reload: every sub-queue is looked at again)."""
        for queue in (*self.woken, *self.ring):
            for sq in queue:
                sq.woken_by = None
                sq.in_ring = False
            queue.clear()
        self.dirty.clear()
