"""From claimed entries to delivery jobs: pre-delivery hook, routing, grouping, post-delivery hook.

SUMMARY
    planner = Planner(router, hooks)
    plan = await planner.plan(entries)          -> Plan(jobs, settled)
    results = await planner.finish(result)      -> list[AttemptResult]   (post hook applied)
    outcome = await planner.settle(entry, outcome) -> Outcome             (post hook, no attempt)

DESCRIPTION
    The stages of Halon's active queue that come before and after pickup,
    for the runtime that owns the scheduler and the store:

    plan()     for each entry: the pre-delivery hook decides (Proceed,
               Hold, Defer, Drop, Bounce); proceeding entries are routed
               (the hook's nexthop, the transport map, or DNS); entries of
               one message with the same recipient domain, route, source
               IP pool and queue fields become one Job (one transaction).
               Everything else is Settled: held, dropped, or an outcome
               without an attempt (the hook's defer/bounce, a routing
               failure).  Routing failures have been through the
               post-delivery hook (Halon: DNS failure skips to it); the
               pre-delivery hook's own decisions have not (the operator's
               code already decided).
    finish()   a DeliveryResult from the agent, through the post-delivery
               hook, as AttemptResults for sluice.queue.Queue.record().
    settle()   the post-delivery hook for an outcome reached without an
               attempt (e.g. the scheduler's DeferJob for a dead
               destination).

    Job.scheduler_route() gives the scheduler's Route (the fields pickup
    policies name) for the job.

STRATEGIES
    Route once per batch.  Entries that share (domain, transportid,
    nexthop) share one routing call; distinct ones are routed concurrently.

SEE ALSO
    sluice.hooks, sluice.delivery.router, sluice.delivery.agent,
    sluice.scheduler.events (Route, DeliveryJob)
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from sluice.delivery.agent import DeliveryResult
from sluice.delivery.router import NextHop, Router
from sluice.hooks import Bounce, Defer, Drop, Hold, Hooks, PostDelivery, Proceed
from sluice.model import Outcome, PermFail, QueueEntry, Reply, TempFail
from sluice.queue import AttemptResult
from sluice.scheduler.events import Route

__all__ = ["Job", "Plan", "Planner", "Settled"]


@dataclass(frozen=True, slots=True)
class Job:
    """Entries of one message that go together in one transaction.

    ``localip`` is the pool of source IPs (the scheduler picks one);
    ``transportid`` is the entries' own or the pre-delivery hook's.
    """

    route: NextHop
    entries: tuple[QueueEntry, ...]
    localip: tuple[str, ...]
    transportid: str

    def __init__(self, route: NextHop, entries: tuple[QueueEntry, ...], localip: tuple[str, ...],
                 transportid: str) -> None:
        object.__setattr__(self, "route", route)
        object.__setattr__(self, "entries", entries)
        object.__setattr__(self, "localip", localip)
        object.__setattr__(self, "transportid", transportid)

    @property
    def spid(self) -> str:
        """The SPID of the message, shared by every entry."""
        return self.entries[0].spid

    @property
    def priority(self) -> int:
        """The job's priority: the highest of its entries'."""
        return max(e.priority for e in self.entries)

    def scheduler_route(self) -> Route:
        """The scheduler's Route for the job: the fields pickup policies count by."""
        first = self.entries[0]
        return Route(
            recipientdomain=first.domain, tenantid=first.tenantid, jobid=first.jobid,
            transportid=self.transportid, localip=self.localip, remoteip=self.route.remoteip,
            remotemx=self.route.remotemx, destination=self.route.destination,
            transport=self.route.transport)


@dataclass(frozen=True, slots=True)
class Settled:
    """An entry that is not delivered now.

    ``decision``: Hold or Drop (from the pre-delivery hook), or the outcome
    to record without an attempt.
    """

    entry: QueueEntry
    decision: Hold | Drop | Outcome

    def __init__(self, entry: QueueEntry, decision: Hold | Drop | Outcome) -> None:
        object.__setattr__(self, "entry", entry)
        object.__setattr__(self, "decision", decision)

    def attempt_result(self) -> AttemptResult:
        """For outcomes: the AttemptResult for Queue.record() (not attempted)."""
        if isinstance(self.decision, Hold | Drop):
            raise TypeError(f"{self.entry.qid} is settled by {self.decision!r}, not an outcome")
        return AttemptResult(self.entry, self.decision, attempted=False)


