"""Shaping in /metrics: firings per rule, groups in back-off, actions in force.

A prometheus_client Collector over the running Shaper, registered by the
API server beside the queue's own: read at scrape time, nothing counted
twice.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sluice.shaping.runtime import Shaper

__all__ = ["ShapingCollector"]


class ShapingCollector(Collector):
    """Reads the running Shaper's figures at scrape time (see the module header)."""
    def __init__(self, shaper: Shaper) -> None:
        self.shaper = shaper

    def collect(self) -> Iterator[Metric]:
        """The shaping metrics as they are now."""
        c = CounterMetricFamily("sluice_shaping_firings", "Shaping rule firings since start",
                                labels=["rule"])
        for rule, count in sorted(self.shaper.engine.firings.items()):
            c.add_metric([rule], float(count))
        yield c
        g = GaugeMetricFamily("sluice_shaping_backoff_groups",
                              "Destination groups a shaping rule holds backed off")
        g.add_metric([], float(self.shaper.engine.backing_off()))
        yield g
        tally = Tally(str(f.action) for f in self.shaper.active())
        g = GaugeMetricFamily("sluice_shaping_active_actions",
                              "Automatic actions in force, by kind", labels=["action"])
        for action, count in sorted(tally.items()):
            g.add_metric([action], float(count))
        yield g
        g = GaugeMetricFamily("sluice_shaping_rules", "Shaping rules loaded")
        g.add_metric([], float(len(self.shaper.engine.rules)))
        yield g
