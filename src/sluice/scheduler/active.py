"""The active queue: what the scheduler holds in memory, and its refill.

SUMMARY
    active = ActiveQueue(settings)
    command = active.refill(now)         a Refill, when there is room to ask for
    active.claimed(count, exhausted, next_due_at, now) / .arrived(now) / .routed(n)
    active.memory_used, active.refill_at(now)

DESCRIPTION
    Memory is counted in recipients: claimed (a Refill asked for them and
    the store has not answered), routing (claimed, being routed), queued
    (in a sub-queue) and in flight.  The scheduler never holds more than
    maxmemoryqueue, whatever the backlog on disk: the store keeps the rest.

STRATEGIES
    Bounded active queue (Postfix, Mailismus).  A refill asks the store for
    room's worth of entries (at most refill_batch), alternating incoming
    and due deferred with at least quota_deferred percent deferred: new
    mail goes first when it arrives faster than it leaves, delayed mail
    fills the rest.  One refill at a time; the next waits until a quarter
    of a batch is free, so that refills come in batches, not one by one.

    No polling for an empty store.  When the store had fewer entries than
    asked for, the next refill waits for refill_interval, or for the
    earliest deferred entry's retry time if the store knows it, or for new
    mail (MailArrived) or an operator change, whichever comes first.

SEE ALSO
    sluice.scheduler.scheduler, sluice.store (Store.claim), seeds/002
"""

from __future__ import annotations

from sluice.scheduler.events import Refill
from sluice.scheduler.settings import Settings

__all__ = ["ActiveQueue"]


class ActiveQueue:
    """Recipients held, by stage, and when to ask the store for more."""

    __slots__ = ("claim_pending", "inflight", "queued", "routing", "settings", "store_ready_at")

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.claim_pending = 0  # asked for by a Refill, not yet answered
        self.routing = 0  # claimed, not yet queued in a job
        self.queued = 0  # in sub-queues
        self.inflight = 0  # in deliveries
        self.store_ready_at = -float("inf")

    @property
    def memory_used(self) -> int:
        """Recipients held at every stage: asked for, routing, queued and in flight."""
        return self.claim_pending + self.routing + self.queued + self.inflight

    def check_claim(self, count: int) -> None:
        """Refuse a claim answer of more entries than were asked for (a broken invariant)."""
        if count < 0 or count > self.claim_pending:
            raise ValueError(f"claimed {count} entries, {self.claim_pending} asked for")

    def claimed(self, count: int, exhausted: bool, next_due_at: float | None,
                now: float) -> None:
        """The store answered a Refill with ``count`` entries."""
        self.claim_pending = 0
        self.routing += count
        if exhausted:
            ready = now + self.settings.refill_interval_s
            if next_due_at is not None and next_due_at > ready:
                ready = next_due_at
            self.store_ready_at = ready
        else:
            self.store_ready_at = now

    def routed(self, queued: int, unrouted: int) -> None:
        """Routing placed ``queued`` recipients in jobs; ``unrouted`` left otherwise.

        Jobs queued without a Refill (tests, a simulator) count too.
        """
        self.routing = max(0, self.routing - unrouted - queued)

    def arrived(self, now: float) -> None:
        """New mail, or an operator change: the store has work now."""
        self.store_ready_at = now

    def refill_at(self, now: float) -> float | None:
        """When the next Refill is due (None: none until something frees room)."""
        if self.claim_pending:
            return None
        s = self.settings
        used = self.memory_used
        room = s.maxmemoryqueue - used
        if room <= 0:
            return None
        if used > 0 and room < max(1, min(s.refill_batch, s.maxmemoryqueue) // 4):
            return None
        return max(self.store_ready_at, now)

    def refill(self, now: float) -> Refill | None:
        """A Refill if one is due now (and count it as asked for)."""
        at = self.refill_at(now)
        if at is None or at > now:
            return None
        s = self.settings
        limit = min(s.maxmemoryqueue - self.memory_used, s.refill_batch)
        self.claim_pending = limit
        return Refill(limit, s.quota_deferred)
