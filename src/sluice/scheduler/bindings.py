"""The policy bound to the scheduler's sub-queues and deliveries in flight.

SUMMARY
    set_policy(sched, policy, now)   a policy file (its suspensions too)
    load(sched, policy, now)         counters changed: bind everything again
    bind(sched, sq)                  a sub-queue's source IPs to counter entries
    forget(sched, sq)                an emptied sub-queue lets go of its entries

STRATEGY
    Bind once, check often.  A sub-queue holds, per source IP, its binding
    to the counter entries of the limits seam (limits.py), made when it is
    created and again whenever the policy changed since (its ``version``
    lags the scheduler's), so that a pickup only asks the binding.  A
    policy change (a reload, a condition added, removed or expired) costs
    O(sub-queues + deliveries): every flight is counted again in its new
    entries, every blocker forgets its waiters, and every live sub-queue
    is bound again and made ready, to park anew on what holds it now.
    Like observe.py this module reads the Scheduler's parts directly.

SEE ALSO
    sluice.scheduler.limits, sluice.scheduler.scheduler, docs/scheduler.md
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sluice.scheduler.policy import Policy
from sluice.scheduler.subqueues import SubQueue
from sluice.scheduler.timers import Timer

if TYPE_CHECKING:
    from sluice.scheduler.scheduler import Scheduler

__all__ = ["bind", "forget", "load", "set_policy"]


def set_policy(sched: Scheduler, policy: Policy, now: float) -> None:
    """Take a policy file: its counters, and its suspensions in place of the file's old ones.

    Suspensions added at run time stay.
    """
    file_ids = {s.id for s in policy.suspensions}
    for sid, blocker in list(sched._susps.by_id.items()):
        if blocker.from_file and sid not in file_ids:
            sched._remove_suspension(sid, now)
    for susp in policy.suspensions:
        sched._add_suspension(susp, now, from_file=True)
    for counter in policy.counters:
        for cond in counter.conditions:
            if cond.expires_at is not None:
                sched._timers.set(cond.expires_at, Timer.CONDITION, (counter.id, cond.id))
    load(sched, policy, now)


def load(sched: Scheduler, policy: Policy, now: float) -> None:
    """Counters changed: bind everything again and look at every sub-queue.

    O(sub-queues + deliveries): an operator action, not a pickup.
    """
    sched._policy = policy
    limits = sched._limits
    sched._timers.cancel(Timer.SLOT, sched._cancel_slot)  # old entries' windows
    limits.load(policy, now)
    sched._version += 1
    sched._dests.policy_changed()
    for blocker in (*sched._dests, *sched._susps):
        blocker.waiters = None
        blocker.pending = 0
    for flight in sched._flights.values():
        binding = limits.bind(flight.job.route, flight.ip)
        limits.recount(binding)
        limits.unbind(binding)  # the flight counts in it; the sub-queue uses it
        flight.binding = binding
    lines = sched._lines
    for queue in (*lines.woken, *lines.ring):
        for sq in queue:
            sq.woken_by = None
    lines.dirty.clear()
    for sq in sched._queues:
        sq.parked_on = ()
        sq.woken_by = None
        bind(sched, sq)
        if sq.live:
            lines.ready(sq)


def bind(sched: Scheduler, sq: SubQueue) -> None:
    """Bind a sub-queue's source IPs to their counter entries."""
    limits = sched._limits
    for binding in sq.bindings:
        limits.unbind(binding)
    sq.bindings = [limits.bind(sq.route, ip) for ip in sq.ips]
    sq.version = sched._version
    for ip, binding in zip(sq.ips, sq.bindings, strict=True):
        sched._dests.limit_from(sq.dest, ip, binding.destination_limit)


def forget(sched: Scheduler, sq: SubQueue) -> None:
    """An emptied sub-queue is dropped: it no longer uses its bindings."""
    for binding in sq.bindings:
        sched._limits.unbind(binding)
    sq.bindings = []
    sq.version = -1
    sched._dests.forget(sq.dest, sched._now)
