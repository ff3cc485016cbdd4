"""Jobs into the scheduler's sub-queues, and out again: deferred, dropped, finished.

SUMMARY
    enqueue(sched, job, now, out)      JobsQueued, one job at a time
    modified(sched, qids)              EntriesModified: drop queued copies
    defer_all(sched, sq, dest, out)    a dead destination: DeferJob for each job
    finish(sched, event, now, out)     DeliveryFinished
    retire(sched, sq)                  a sub-queue that ran empty

STRATEGY
    Bookkeeping by qid.  Every recipient the scheduler holds is in one
    table (qid -> its queued Job or its Flight), so a change or a result
    finds it in O(1); the active queue's counts (queued, in flight) move
    with it.  A job for a destination known to be dead is deferred at
    once, without a sub-queue.  A result releases the counter entries the
    flight held into the lines' dirty set (woken once the whole batch of
    results is in), and tells the destination how it went: a connection
    failure that kills it defers every job of its sub-queues.  Like
    observe.py this module reads the Scheduler's parts directly.

SEE ALSO
    sluice.scheduler.subqueues, sluice.scheduler.destinations,
    sluice.scheduler.scheduler
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from sluice.model import Reply, TempFail
from sluice.scheduler import bindings
from sluice.scheduler.destinations import Destination
from sluice.scheduler.events import Command, DeferJob, DeliveryFinished, DeliveryJob
from sluice.scheduler.subqueues import Job, SubQueue
from sluice.scheduler.timers import Timer

if TYPE_CHECKING:
    from sluice.scheduler.scheduler import Scheduler

__all__ = ["defer_all", "enqueue", "finish", "modified", "retire"]


def enqueue(sched: Scheduler, job: DeliveryJob, now: float, out: list[Command]) -> None:
    """Queue ``job`` in its sub-queue (made if new), or defer it: its destination is dead."""
    route = job.route
    sq = sched._queues.get(route, job.priority)
    dest = sq.dest if sq is not None else sched._dests.get(route.destination)
    if dest.is_dead(now):
        out.append(DeferJob(job, job.qids, dest.dead_reply, dest.dead_until))
        if sq is None:
            sched._dests.forget(dest, now)
        return
    if sq is None:
        sq = SubQueue(route, job.priority, dest)
        bindings.bind(sched, sq)
        sched._queues.add(sq)
    elif sq.version != sched._version:
        bindings.bind(sched, sq)
    rec = Job(job, sq, now)
    sq.jobs.append(rec)
    sq.live += 1
    for qid in job.qids:
        sched._qids[qid] = rec
    sched._active.queued += len(job.qids)
    sched._lines.ready(sq)


def retire(sched: Scheduler, sq: SubQueue) -> None:
    """A sub-queue without live jobs leaves its line and is kept as emptied."""
    if sq.parked_on:
        sched._lines.unpark(sq)
    sched._queues.retire(sq)


def modified(sched: Scheduler, qids: Sequence[str]) -> None:
    """An operator changed ``qids``: drop those still queued (not those in flight)."""
    for qid in qids:
        rec = sched._qids.get(qid)
        if not isinstance(rec, Job):
            continue  # unknown, or in flight: the store lets the operator win
        del sched._qids[qid]
        sched._active.queued -= 1
        rec.qids = tuple(q for q in rec.qids if q != qid)
        if not rec.qids:
            rec.sq.drop(rec)
            if not rec.sq.live:
                retire(sched, rec.sq)


def defer_all(sched: Scheduler, sq: SubQueue, dest: Destination, out: list[Command]) -> None:
    """``dest`` is dead: every job of ``sq`` is deferred without a connection."""
    for rec in sq.jobs:
        if rec.dropped:
            continue
        out.append(DeferJob(rec.job, rec.qids, dest.dead_reply, dest.dead_until))
        for qid in rec.qids:
            del sched._qids[qid]
        sched._active.queued -= len(rec.qids)
    sq.live = 0
    retire(sched, sq)


def finish(sched: Scheduler, event: DeliveryFinished, now: float, out: list[Command]) -> None:
    """A delivery ended: release what it held; a failed connection may kill its destination."""
    flight = sched._flights.pop(event.ref)
    for qid in flight.qids:
        if sched._qids.get(qid) is flight:
            del sched._qids[qid]
    sched._active.inflight -= len(flight.qids)
    dirty = sched._lines.dirty
    for entry in sched._limits.release(flight.binding, now):
        dirty[entry] = None  # released once the batch of results is in
    dest = flight.dest
    reply: Reply | None = None
    if event.connection_failed:
        reply = next((o.reply for _, o in event.outcomes if isinstance(o, TempFail)), None)
    tenant = flight.tenant
    n = sched._tenant_inflight[tenant] - 1
    if n:
        sched._tenant_inflight[tenant] = n
    else:
        del sched._tenant_inflight[tenant]
    if sched._dests.finished(dest, tenant, event.connection_failed, reply, now):
        sched._timers.set(dest.dead_until, Timer.DEAD, dest)
        for sq in list(dest.subqueues):
            if sq.live:
                defer_all(sched, sq, dest, out)
    if dest.waiters is not None:
        dirty[dest] = None
    if not dest.inflight and not dest.subqueues:
        sched._dests.forget(dest, now)
