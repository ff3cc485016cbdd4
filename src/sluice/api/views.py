"""The API's views of the running parts: the scheduler, the policy, throughput, /metrics.

SUMMARY
    views = control.views
    views.stats() -> SchedulerStats; subqueues(limit), counters(limit,
    exceeded), destinations(limit), suspensions(limit), policy(),
    throughput(); await views.snapshot() (for /metrics)

DESCRIPTION
    Everything here is read on the event loop from the live scheduler and
    counters -- no copy, no lock -- and answered as the API's typed models
    (sluice.api.models).  Long lists are cut to ``limit`` items, the most
    telling first (the largest sub-queues, counters over their thresholds,
    dead destinations), with the total beside them.

SEE ALSO
    sluice.api.control, sluice.scheduler (the views), sluice.api.metrics
"""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from sluice.api.errors import ApiError
from sluice.api.metrics_snapshot import PartSample, Snapshot
from sluice.api.models import (
    ActiveQueueStats,
    ConnectionStats,
    CounterModel,
    CounterPage,
    DestinationModel,
    DestinationPage,
    ManagerStatsModel,
    PolicyModel,
    Rates,
    RouteModel,
    SchedulerStats,
    SubQueueModel,
    SubQueuePage,
    SuspensionList,
    SuspensionModel,
    Throughput,
    ThroughputPoint,
)
from sluice.scheduler import CounterView, Policy, Route, SuspensionView

if TYPE_CHECKING:
    from sluice.api.control import Control

__all__ = ["Views", "route_model", "suspension_model"]


def suspension_model(view: SuspensionView) -> SuspensionModel:
    """A scheduler SuspensionView as the API's SuspensionModel."""
    return SuspensionModel(id=view.id, fields=dict(view.fields), automatic=view.automatic,
                           expires_at=view.expires_at, tag=view.tag, reason=view.reason,
                           waiting_subqueues=view.waiting_subqueues)


def route_model(route: Route) -> RouteModel:
    """A scheduler Route as the API's RouteModel; no destination means the recipient domain."""
    return RouteModel(recipientdomain=route.recipientdomain, tenantid=route.tenantid,
                      jobid=route.jobid, transportid=route.transportid,
                      localip=list(route.localip), grouping=route.grouping,
                      remoteip=route.remoteip, remotemx=route.remotemx,
                      destination=route.destination or route.recipientdomain,
                      transport=str(route.transport))


