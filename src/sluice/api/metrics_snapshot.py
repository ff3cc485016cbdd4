"""What the running parts say at scrape time, as Prometheus metric families.

SUMMARY
    registry.register(SnapshotCollector(metrics)); views fill
    metrics.snapshot (a Snapshot) before each scrape.

STRATEGY
    Nothing here is counted on the delivery path: at each scrape the API's
    views gather a Snapshot on the event loop (the store's counts by state,
    the scheduler's memory and sub-queues, counter entries, suspensions,
    destinations, the queue manager's and the delivery agent's counters,
    the parts that keep failing, tenants, the cluster), and the collector
    turns it into gauge and counter families.  Before the first snapshot
    only ``sluice_up`` (0) and the start time are served.

SEE ALSO
    sluice.api.views.Views.snapshot (the gatherer), sluice.api.metrics,
    docs/api.md
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sluice.model import QueueState
from sluice.store import Counts

if TYPE_CHECKING:
    from sluice.api.metrics import Metrics

__all__ = ["PartSample", "Snapshot", "SnapshotCollector"]


@dataclass(frozen=True, slots=True)
class PartSample:
    """One part of the process (sluice.runtime.parts) and its failures."""

    name: str
    failing: bool
    failing_since_at: float | None
    errors_total: int
    storage: bool  # the last failure was the storage's (a full disk), not a bug


@dataclass(slots=True)
class Snapshot:
    """What the running parts say at one moment (gathered on the event loop)."""

    at: float
    counts: Counts | None
    scheduler: Any  # sluice.scheduler.QueueStats
    manual_suspensions: int
    automatic_suspensions: int
    dead_destinations: int
    manager: Any  # sluice.api.ports.ManagerCounters
    agent: Any  # sluice.api.ports.ConnectionCounters
    parts: list[PartSample] = field(default_factory=list)
    cluster: Any = None  # sluice.cluster.agent.ClusterStatus, in a cluster
    tenants: Any = None  # list of sluice.scheduler.TenantView
    oldest: dict[QueueState, float] | None = None  # arrival of the oldest entry per state


class SnapshotCollector(Collector):
    """Serves the last Snapshot of the running parts at each scrape."""

    def __init__(self, metrics: Metrics) -> None:
        """Serve ``metrics.snapshot`` (and its start time and tenant labels)."""
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        """Yield the families of the last snapshot (only up and start before one)."""
        snap = self.metrics.snapshot
        up = GaugeMetricFamily("sluice_up", "1 while the queue manager runs")
        up.add_metric([], 1.0 if snap is not None else 0.0)
        yield up
        start = GaugeMetricFamily("sluice_start_time_seconds", "When the API started")
        start.add_metric([], self.metrics.started_at)
        yield start
        if snap is None:
            return
        if snap.counts is not None:
            g = GaugeMetricFamily("sluice_queue_recipients",
                                  "Recipient entries in the queue by state", labels=["state"])
            for state in QueueState:
                g.add_metric([state.value], float(snap.counts[state]))
            yield g
            g = GaugeMetricFamily("sluice_queue_messages", "Messages in the queue")
            g.add_metric([], float(snap.counts.messages))
            yield g
        if snap.oldest is not None:
            g = GaugeMetricFamily("sluice_queue_oldest_age_seconds",
                                  "Age of the oldest recipient entry in each state "
                                  "(0: the state is empty)", labels=["state"])
            for state in QueueState:
                at = snap.oldest.get(state)
                g.add_metric([state.value], 0.0 if at is None else max(0.0, snap.at - at))
            yield g
        s = snap.scheduler
        for name, text, value in (
            ("sluice_active_queue_recipients", "Recipients held in the queue manager's memory",
             s.memory_used),
            ("sluice_active_queue_limit_recipients", "maxmemoryqueue", s.maxmemoryqueue),
            ("sluice_active_queue_queued_recipients", "Recipients waiting for pickup",
             s.queued_entries),
            ("sluice_active_queue_inflight_recipients", "Recipients being delivered",
             s.inflight_entries),
            ("sluice_active_queue_inflight_deliveries", "Deliveries (SMTP transactions) in flight",
             s.inflight_jobs),
            ("sluice_active_queue_subqueues", "Sub-queues with work", s.subqueues),
            ("sluice_active_queue_parked_subqueues",
             "Sub-queues waiting on a threshold, a suspension or a destination",
             s.parked_subqueues),
            ("sluice_counter_entries", "Pickup policy counter entries tracked",
             s.counter_entries),
            ("sluice_destinations", "Destinations with slow-start or status-cache state",
             s.destinations),
            ("sluice_destinations_dead", "Destinations marked dead in the status cache",
             snap.dead_destinations),
        ):
            g = GaugeMetricFamily(name, text)
            g.add_metric([], float(value))
            yield g
        c = CounterMetricFamily("sluice_pickups", "Deliveries picked up by the scheduler")
        c.add_metric([], float(s.pickups))
        yield c
        g = GaugeMetricFamily("sluice_suspensions", "Active suspensions", labels=["kind"])
        g.add_metric(["manual"], float(snap.manual_suspensions))
        g.add_metric(["automatic"], float(snap.automatic_suspensions))
        yield g
        a = snap.agent
        g = GaugeMetricFamily("sluice_delivery_connections", "Outgoing SMTP/LMTP connections",
                              labels=["state"])
        g.add_metric(["open"], float(a.open))
        g.add_metric(["idle"], float(a.idle))
        yield g
        for name, text, value in (
            ("sluice_delivery_connections_opened", "Connections opened", a.connections_opened),
            ("sluice_delivery_connections_reused", "Deliveries on a kept connection",
             a.connections_reused),
            ("sluice_delivery_connect_failures", "Connection attempts that failed",
             a.connect_failures),
            ("sluice_delivery_transactions", "SMTP/LMTP transactions", a.transactions),
        ):
            c = CounterMetricFamily(name, text)
            c.add_metric([], float(value))
            yield c
        m = snap.manager
        c = CounterMetricFamily("sluice_manager_recipients",
                                "Recipients handled by this queue manager, by what happened",
                                labels=["event"])
        for event in ("claimed", "delivered", "deferred", "bounced", "unrouted"):
            c.add_metric([event], float(getattr(m, event)))
        yield c
        if snap.cluster is not None:
            from sluice.cluster.metrics import families
            yield from families(snap.cluster)
        if snap.tenants is not None:
            yield from self._tenant_families(snap.tenants)

        yield from _part_metrics(snap.parts)

    def _tenant_families(self, views: Any) -> Iterator[Metric]:
        queued: dict[str, int] = {}
        waiting: dict[str, int] = {}
        inflight: dict[str, int] = {}
        for v in views:
            label = self.metrics.tenant_label(v.tenant)
            queued[label] = queued.get(label, 0) + v.queued_jobs
            waiting[label] = waiting.get(label, 0) + v.waiting_subqueues
            inflight[label] = inflight.get(label, 0) + v.inflight
        for name, text, values in (
            ("sluice_tenant_queued_jobs", "Jobs waiting for pickup in the active queue, by "
             "tenant", queued),
            ("sluice_tenant_waiting_subqueues", "Sub-queues parked on a limit, a suspension "
             "or their tenant's turn, by tenant", waiting),
            ("sluice_tenant_inflight_deliveries", "Deliveries in flight, by tenant", inflight),
        ):
            g = GaugeMetricFamily(name, text, labels=["tenant"])
            for label, value in sorted(values.items()):
                g.add_metric([label], float(value))
            yield g


def _part_metrics(parts: Sequence[PartSample]) -> Iterator[Metric]:
    """Failing parts (a full disk, a crashed watcher): sluice.runtime.parts."""
    failing = GaugeMetricFamily("sluice_part_failing",
                                "1 while a part of the process keeps failing", labels=["part"])
    since = GaugeMetricFamily("sluice_part_failing_since_seconds",
                              "When a failing part's current run of failures began",
                              labels=["part"])
    errors = CounterMetricFamily("sluice_part_errors",
                                 "Failures of each part since the process started",
                                 labels=["part"])
    for p in parts:
        failing.add_metric([p.name], 1.0 if p.failing else 0.0)
        errors.add_metric([p.name], float(p.errors_total))
        if p.failing and p.failing_since_at is not None:
            since.add_metric([p.name], p.failing_since_at)
    storage = [p.failing_since_at or 0.0 for p in parts if p.failing and p.storage]
    store = GaugeMetricFamily("sluice_storage_failing",
                              "1 while storage errors (a full disk) keep a part failing")
    store.add_metric([], 1.0 if storage else 0.0)
    store_since = GaugeMetricFamily("sluice_storage_failing_since_seconds",
                                    "When the storage errors began (0: none now)")
    store_since.add_metric([], min(storage) if storage else 0.0)
    yield from (failing, since, errors, store, store_since)