@dataclass(frozen=True, slots=True)
class Plan:
    """What to do with claimed entries: the jobs to deliver and the entries settled without."""
    jobs: tuple[Job, ...]
    settled: tuple[Settled, ...]

    def __init__(self, jobs: tuple[Job, ...], settled: tuple[Settled, ...]) -> None:
        object.__setattr__(self, "jobs", jobs)
        object.__setattr__(self, "settled", settled)


_GroupKey = tuple[str, str, str, tuple[str, ...], str, str, str, int]


class Planner:
    """Runs the hooks around routing and delivery; one per runtime."""

    def __init__(self, router: Router, hooks: Hooks | None = None) -> None:
        self.router = router
        self.hooks = hooks or Hooks()

    async def plan(self, entries: Sequence[QueueEntry]) -> Plan:
        """Decide, route and group ``entries`` (see DESCRIPTION)."""
        hooks = self.hooks
        if hooks.pre_delivery is None:
            decisions: Sequence[object] = [None] * len(entries)
        else:
            decisions = await asyncio.gather(*(hooks.run_pre_delivery(e) for e in entries))
        settled: list[Settled] = []
        wanted: list[tuple[QueueEntry, tuple[str, str, str | None], tuple[str, ...], str]] = []
        for entry, decision in zip(entries, decisions, strict=True):
            match decision:
                case None:
                    wanted.append((entry, (entry.domain, entry.transportid, None),
                                   entry.localip, entry.transportid))
                case Proceed(nexthop=nexthop, localip=localip, transportid=transportid):
                    tid = entry.transportid if transportid is None else transportid
                    ips = entry.localip if localip is None else localip
                    wanted.append((entry, (entry.domain, tid, nexthop), ips, tid))
                case Hold() | Drop():
                    settled.append(Settled(entry, decision))
                case Defer(reply=reply):
                    settled.append(Settled(entry, TempFail(reply)))
                case Bounce(reply=reply):
                    settled.append(Settled(entry, PermFail(reply)))
                case _:
                    raise AssertionError(f"unexpected pre-delivery decision {decision!r}")
        keys = list(dict.fromkeys(key for _, key, _, _ in wanted))
        routed = dict(zip(keys, await asyncio.gather(
            *(self._route(*key) for key in keys)), strict=True))
        groups: dict[_GroupKey, list[QueueEntry]] = {}
        hops: dict[_GroupKey, tuple[NextHop, tuple[str, ...], str]] = {}
        for entry, key, ips, tid in wanted:
            got = routed[key]
            if not isinstance(got, NextHop):
                outcome = await self.settle(entry, got)
                settled.append(Settled(entry, outcome))
                continue
            gk: _GroupKey = (entry.spid, entry.domain, got.destination, ips, tid,
                             entry.tenantid, entry.jobid, entry.priority)
            groups.setdefault(gk, []).append(entry)
            hops[gk] = (got, ips, tid)
        jobs = tuple(Job(hops[gk][0], tuple(group), hops[gk][1], hops[gk][2])
                     for gk, group in groups.items())
        return Plan(jobs, tuple(settled))

    async def _route(self, domain: str, transportid: str, nexthop: str | None
                     ) -> NextHop | TempFail | PermFail:
        try:
            return await self.router.route(domain, transportid, nexthop)
        except ValueError as exc:  # a hook's malformed nexthop: the operator's bug
            return TempFail(Reply(451, "4.3.0",
                                  f"pre-delivery hook gave a bad nexthop {nexthop!r}: {exc}"))

    async def settle(self, entry: QueueEntry, outcome: Outcome, *, attempted: bool = False
                     ) -> Outcome:
        """The post-delivery hook's verdict on an outcome without a delivery."""
        if self.hooks.post_delivery is None:
            return outcome
        return await self.hooks.run_post_delivery(
            PostDelivery(entry, outcome, attempted=attempted))

    async def finish(self, result: DeliveryResult) -> list[AttemptResult]:
        """The agent's result through the post-delivery hook, for Queue.record()."""
        if self.hooks.post_delivery is None:
            return result.attempt_results()
        out = []
        for entry, outcome in result.outcomes:
            final = await self.hooks.run_post_delivery(PostDelivery(
                entry, outcome, attempted=True, localip=result.localip,
                remotemx=result.remotemx, remoteip=result.remoteip,
                duration_s=result.duration_s))
            out.append(AttemptResult(entry, final, attempted=True, localip=result.localip,
                                     remotemx=result.remotemx, remoteip=result.remoteip,
                                     duration_s=result.duration_s))
        return out
