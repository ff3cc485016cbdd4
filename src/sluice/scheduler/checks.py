"""The scheduler's refusals: events that would break its invariants.

SUMMARY
    misuse(sched, events)     before a step: ValueError, nothing changed
    check(sched, event)       one event (Scheduler.check, for the API)

STRATEGY
    Look, never touch.  Every event of a step is checked before the first
    one is applied, so that a refused step leaves the state exactly as it
    was (the Scheduler's invariant "misuse raises ValueError and the state
    is unchanged"): a job or recipient queued twice, a claim beyond the
    room that was asked for, a condition on a counter that does not exist
    or a field it does not count, a condition removed without its id, a
    suspension the index refuses, and results of deliveries that are not
    in flight or were started from another source IP.  Like observe.py it
    reads the Scheduler's parts directly, so the coordinator stays short.

SEE ALSO
    sluice.scheduler.scheduler, sluice.scheduler.events
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sluice.scheduler.events import (
    ConditionAdded,
    ConditionRemoved,
    DeliveryFinished,
    EntriesClaimed,
    Event,
    JobsQueued,
    SuspensionAdded,
)

if TYPE_CHECKING:
    from sluice.scheduler.scheduler import Scheduler

__all__ = ["check", "misuse"]


def misuse(sched: Scheduler, events: tuple[Event, ...]) -> None:
    """Raise ValueError for the first of ``events`` that would be refused.

    Called before anything changes, so that a refused step leaves the
    state as it was: a DeliveryFinished must answer a delivery in flight,
    once, from the source IP it was started from.
    """
    finished: set[str] = set()
    for event in events:
        if type(event) is DeliveryFinished:
            flight = sched._flights.get(event.ref)
            if flight is None or event.ref in finished:
                raise ValueError(f"no delivery {event.ref} in flight")
            if event.localip and event.localip != flight.ip:
                raise ValueError(f"delivery {event.ref} was started from {flight.ip!r}, "
                                 f"not {event.localip!r}")
            finished.add(event.ref)
        else:
            check(sched, event)


def check(sched: Scheduler, event: Event) -> None:
    """Raise ValueError if ``event`` (not a result) would be refused; change nothing."""
    match event:
        case JobsQueued(jobs=jobs):
            seen: set[str] = set()
            refs: set[str] = set()
            for job in jobs:
                if job.ref in sched._flights or job.ref in refs:
                    raise ValueError(f"job {job.ref} is already known")
                refs.add(job.ref)
                for qid in job.qids:
                    if qid in sched._qids or qid in seen:
                        raise ValueError(f"recipient {qid} is queued twice")
                    seen.add(qid)
        case EntriesClaimed(count=count):
            sched._active.check_claim(count)
        case ConditionAdded(counter_id=cid, condition=cond):
            try:
                counter = sched._policy.counter(cid)
            except KeyError:
                raise ValueError(f"no counter {cid!r} in the policy") from None
            for name, _ in cond.match:
                if name not in counter.field_names:
                    raise ValueError(f"counter {cid} does not count {name!r}")
        case ConditionRemoved(counter_id=cid, condition_id=cond_id):
            if cid not in {c.id for c in sched._policy.counters}:
                raise ValueError(f"no counter {cid!r} in the policy")
            if not cond_id:  # "" would match every condition without an id
                raise ValueError("name the condition to remove by its id")
        case SuspensionAdded(suspension=susp):
            sched._susps.check(susp)
        case _:
            pass
