"""The cluster's part of /metrics: shared or fallen back, take-overs, the cost of a grant.

All present from the start (at zero), so that a rate or an alert on them
works before the first event.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from sluice.cluster.agent import ClusterStatus

__all__ = ["families"]


def families(status: ClusterStatus) -> Iterator[Metric]:
    """Metric families for one node's ClusterStatus."""
    g = GaugeMetricFamily("sluice_cluster_limits_shared",
                          "1 while the limits are shared through Redis, 0 while this node "
                          "keeps its share of them alone")
    g.add_metric([], 1.0 if status.shared else 0.0)
    yield g
    g = GaugeMetricFamily("sluice_cluster_reachable", "Whether the cluster's stores answer",
                          labels=["store"])
    g.add_metric(["redis"], 1.0 if status.redis_reachable else 0.0)
    if status.postgres_reachable is not None:
        g.add_metric(["postgres"], 1.0 if status.postgres_reachable else 0.0)
    yield g
    g = GaugeMetricFamily("sluice_cluster_nodes", "Live nodes as this node sees them")
    g.add_metric([], float(len(status.live_nodes)))
    yield g
    for name, text, value in (
        ("sluice_cluster_fallbacks", "Times the limits fell back to this node's share",
         status.fallbacks),
        ("sluice_cluster_takeovers", "Dead nodes whose claims this node returned to the queue",
         status.takeovers),
        ("sluice_cluster_takeover_recipients", "Recipients returned to the queue from dead "
         "nodes", status.entries_taken_over),
        ("sluice_cluster_grant_round_trips", "Requests to the shared limits in Redis",
         status.grant_round_trips),
        ("sluice_cluster_grant_seconds", "Time spent in requests to the shared limits",
         status.grant_seconds),
    ):
        c = CounterMetricFamily(name, text)
        c.add_metric([], float(value))
        yield c
