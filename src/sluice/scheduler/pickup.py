"""Pickup: which sub-queue's head job starts next, and from which source IP.

SUMMARY
    select(sched, now, out)    StartDelivery until max_deliveries are in flight
                               or no sub-queue is ready; the rest park

STRATEGY
    Round robin over sub-queues, FIFO inside one, parking instead of
    scanning (lines.py): lines.next() gives woken sub-queues first, then
    the ring, priority 1 before 0, fair between tenants.  A visit starts
    the head job from a source IP that nothing holds -- not the
    destination's window (slow start), not a suspension, not a counter
    entry of the limits seam -- trying the route's IPs in turn from where
    the last pickup left off (Halon's source IP pools); if every IP is
    held, the sub-queue parks on what holds it.  After a pickup it goes to
    the back of the ring, or of the line of the blocker that woke it.

    Minimum shares: while a tenant holds less than its share of
    max_deliveries (short_of_capacity) it is served first; for a
    destination, needs() says how many slots each tenant lacks.  Like
    observe.py this module reads the Scheduler's parts directly.

SEE ALSO
    sluice.scheduler.lines, sluice.scheduler.limits,
    sluice.scheduler.tenants, docs/scheduler.md
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

from sluice.scheduler import bindings, queueing
from sluice.scheduler.destinations import Destination, Destinations
from sluice.scheduler.events import Command, StartDelivery
from sluice.scheduler.lines import Blocker
from sluice.scheduler.subqueues import Flight, SubQueue

if TYPE_CHECKING:
    from sluice.scheduler.scheduler import Scheduler

__all__ = ["needs", "requeue", "select", "short_of_capacity", "start", "visit"]


def select(sched: Scheduler, now: float, out: list[Command]) -> None:
    """Start deliveries until max_deliveries are in flight or no sub-queue is ready."""
    limit = sched.settings.max_deliveries
    lines = sched._lines
    short = functools.partial(short_of_capacity, sched) if sched._shares.any_min_share else None
    while len(sched._flights) < limit:
        sq = lines.next(short)
        if sq is None:
            return
        woken = sq.woken_by
        if woken is None:
            visit(sched, sq, now, out, None)
            continue
        sq.woken_by = None
        woken.pending -= 1
        if not visit(sched, sq, now, out, woken):
            # The slot it was woken for may be free still: the next in line
            # (unless it went back into that line: releasing would find no room).
            lines.release(woken, now)


def visit(sched: Scheduler, sq: SubQueue, now: float, out: list[Command],
          woken: Blocker | None) -> bool:
    """Start the head of ``sq`` from a source IP nothing holds, or park it.

    True: it took the slot ``woken`` promised and went back into that
    blocker's line.
    """
    sq.head()
    if not sq.live or sq.parked_on:
        return False  # a stale ring entry: retired, or parked meanwhile
    if sq.version != sched._version:
        bindings.bind(sched, sq)
    dest = sq.dest
    if dest.is_dead(now):
        queueing.defer_all(sched, sq, dest, out)
        return False
    if dest.inflight >= dest.limit:
        sched._lines.park(sq, [dest], woken, now)
        return False
    susps = sched._suspended(sq)
    n = len(sq.ips)
    blockers: list[Blocker] = []
    for k in range(n):
        i = (sq.rr + k) % n
        held: Blocker | None = susps[i]
        if held is None:
            held = sched._limits.holder(sq.bindings[i], now)
        if held is None:
            sq.rr = (i + 1) % n
            start(sched, sq, i, now, out)
            return requeue(sched, sq, woken, now)
        if held not in blockers:
            blockers.append(held)
    sched._lines.park(sq, blockers, woken, now)
    return False


def requeue(sched: Scheduler, sq: SubQueue, woken: Blocker | None, now: float) -> bool:
    """After a pickup, put the sub-queue back in line; True if in the line of ``woken``.

    It goes to the back of the ring -- or of the line of the blocker that
    woke it, if that one has no other room (not for a pool of source IPs,
    whose next delivery may leave from another IP, unless the blocker is
    the destination they share).
    """
    if not sq.live:
        queueing.retire(sched, sq)
        return False
    if (woken is not None and (not sq.pool or woken is sq.dest)
            and sched._lines.requeue(sq, woken, now)):
        return True
    sched._lines.ready(sq)
    return False


def start(sched: Scheduler, sq: SubQueue, i: int, now: float, out: list[Command]) -> None:
    """Start the head job of ``sq`` from its source IP ``i``: count it, StartDelivery."""
    rec = sq.jobs.popleft()
    sq.live -= 1
    ip, binding = sq.ips[i], sq.bindings[i]
    sched._limits.record(binding, now)
    tenant = sq.tenant
    Destinations.started(sq.dest, tenant)
    sched._tenant_inflight[tenant] = sched._tenant_inflight.get(tenant, 0) + 1
    sched._tenant_pickups[tenant] = sched._tenant_pickups.get(tenant, 0) + 1
    job, qids = rec.job, rec.qids
    flight = Flight(job, qids, ip, binding, sq.dest, tenant, now)
    sched._flights[job.ref] = flight
    for qid in qids:
        sched._qids[qid] = flight
    sched._active.queued -= len(qids)
    sched._active.inflight += len(qids)
    sched._pickups += 1
    out.append(StartDelivery(job, ip, qids))


def short_of_capacity(sched: Scheduler, tenant: str) -> bool:
    """Whether ``tenant`` holds less than its minimum share of max_deliveries."""
    reserved = sched._shares.reserved(tenant, sched.settings.max_deliveries)
    return reserved > sched._tenant_inflight.get(tenant, 0)


def needs(sched: Scheduler, blocker: Blocker) -> Callable[[str], int] | None:
    """For a destination, the slots each tenant lacks of its minimum share."""
    if not isinstance(blocker, Destination):
        return None
    shares = sched._shares

    def needs(tenant: str) -> int:
        held = blocker.by_tenant.get(tenant, 0)
        return shares.reserved(tenant, blocker.limit) - held

    return needs
