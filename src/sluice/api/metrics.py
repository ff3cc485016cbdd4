"""Prometheus metrics: the queue, the active queue, delivery and the store.

SUMMARY
    metrics = Metrics(config); metrics.tail.prime(); metrics.poll(now)
    (every second); await metrics.refresh(...) then metrics.render()
    (GET /metrics).  TimedStore(store, metrics) measures store writes.

DESCRIPTION
    Three sources, so that nothing is counted on the delivery path:

    the accounting log   every transition of every recipient, written by
                         every process of this node (the receiving
                         processes too), and the end of every SMTP
                         connection (sluice.api.metrics_smtpd).  AccountingTail reads what was
                         appended since the last poll and counts
                         accepted (received), delivered, deferred and
                         bounced (bounced, expired) recipients by domain
                         group and tenant, the attempt durations and the
                         time from arrival to delivery.
    the running parts    at scrape time: the store's counts by state, the
                         scheduler's views (memory, sub-queues, counter
                         entries, suspensions, destinations), the queue
                         manager's and the delivery agent's counters, and
                         the parts that keep failing (a full disk).
    store writes         TimedStore wraps the queue's store and times each
                         call that commits (submit, claim, apply, modify,
                         claim_bounces, recover) as its caller sees it,
                         waiting for the group commit included.

STRATEGIES
    Bounded label cardinality.  ``domain`` is a configured group
    (api.metrics_domain_groups, wildcards or /regex/), else the domain
    itself if it is one of the first api.metrics_domains domains to reach
    api.metrics_min_count events, else "other"; ``tenant`` likewise with
    api.metrics_tenants.  A value once given a label keeps it for the
    life of the process, so every series stays monotonic; events of a
    domain before it reached the count are in "other".  Candidates are
    counted in a table of at most CANDIDATES values whose counts halve
    when it fills (old noise fades, steady traffic gets through).  So
    recipients_total has at most 4 x (groups + metrics_domains + 2) x
    (metrics_tenants + 2) series, whatever the traffic.

    Only this node's lines (``node`` = node.id) are counted, so nodes
    sharing one log directory do not count each other.

LIMITATIONS
    Counters start at zero when the API starts (lines written before are
    not read); Prometheus handles the reset.  The accounting log is not
    fsynced line by line, so a power cut may lose the last lines' counts.
    Only the newest TAIL_FILES files are followed: a process whose clock
    is hours off writes where it is not read.

MODULES
    sluice.api.metric_labels (bounded labels), sluice.api.accounting_tail
    (following the log), sluice.api.metrics_snapshot (the running parts at
    scrape time), sluice.api.timed_store (store writes); this module holds
    the registry and the counters fed from the accounting log.

SEE ALSO
    sluice.accounting, sluice.scheduler.views, docs/api.md
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from sluice.api.accounting_tail import AccountingTail
from sluice.api.activity import Activity
from sluice.api.metric_labels import CANDIDATES, NONE, OTHER, DomainLabels, LabelLimiter
from sluice.api.metrics_smtpd import ReceivingCounters
from sluice.api.metrics_snapshot import PartSample, Snapshot, SnapshotCollector
from sluice.api.timed_store import STORE_OPS, TimedStore
from sluice.config import Config
from sluice.model import QueueState
from sluice.store import Counts

__all__ = [
    "CANDIDATES",
    "AccountingTail",
    "DomainLabels",
    "LabelLimiter",
    "Metrics",
    "PartSample",
    "Snapshot",
    "TimedStore",
]

T = TypeVar("T")

#: Events as counted: accounting event -> label value.
EVENT_NAMES = {
    "received": "accepted",
    "delivered": "delivered",
    "deferred": "deferred",
    "bounced": "bounced",
    "expired": "bounced",
    "duplicate": "duplicate",  # a resend answered, not queued (smtpd.dedupe)
}

ATTEMPT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
                   300.0)
LATENCY_BUCKETS = (0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0, 4 * 3600.0,
                   24 * 3600.0, 72 * 3600.0)
STORE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                 5.0)


class Metrics:
    """The registry /metrics renders, and the counters behind it."""

    def __init__(self, config: Config) -> None:
        api = config.api
        # The *_created series double every series for little use.
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.node = config.node.id
        self.started_at = time.time()
        self.registry = CollectorRegistry(auto_describe=False)
        self.recipients = Counter(
            "sluice_recipients", "Recipients accepted, delivered, deferred and bounced, "
            "and resends answered without queueing (duplicate), from the accounting log, "
            "by domain group and tenant",
            ["event", "domain", "tenant"], registry=self.registry)
        self.attempt_seconds = Histogram(
            "sluice_delivery_attempt_seconds", "How long delivery attempts took, by outcome",
            ["outcome"], buckets=ATTEMPT_BUCKETS, registry=self.registry)
        self.latency_seconds = Histogram(
            "sluice_delivery_latency_seconds", "From arrival to delivery, per recipient",
            buckets=LATENCY_BUCKETS, registry=self.registry)
        self.store_seconds = Histogram(
            "sluice_store_write_seconds", "Store calls that commit, as their caller waits "
            "for them (group commit included), by operation",
            ["op"], buckets=STORE_BUCKETS, registry=self.registry)
        self.store_errors = Counter(
            "sluice_store_write_errors", "Store calls that commit and failed, by operation",
            ["op"], registry=self.registry)
        self.tenant_pickups = Counter(
            "sluice_tenant_pickups", "Deliveries picked up by the scheduler, by tenant",
            ["tenant"], registry=self.registry)
        self._tenant_pickups_seen: dict[str, int] = {}
        for op in STORE_OPS:  # present at zero, so rate() works before the first error
            self.store_errors.labels(op)
        self.messages = Counter("sluice_messages_accepted",
                                "Messages queued (SMTP and HTTP), from the accounting log",
                                registry=self.registry)
        self.message_bytes = Counter("sluice_message_bytes_accepted",
                                     "Bytes of the messages queued, from the accounting log",
                                     registry=self.registry)
        self._accepted = [0, 0]  # messages, bytes since the last flush
        self.smtpd = ReceivingCounters(self.registry)
        self.lines = Counter("sluice_accounting_lines_read",
                             "Accounting log lines read by the metrics tail",
                             registry=self.registry)
        self.registry.register(SnapshotCollector(self))
        self.domains = DomainLabels(api.metrics_domain_groups, api.metrics_domains,
                                    api.metrics_min_count)
        self.tenants = LabelLimiter(api.metrics_tenants, api.metrics_min_count)
        self.tail = AccountingTail(config.accounting.path)
        self.totals = {"accepted": 0, "delivered": 0, "deferred": 0, "bounced": 0}
        #: (at, accepted, delivered, deferred, bounced), one per poll, 5 minutes' worth.
        self.samples: deque[tuple[float, int, int, int, int]] = deque(maxlen=301)
        self.snapshot: Snapshot | None = None
        #: The last hour by second, destination and deferral reason (the web page's charts).
        self.activity = Activity()
        self._polled_at = time.time()
        #: The store's counts and oldest entry per state of the last scrape:
        #: (when, counts, oldest), kept a second.
        self.counts_cache: tuple[float, Counts | None, dict[QueueState, float] | None] | None \
            = None
        self._pending: dict[tuple[str, str, str], int] = {}
        self._lines = 0

    # -- the accounting log ---------------------------------------------------------

    def observe_line(self, line: bytes) -> None:
        """Count one raw accounting line (lines that are not JSON objects are skipped)."""
        self._lines += 1
        try:
            event = json.loads(line)
        except ValueError:
            return
        if not isinstance(event, dict):
            return
        self.observe(event)

    def observe(self, event: Mapping[str, Any]) -> None:
        """Count one accounting event, if it is this node's and one counted.

        The Prometheus counters see it at the next flush().
        """
        if (event.get("node") or self.node) != self.node:
            return
        kind = str(event.get("event"))
        if kind in ("received", "session"):
            self.smtpd.observe(event)
        name = EVENT_NAMES.get(kind)
        if name is None:
            return
        domain = self.domains.label(str(event.get("domain") or ""))
        tenant = self.tenants.label(str(event.get("tenantid") or ""))
        key = (name, domain, tenant)
        self._pending[key] = self._pending.get(key, 0) + 1
        if name in self.totals:  # the throughput samples' four (and the console's)
            self.totals[name] += 1
            self.activity.record(name, event, self._polled_at)
        if name == "accepted" and str(event.get("qid", "")).endswith("-0"):
            # A message's recipients are numbered from 0: count it once.
            self._accepted[0] += 1
            size = event.get("size")
            self._accepted[1] += size if isinstance(size, int) else 0
        duration = event.get("duration_s")
        if name != "accepted" and isinstance(duration, int | float):
            self.attempt_seconds.labels(name).observe(float(duration))
        age = event.get("queue_age_s")
        if name == "delivered" and isinstance(age, int | float):
            self.latency_seconds.observe(float(age))

    def flush(self) -> None:
        """Add what observe() counted to the Prometheus counters.

        One increment per label set and poll, not one per line.
        """
        pending, self._pending = self._pending, {}
        self.smtpd.flush()
        for (name, domain, tenant), n in pending.items():
            self.recipients.labels(name, domain, tenant).inc(n)
        if self._accepted[0]:
            self.messages.inc(self._accepted[0])
            self.message_bytes.inc(self._accepted[1])
            self._accepted = [0, 0]
        if self._lines:
            self.lines.inc(self._lines)
            self._lines = 0

    def poll(self, now: float) -> int:
        """Read new accounting lines and take a throughput sample (blocking I/O)."""
        self._polled_at = now
        read = self.tail.poll(self.observe_line)
        self.flush()
        t = self.totals
        self.samples.append((now, t["accepted"], t["delivered"], t["deferred"], t["bounced"]))
        return read

    def rates(self, window_s: float) -> tuple[float, float, float, float]:
        """Per-second rates over the last ``window_s`` seconds of samples."""
        if len(self.samples) < 2:
            return (0.0, 0.0, 0.0, 0.0)
        last = self.samples[-1]
        first = last
        for sample in reversed(self.samples):
            if last[0] - sample[0] > window_s:
                break
            first = sample
        span = last[0] - first[0]
        if span <= 0:
            return (0.0, 0.0, 0.0, 0.0)
        return tuple((b - a) / span for a, b in zip(first[1:], last[1:], strict=True))  # type: ignore[return-value]

    # -- scrape ---------------------------------------------------------------------------

    def tenant_label(self, tenant: str) -> str:
        """The tenant's label if the accounting log gave it one, else other/none."""
        if not tenant:
            return NONE
        return tenant if tenant in self.tenants.admitted else OTHER

    def observe_tenants(self, views: Any) -> None:
        """Add the pickups each tenant made since the last look.

        The scheduler forgets an idle tenant: a count that went down starts again.
        """
        seen = self._tenant_pickups_seen
        for v in views:
            before = seen.get(v.tenant, 0)
            delta = v.pickups - before if v.pickups >= before else v.pickups
            if delta:
                self.tenant_pickups.labels(self.tenant_label(v.tenant)).inc(delta)
            seen[v.tenant] = v.pickups
        if len(seen) > 100_000:  # tenants come and go: keep the map bounded
            live = {v.tenant for v in views}
            for tenant in [t for t in seen if t not in live]:
                del seen[tenant]

    def render(self) -> bytes:
        """The registry in Prometheus' text format."""
        return generate_latest(self.registry)

    def timed(self, op: str, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        """Call ``fn`` and time it as store operation ``op`` (errors counted)."""
        start = time.perf_counter()
        try:
            result = fn(*args, **kw)
        except Exception:
            self.store_errors.labels(op).inc()
            raise
        self.store_seconds.labels(op).observe(time.perf_counter() - start)
        return result