class Views:
    """What the running scheduler, queue manager and metrics show."""

    def __init__(self, control: Control) -> None:
        self.c = control

    def stats(self) -> SchedulerStats:
        """GET /scheduler/stats: the scheduler, queue manager and connections in numbers."""
        c = self.c
        now = c.clock()
        manager = c.manager
        return SchedulerStats(
            node=c.config.node.id, now=now,
            uptime_s=max(0.0, now - manager.stats.started_at),
            active_queue=ActiveQueueStats.model_validate(asdict(c.scheduler.stats())),
            manager=ManagerStatsModel.model_validate(manager.stats, from_attributes=True),
            connections=ConnectionStats.model_validate(manager.connections,
                                                       from_attributes=True))

    def subqueues(self, limit: int) -> SubQueuePage:
        """GET /scheduler/subqueues: the ``limit`` largest sub-queues by entries."""
        views = self.c.scheduler.subqueues()
        top = sorted(views, key=lambda v: (-v.entries, -v.jobs))[:limit]
        return SubQueuePage(total=len(views), items=[
            SubQueueModel(route=route_model(v.route), priority=v.priority, jobs=v.jobs,
                          entries=v.entries, parked=v.parked, held_by=list(v.held_by))
            for v in top])

    def counters(self, limit: int, exceeded: bool) -> CounterPage:
        """GET /scheduler/counters: the ``limit`` busiest counter entries, exceeded first."""
        views = self.c.scheduler.counters(self.c.now())
        if exceeded:
            views = [v for v in views if v.exceeded]

        def load(v: CounterView) -> float:
            return v.inflight / v.concurrency if v.concurrency else 0.0

        top = sorted(views, key=lambda v: (not v.exceeded, -load(v), -v.inflight,
                                           -v.rate_used))[:limit]
        return CounterPage(total=len(views), items=[
            CounterModel.model_validate({**asdict(v), "key": dict(v.key)}) for v in top])

    def destinations(self, limit: int) -> DestinationPage:
        """GET /scheduler/destinations: dead ones first, then by queued jobs and deliveries."""
        views = self.c.scheduler.destinations(self.c.now())
        top = sorted(views, key=lambda v: (not v.dead, -v.queued_jobs, -v.inflight))[:limit]
        return DestinationPage(total=len(views),
                               items=[DestinationModel.model_validate(asdict(v)) for v in top])

    def suspensions(self, limit: int = 100) -> SuspensionList:
        """GET /suspensions: every one by hand, and the ``limit`` automatic ones most waited on."""
        views = self.c.scheduler.suspensions(self.c.now())
        automatic = sorted((v for v in views if v.automatic), key=lambda v: -v.waiting_subqueues)
        return SuspensionList(
            manual=[suspension_model(v) for v in views if not v.automatic],
            automatic=[suspension_model(v) for v in automatic[:limit]],
            automatic_total=len(automatic))

    def policy(self) -> PolicyModel:
        """GET /policy: the running policy, and the files it comes from."""
        policy: Policy = self.c.scheduler.policy
        return PolicyModel(source=policy.source, path=self.c.manager.policy_path,
                           suspensions_file=self.c.config.scheduler.suspensions,
                           policy=policy.to_data())

    def throughput(self) -> Throughput:
        """GET /throughput: totals since start, rates over 10 s and 60 s, and every fifth sample."""
        m = self.c.metrics
        samples = list(m.samples)
        names = ("accepted", "delivered", "deferred", "bounced")

        def point(s: tuple[float, int, int, int, int]) -> ThroughputPoint:
            return ThroughputPoint(at=s[0], **dict(zip(names, s[1:], strict=True)))

        last = samples[-1] if samples else (
            self.c.clock(), *(m.totals[n] for n in names))
        tail = samples[(len(samples) - 1) % 5::5] if samples else []
        rates: dict[str, Any] = {
            "per_s_10s": Rates(**dict(zip(names, m.rates(10.0), strict=True))),
            "per_s_60s": Rates(**dict(zip(names, m.rates(60.0), strict=True)))}
        return Throughput(at=last[0], totals=point(last),  # type: ignore[arg-type]
                          points=[point(s) for s in tail], **rates)

    async def snapshot(self) -> Snapshot:
        """What /metrics shows of the running parts; store counts cached for a second."""
        c = self.c
        now = c.clock()
        cached = c.metrics.counts_cache
        if cached is None or now - cached[0] > 1.0:
            store = c.queue.store
            try:
                counts, oldest = await c.io(lambda: (store.count(), store.oldest()))
            except ApiError:
                counts, oldest = None, None
            cached = c.metrics.counts_cache = (now, counts, oldest)
        views = c.scheduler.suspensions(c.now())
        manual = sum(1 for v in views if not v.automatic)
        dead = sum(1 for d in c.scheduler.destinations(c.now()) if d.dead)
        tenants = c.scheduler.tenants()
        c.metrics.observe_tenants(tenants)
        parts = [PartSample(p.name, p.failing, p.failing_since_at, p.errors_total, p.storage)
                 for p in c.manager.parts()]
        snap = Snapshot(at=now, counts=cached[1], oldest=cached[2], scheduler=c.scheduler.stats(),
                        manual_suspensions=manual, automatic_suspensions=len(views) - manual,
                        dead_destinations=dead, manager=c.manager.stats,
                        agent=c.manager.connections, parts=parts,
                        cluster=None if c.manager.cluster is None
                        else c.manager.cluster.status(),
                        tenants=tenants)
        c.metrics.snapshot = snap
        return snap
