"""What one node holds of the cluster's limits: a grant per entry, a share in fall-back.

SUMMARY
    Grant(entry)          leases and dated pickups held for one cluster entry
    Fallback(nodes, rank, until, since)
        .share(limit)  .thresholds(th)  .paused_until(th)

DESCRIPTION
    sluice.scheduler.cluster (ClusterLimits) keeps one Grant per cluster-
    scoped counter entry while the shared store (Redis) answers, and one
    Fallback while the node keeps to its share of every limit instead.

STRATEGIES
    Counted, not asked.  A Grant keeps a running total of the leases it gave
    back and, per request in flight, that total when the request left: an
    answer counted the leases as they were then, so the ones returned since
    are taken off it (answered_slots).

    Shares that add up.  A limit of L over N live nodes gives node of rank r
    L // N, plus one while r < L % N: the shares sum to L.

SEE ALSO
    sluice.scheduler.cluster, docs/cluster.md
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace

from sluice.scheduler.limits_grouped import _Entry
from sluice.scheduler.policy import Rate, Thresholds

__all__ = ["NEVER", "Fallback", "Grant"]

#: A time that never comes.
NEVER = float("inf")


class Grant:
    """What this node holds of one cluster entry."""

    __slots__ = (
        "answered_at",
        "asked",
        "batch",
        "entry",
        "idle_at",
        "retry_at",
        "returned",
        "sent",
        "share",
        "slot_ats",
        "slots",
        "switch_slots",
        "use_within_s",
        "used",
        "want_pickups",
        "want_slots",
    )

    def __init__(self, entry: _Entry) -> None:
        self.entry: _Entry | None = entry  # its blocker (None after a reload, until used)
        self.slots = 0  # leases held
        self.used = 0  # deliveries in flight here (each needs a lease while shared)
        self.slot_ats: deque[float] = deque()  # dated pickups granted, oldest first
        self.use_within_s = 0.0
        self.retry_at: float | None = None
        self.asked = False  # a request is out
        self.want_slots = 0
        self.want_pickups = 0
        self.idle_at = NEVER  # since when a leased slot is unused
        self.share: int | None = None  # the most to keep while others want some
        self.switch_slots = 0  # leases held when the node fell back
        self.answered_at = 0.0  # when the store last answered for it
        self.batch = 1  # dates to ask for at once; doubles while all are used
        self.returned = 0  # leases given back so far (a running total)
        self.sent: deque[int] = deque()  # ``returned`` when each unanswered request left

    def give_back(self, key: str, count: int, into: list[tuple[str, int]]) -> None:
        """Give ``count`` leases back (in ``into``'s ReturnGrants)."""
        into.append((key, count))
        self.slots -= count
        self.returned += count

    def answered_slots(self, slots: int) -> int:
        """The leases held after an answer of ``slots``.

        The store counted them when it answered, before the ones given back
        since the request left (the runtime carries commands in order).
        """
        at = self.sent.popleft() if self.sent else self.returned
        return slots - (self.returned - at)

    def room(self) -> int:
        """Leases free for a new delivery (within the node's share)."""
        cap = self.slots if self.share is None else min(self.slots, self.share)
        return cap - self.used


@dataclass(frozen=True, slots=True)
class Fallback:
    """A node's part of the cluster limits while it (or another) keeps to shares."""

    nodes: int
    rank: int
    until: float  # end of the transition: leases held before may still count elsewhere
    since: float  # when the node fell back (or, later, when the last other did)
    others_shared: bool = False  # other live nodes still take from the store

    def paused_until(self, th: Thresholds) -> float:
        """Until when a rate or an interval starts nothing after the switch.

        One window, so that no window holds pickups granted by the store and
        pickups of the shares (which do not know each other's); for ever while
        others still take from the store (an event ends it).
        """
        if self.others_shared and (th.rate is not None or th.connectinterval_s):
            return NEVER
        wait = 0.0
        if th.rate is not None:
            wait = th.rate.per_s
        if th.connectinterval_s:
            wait = max(wait, th.connectinterval_s)
        return self.since + wait

    def share(self, limit: int) -> int:
        """This node's part of a cluster limit of ``limit``."""
        return limit // self.nodes + (1 if self.rank < limit % self.nodes else 0)

    def thresholds(self, th: Thresholds) -> Thresholds:
        """The policy's thresholds cut down to this node's share."""
        conc = None if th.concurrency is None else self.share(th.concurrency)
        rate = None if th.rate is None else Rate(self.share(th.rate.count), th.rate.per_s)
        interval = th.connectinterval_s
        if interval:
            interval *= self.nodes  # one pickup per interval in all: each its turn
        return replace(th, concurrency=conc, rate=rate, connectinterval_s=interval)
