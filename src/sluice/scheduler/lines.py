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
    Round robin (Postfix fairness), weighted by tenant.  Ready sub-queues
    take turns in a ring, one delivery each; priority 1 before priority 0;
    a sub-queue woken by a blocker goes before the ring, so that a freed
    slot goes to the one that waited for it.  The ring and every line are
    FairQueues (tenants.py): FIFO within a tenant, deficit round robin
    between tenants by weight, and a tenant below its minimum share of a
    limit served first when that limit frees a slot.

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

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from sluice.scheduler.tenants import FairQueue, Shares

if TYPE_CHECKING:
    from sluice.scheduler.subqueues import SubQueue

__all__ = ["Blocker", "Lines"]

#: Given a blocker, who goes first when it frees slots: a test of a tenant
#: (below its minimum share of that limit), and how many slots it still needs.
Prefer = Callable[["Blocker"], Callable[[str], int] | None]


class Blocker:
    """Something that can hold sub-queues; they wait in its lines, per priority."""

    __slots__ = ("pending", "timer_at", "waiters")

    def __init__(self) -> None:
        self.waiters: tuple[FairQueue, FairQueue] | None = None  # per priority, made on use
        self.pending = 0  # woken, not yet looked at
        self.timer_at: float | None = None

    def free(self, now: float) -> int:
        """How many more it lets through now."""
        raise NotImplementedError

    def free_at(self, now: float) -> float | None:
        """When a timed limit lets one more through; None = an event will."""
        return None

    def waiting(self) -> int:
        """How many sub-queues wait on the blocker, both priorities."""
        waiters = self.waiters
        return 0 if waiters is None else len(waiters[0]) + len(waiters[1])

    def members(self) -> list[SubQueue]:
        """Its waiters, priority 1 first, tenant by tenant."""
        if self.waiters is None:
            return []
        return [*self.waiters[1], *self.waiters[0]]


class Lines:
    """The ready ring, the woken sub-queues, and the waiters of every blocker."""

    __slots__ = ("dirty", "prefer", "ring", "set_timer", "shares", "woken")

    def __init__(self, set_timer: Callable[[Blocker, float], None], shares: Shares,
                 prefer: Prefer | None = None) -> None:
        self.set_timer = set_timer
        self.shares = shares
        self.prefer = prefer
        # Indexed by priority.
        self.ring = (FairQueue(shares), FairQueue(shares))
        self.woken: tuple[deque[SubQueue], deque[SubQueue]] = (deque(), deque())
        # Blockers that finished deliveries freed, to release once per step.
        self.dirty: dict[Blocker, None] = {}

    def line(self, blocker: Blocker, priority: int) -> FairQueue:
        """The blocker's line for ``priority``, made on first use."""
        waiters = blocker.waiters
        if waiters is None:
            waiters = blocker.waiters = (FairQueue(self.shares), FairQueue(self.shares))
        return waiters[priority]

    def ready(self, sq: SubQueue) -> None:
        """``sq`` may go: into the ring (unless it waits or is there)."""
        if not sq.in_ring and not sq.parked_on:
            self.ring[sq.priority].push(sq)
            sq.in_ring = True

    def next(self, prefer: Callable[[str], bool] | None = None) -> SubQueue | None:
        """The next sub-queue to visit: woken first, then the ring.

        Priority 1 first; in the ring, a tenant ``prefer`` names before the
        others.
        """
        for p in (1, 0):
            woken = self.woken[p]
            sq = woken.popleft() if woken else self.ring[p].pop(prefer)
            if sq is not None:
                sq.in_ring = False
                return sq
        return None

    def park(self, sq: SubQueue, blockers: list[Blocker], woken: Blocker | None,
             now: float) -> None:
        """``sq`` waits on ``blockers``.

        First in ``woken``'s line (it was woken there and keeps its place), at
        the back of the others.
        """
        p = sq.priority
        for blocker in blockers:
            line = self.line(blocker, p)
            if blocker is woken:
                line.push_front(sq)
            else:
                line.push(sq)
            at = blocker.free_at(now)
            if at is not None:
                self.set_timer(blocker, at)
        sq.parked_on = tuple(blockers)

    def unpark(self, sq: SubQueue) -> None:
        """Take ``sq`` out of every line it waits in."""
        p = sq.priority
        for blocker in sq.parked_on:
            self.line(blocker, p).discard(sq)
        sq.parked_on = ()

    def release(self, blocker: Blocker, now: float) -> None:
        """Wake as many waiters as ``blocker`` has free slots not yet promised.

        Tenants below their minimum share of it first, then in turn.
        """
        if not blocker.waiting():
            return
        free = blocker.free(now)
        room = free - blocker.pending
        if room > 0:
            needs = self.prefer(blocker) if self.prefer is not None else None
            promised: dict[str, int] = {}

            def short(tenant: str) -> bool:
                return needs is not None and needs(tenant) > promised.get(tenant, 0)

            for p in (1, 0):
                line = self.line(blocker, p)
                while room > 0 and line:
                    sq = line.pop(short if needs is not None else None)
                    assert sq is not None
                    for other in sq.parked_on:
                        if other is not blocker:
                            self.line(other, p).discard(sq)
                    sq.parked_on = ()
                    sq.woken_by = blocker
                    sq.in_ring = True
                    self.woken[p].append(sq)
                    blocker.pending += 1
                    promised[sq.tenant] = promised.get(sq.tenant, 0) + 1
                    room -= 1
        # Only a blocker without a free slot can be held by a timed limit.
        if free <= 0 and blocker.waiting():
            at = blocker.free_at(now)
            if at is not None:
                self.set_timer(blocker, at)

    def release_dirty(self, now: float) -> None:
        """The releases of finished deliveries, one per blocker, in the order they were freed.

        A batch of results wakes the same waiters as one release each would.
        """
        dirty = self.dirty
        while dirty:
            blocker = next(iter(dirty))
            del dirty[blocker]
            self.release(blocker, now)

    def requeue(self, sq: SubQueue, woken: Blocker, now: float) -> bool:
        """After ``sq`` took the slot ``woken`` promised: back of the line if the blocker is full.

        If that blocker has no other room, ``sq`` goes to the back of its line
        (looking at it again now would only find it full) and True; else False.
        """
        free = woken.free(now)
        if free - woken.pending > 0:
            return False
        self.line(woken, sq.priority).push(sq)
        sq.parked_on = (woken,)
        if free <= 0:
            at = woken.free_at(now)
            if at is not None:
                self.set_timer(woken, at)
        return True

    def clear(self) -> None:
        """Forget every promise (a reload: every sub-queue is looked at again)."""
        for queue in (*self.woken, *self.ring):
            for sq in queue:
                sq.woken_by = None
        self.dirty.clear()
