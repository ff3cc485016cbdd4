"""The scheduler's routes: the active queue in numbers, sub-queues, counters, and more.

Also destinations, throughput and the cluster.

SEE ALSO
    sluice.api.views (what they show), docs/api.md
"""

# No "from __future__ import annotations": FastAPI reads these annotations.
from typing import Any

from fastapi import APIRouter, Depends

from sluice.api.control import Control
from sluice.api.models import (
    ClusterReport,
    CounterPage,
    DestinationPage,
    SchedulerStats,
    SubQueuePage,
    Throughput,
)
from sluice.api.routes.common import COMMON, Auth, Limit

__all__ = ["router"]


def router(control: Control, auth: Auth) -> APIRouter:
    """The scheduler's routes (see the module header)."""
    views = control.views
    api = APIRouter(prefix="/api/v1", dependencies=[Depends(auth)], responses=COMMON,
                    tags=["scheduler"])

    @api.get("/scheduler/stats", response_model=SchedulerStats)
    async def scheduler_stats() -> SchedulerStats:
        """The active queue, the queue manager and the delivery connections in numbers."""
        return views.stats()

    @api.get("/scheduler/subqueues", response_model=SubQueuePage)
    async def subqueues(limit: Limit = 50) -> SubQueuePage:
        """The largest sub-queues and what holds them."""
        return views.subqueues(limit)

    @api.get("/scheduler/counters", response_model=CounterPage)
    async def counters(limit: Limit = 50, exceeded: bool = False) -> CounterPage:
        """Counter entries against their thresholds, those over them first."""
        return views.counters(limit, exceeded)

    @api.get("/scheduler/destinations", response_model=DestinationPage)
    async def destinations(limit: Limit = 50) -> DestinationPage:
        """Slow-start windows and dead destinations."""
        return views.destinations(limit)

    @api.get("/throughput", response_model=Throughput)
    async def throughput() -> Throughput:
        """Recipients accepted, delivered, deferred and bounced: totals and rates."""
        return views.throughput()

    @api.get("/cluster", response_model=ClusterReport)
    async def cluster() -> dict[str, Any]:
        """The cluster as this node sees it (docs/cluster.md).

        Every node's heartbeat age, limits (shared or fallen back) and claims in
        flight, the shared counters in use, and whether Redis and PostgreSQL
        answer.
        """
        from sluice.cluster.report import cluster_report

        return await cluster_report(control.config, control.manager.cluster)

    return api
