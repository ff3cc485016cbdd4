"""The queue manager's refill: claim from the store, plan, group into jobs.

SUMMARY
    refiller = Refiller(queue, planner, recorder, jobs, stats, claiming, io=...,
                        post=..., notify_mail=..., sleep=...)
    await refiller.refill(limit)     (for the scheduler's Refill command)

DESCRIPTION
    One refill claims up to ``limit`` entries and answers EntriesClaimed
    at once (so the scheduler counts them as routing), then runs the
    pre-delivery hook and routes them (the Planner: transport map or DNS,
    one lookup per (domain, transportid, nexthop)), and answers JobsQueued
    with the recipients of one message and destination grouped into a job.
    What the plan does not deliver now is held, dropped or recorded as a
    failure here; it counts as unrouted.

STRATEGIES
    A failing store backs off.  A refill that cannot claim (a full disk)
    waits before the scheduler may ask again -- it asks for no other
    refill while this one is open -- with the back-off of its Trouble
    (sluice.runtime.parts): one warning, a reminder now and then, one line
    when it works again.

    Changes while routing.  Entries an operator changed while they were
    being routed (Jobs.modified_while_routing) are taken out of their
    jobs and their claims given back before the scheduler hears of them.

    Cluster mode.  A claim cut short by the per-domain cap is tried again
    after CAPPED_RETRY_S, as this node's deliveries make room.

SEE ALSO
    sluice.runtime.manager, sluice.runtime.jobs, sluice.delivery.plan
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from sluice.delivery.plan import Planner
from sluice.hooks import Drop, Hold
from sluice.model import QueueEntry
from sluice.queue import AttemptResult, Queue
from sluice.runtime.jobs import Job, Jobs
from sluice.runtime.parts import Trouble
from sluice.runtime.recorder import Recorder
from sluice.scheduler import DeliveryJob, EntriesClaimed, Event, JobsQueued

__all__ = ["CAPPED_RETRY_S", "Refiller"]

log = logging.getLogger("sluice.manager")

#: How soon a claim cut short by the per-domain cap (cluster mode) is tried again.
CAPPED_RETRY_S = 0.05


class ClaimCounters(Protocol):
    """The manager's counters a refill keeps (ManagerStats)."""

    claimed: int
    unrouted: int


class Refiller:
    """Claims entries, routes them and tells the scheduler of the jobs."""

    def __init__(self, queue: Queue, planner: Planner, recorder: Recorder, jobs: Jobs,
                 stats: ClaimCounters, claiming: Trouble, *,
                 io: Callable[..., Awaitable[Any]], post: Callable[[Event], None],
                 notify_mail: Callable[[int], None],
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self.queue = queue
        self.planner = planner
        self.recorder = recorder
        self.jobs = jobs
        self.stats = stats
        self._claiming = claiming
        self._io = io
        self._post = post
        self._notify_mail = notify_mail
        self._sleep = sleep

    async def refill(self, limit: int) -> None:
        """Claim up to ``limit`` entries; answer EntriesClaimed, then JobsQueued."""
        try:
            entries = await self._io(self.queue.claim, limit)
        except Exception as exc:
            # A failing store (a full disk): wait before the scheduler may
            # ask again -- it asks for no other refill while this one is open.
            await self._sleep(self._claiming.failed(exc))
            self._post(EntriesClaimed(0, exhausted=True))
            return
        self._claiming.ok()
        exhausted = len(entries) < limit
        next_due = None
        if exhausted:
            with contextlib.suppress(Exception):
                next_due = await self._io(self.queue.store.due_at)
        self.stats.claimed += len(entries)
        self.jobs.routing.update(e.qid for e in entries)
        self._post(EntriesClaimed(len(entries), exhausted=exhausted, next_due_at=next_due))
        if getattr(self.queue.store, "last_claim_capped", False):
            # Left behind for the per-domain cap, not for want of mail: look
            # again soon, as this node's deliveries make room.
            asyncio.get_running_loop().call_later(CAPPED_RETRY_S, self._notify_mail, 0)
        if not entries:
            return
        try:
            jobs, unrouted = await self._route_all(entries)
        finally:
            self.jobs.routing.difference_update(e.qid for e in entries)
        modified = self.jobs.modified_while_routing
        if modified:
            # An operator changed some of these while they were being routed.
            keep_jobs = []
            for job in jobs:
                gone = [q for q in job.qids if q in modified]
                info = self.jobs.get(job.ref)
                if info is None:  # let go while an earlier job's claims were given back
                    continue
                if gone:
                    await self.recorder.release([info.entries.pop(q) for q in gone])
                    unrouted += len(gone)
                if info.entries:
                    if gone:
                        job = DeliveryJob(job.ref, job.spid, tuple(info.entries), job.route,
                                          job.priority, job.arrival_at)
                        info.job = job
                    keep_jobs.append(job)
                else:
                    self.jobs.discard(job.ref)
            modified.difference_update(e.qid for e in entries)
            jobs = keep_jobs
        self._post(JobsQueued(tuple(jobs), unrouted=unrouted))

    async def _route_all(self, entries: Sequence[QueueEntry]) -> tuple[list[DeliveryJob], int]:
        """Run the pre-delivery hook, route and group into jobs (the Planner).

        What is not delivered now is held, dropped or recorded.
        """
        try:
            plan = await self.planner.plan(entries)
        except Exception:
            log.exception("planning %d entries failed; giving their claims back", len(entries))
            await self.recorder.release(entries)
            return [], len(entries)
        hold: list[QueueEntry] = []
        drop: list[tuple[QueueEntry, str]] = []
        failed: list[AttemptResult] = []
        for item in plan.settled:
            match item.decision:
                case Hold():
                    hold.append(item.entry)
                case Drop(reason=reason):
                    drop.append((item.entry, reason))
                case _:
                    failed.append(item.attempt_result())
        try:
            if hold:
                await self._io(self.queue.hold_claimed, hold)
            for entry, reason in drop:
                await self._io(self.queue.drop_claimed, [entry], reason)
        except Exception as exc:
            # Still claimed in the store: they return at the next start.
            self.recorder.failed(exc)
        if failed:
            self.recorder.record(failed)
        jobs = []
        for planned in plan.jobs:
            ref = self.jobs.new_ref()
            first = planned.entries[0]
            job = DeliveryJob(ref, first.spid, tuple(e.qid for e in planned.entries),
                              self.jobs.intern(planned.scheduler_route()),
                              priority=planned.priority, arrival_at=first.arrival_at)
            self.jobs.add(Job(job, planned.route, {e.qid: e for e in planned.entries}))
            jobs.append(job)
        unrouted = len(plan.settled)
        self.stats.unrouted += unrouted
        return jobs, unrouted
