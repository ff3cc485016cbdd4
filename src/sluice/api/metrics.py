"""Prometheus metrics: the queue, the active queue, delivery and the store.

SUMMARY
    metrics = Metrics(config); metrics.tail.prime(); metrics.poll(now)
    (every second); await metrics.refresh(...) then metrics.render()
    (GET /metrics).  TimedStore(store, metrics) measures store writes.

DESCRIPTION
    Three sources, so that nothing is counted on the delivery path:

    the accounting log   every transition of every recipient, written by
                         every process of this node (the receiving
                         processes too).  AccountingTail reads what was
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
    fsynced line by line, so a crash may lose the last lines' counts.
    Only the newest TAIL_FILES files are followed: a process whose clock
    is hours off writes where it is not read.

SEE ALSO
    sluice.accounting, sluice.scheduler.views, docs/api.md
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TypeVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sluice.api.activity import Activity
from sluice.config import Config
from sluice.model import Accepted, QueueEntry, QueueState, Reply, Selector, Submission
from sluice.scheduler import Pattern
from sluice.spool import Content
from sluice.store import Action, Change, Counts, Store, Transition

__all__ = [
    "AccountingTail",
    "DomainLabels",
    "LabelLimiter",
    "Metrics",
    "PartSample",
    "Snapshot",
    "TimedStore",
]

T = TypeVar("T")

#: Candidate values counted at most (per label) before counts halve.
CANDIDATES = 4096

#: Accounting files followed (the newest by name): the current period, the
#: one before (lines written across the boundary) and one spare.
TAIL_FILES = 3

#: The most bytes one poll reads from the accounting log.
POLL_MAX_BYTES = 32 << 20

#: Events as counted: accounting event -> label value.
EVENT_NAMES = {
    "received": "accepted",
    "delivered": "delivered",
    "deferred": "deferred",
    "bounced": "bounced",
    "expired": "bounced",
    "duplicate": "duplicate",  # a resend answered, not queued (smtpd.dedupe)
}

OTHER = "other"
NONE = "none"

ATTEMPT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
                   300.0)
LATENCY_BUCKETS = (0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0, 4 * 3600.0,
                   24 * 3600.0, 72 * 3600.0)
STORE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                 5.0)


class LabelLimiter:
    """Gives at most ``limit`` values a label of their own; the rest are "other"."""

    def __init__(self, limit: int, min_count: int) -> None:
        self.limit = limit
        self.min_count = max(1, min_count)
        self.admitted: set[str] = set()
        self._candidates: dict[str, int] = {}

    def label(self, value: str) -> str:
        if not value:
            return NONE
        if value in self.admitted:
            return value
        if len(self.admitted) >= self.limit:
            return OTHER
        n = self._candidates.get(value, 0) + 1
        if n >= self.min_count:
            self.admitted.add(value)
            self._candidates.pop(value, None)
            if len(self.admitted) >= self.limit:
                self._candidates.clear()  # no room left: stop counting
            return value
        if len(self._candidates) >= CANDIDATES and value not in self._candidates:
            # Full: halve every count and forget what falls to zero.
            self._candidates = {k: v // 2 for k, v in self._candidates.items() if v > 1}
        self._candidates[value] = n
        return OTHER


class DomainLabels:
    """Recipient domain -> label: a configured group, an admitted domain, or "other"."""

    def __init__(self, groups: Mapping[str, Sequence[str]], limit: int, min_count: int) -> None:
        self.groups = [(name, [Pattern.compile(p) for p in patterns])
                       for name, patterns in groups.items()]
        self.limiter = LabelLimiter(limit, min_count)
        self._cache: dict[str, str] = {}

    def label(self, domain: str) -> str:
        cached = self._cache.get(domain)
        if cached is not None:
            return cached
        for name, patterns in self.groups:
            if any(p.matches(domain) for p in patterns):
                if len(self._cache) < CANDIDATES:
                    self._cache[domain] = name
                return name
        label = self.limiter.label(domain)
        if label != OTHER and label != NONE and len(self._cache) < CANDIDATES:
            self._cache[domain] = label  # admitted for good
        return label


class AccountingTail:
    """Reads the lines appended to the accounting log since the last poll."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._offsets: dict[str, int] = {}
        self._partial: dict[str, bytes] = {}

    def _names(self) -> list[str]:
        try:
            names = [n for n in os.listdir(self.path)
                     if n.startswith("sluice-acct-") and n.endswith(".jsonl")]
        except FileNotFoundError:
            return []
        return sorted(names)[-TAIL_FILES:]

    def prime(self) -> None:
        """Start at the end: lines written before now are not counted."""
        for name in self._names():
            try:
                self._offsets[name] = (self.path / name).stat().st_size
            except FileNotFoundError:
                continue

    def poll(self, handle: Callable[[bytes], None], max_bytes: int = POLL_MAX_BYTES) -> int:
        """Call ``handle`` with every complete new line; returns bytes read."""
        names = self._names()
        for gone in set(self._offsets) - set(names):
            self._offsets.pop(gone, None)
            self._partial.pop(gone, None)
        total = 0
        for name in names:
            offset = self._offsets.get(name, 0)
            try:
                with open(self.path / name, "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    if size < offset:  # replaced by a shorter file
                        offset = 0
                        self._partial.pop(name, None)
                    if size == offset:
                        self._offsets[name] = offset
                        continue
                    f.seek(offset)
                    data = f.read(min(size - offset, max(0, max_bytes - total)))
            except FileNotFoundError:
                continue
            if not data:
                continue
            total += len(data)
            self._offsets[name] = offset + len(data)
            data = self._partial.pop(name, b"") + data
            lines = data.split(b"\n")
            if lines[-1]:
                self._partial[name] = lines[-1]
            for line in lines[:-1]:
                if line:
                    handle(line)
            if total >= max_bytes:
                break
        return total


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


class _SnapshotCollector(Collector):
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
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
        self.lines = Counter("sluice_accounting_lines_read",
                             "Accounting log lines read by the metrics tail",
                             registry=self.registry)
        self.registry.register(_SnapshotCollector(self))
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
        #: The store's counts of the last scrape: (when, counts), kept a second.
        self.counts_cache: tuple[float, Counts | None] | None = None
        self._pending: dict[tuple[str, str, str], int] = {}
        self._lines = 0

    # -- the accounting log ---------------------------------------------------------

    def observe_line(self, line: bytes) -> None:
        self._lines += 1
        try:
            event = json.loads(line)
        except ValueError:
            return
        if not isinstance(event, dict):
            return
        self.observe(event)

    def observe(self, event: Mapping[str, Any]) -> None:
        """Count one accounting event (if it is this node's and one we count);
        the counters see it at the next flush()."""
        name = EVENT_NAMES.get(str(event.get("event")))
        if name is None or (event.get("node") or self.node) != self.node:
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
        """Add what observe() counted to the Prometheus counters: one
        increment per label set and poll, not one per line."""
        pending, self._pending = self._pending, {}
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
        """Add the pickups each tenant made since the last look (the scheduler
        forgets an idle tenant: a count that went down starts again)."""
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
        return generate_latest(self.registry)

    def timed(self, op: str, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        start = time.perf_counter()
        try:
            result = fn(*args, **kw)
        except Exception:
            self.store_errors.labels(op).inc()
            raise
        self.store_seconds.labels(op).observe(time.perf_counter() - start)
        return result


#: The operations TimedStore times (the ``op`` label).
STORE_OPS = ("submit", "claim", "claim_bounces", "apply", "modify", "recover")


class TimedStore:
    """A Store that times the calls that commit, and passes everything through."""

    def __init__(self, store: Store, metrics: Metrics) -> None:
        self.inner = store
        self.metrics = metrics
        self.flavour = store.flavour
        self.shared_access = store.shared_access

    def __getattr__(self, name: str) -> Any:
        # Flavour-specific extras (a spool, a path) stay reachable.
        return getattr(self.inner, name)

    def submit(self, submission: Submission, content: Content, now: float) -> Accepted:
        return self.metrics.timed("submit", self.inner.submit, submission, content, now)

    def submit_future(self, submission: Submission, content: Content, now: float
                      ) -> concurrent.futures.Future[Accepted]:
        start = time.perf_counter()
        fut = self.inner.submit_future(submission, content, now)

        def done(f: concurrent.futures.Future[Accepted]) -> None:
            if f.cancelled() or f.exception() is not None:
                self.metrics.store_errors.labels("submit").inc()
            else:
                self.metrics.store_seconds.labels("submit").observe(time.perf_counter() - start)

        fut.add_done_callback(done)
        return fut

    def claim(self, limit: int, now: float, quota_deferred: int) -> list[QueueEntry]:
        return self.metrics.timed("claim", self.inner.claim, limit, now, quota_deferred)

    def apply(self, transitions: Sequence[Transition], *, wait: bool = True,
              durable: bool = True) -> set[str]:
        if not wait:
            return self.inner.apply(transitions, wait=False, durable=durable)
        return self.metrics.timed("apply", self.inner.apply, transitions, wait=True,
                                  durable=durable)

    def claim_bounces(self, limit: int, now: float, lease_s: float) -> list[QueueEntry]:
        return self.metrics.timed("claim_bounces", self.inner.claim_bounces, limit, now,
                                  lease_s)

    def recover(self, now: float) -> int:
        return self.metrics.timed("recover", self.inner.recover, now)

    def expired(self, cutoff_at: float, reports_cutoff_at: float,
                limit: int = 10000) -> list[QueueEntry]:
        return self.inner.expired(cutoff_at, reports_cutoff_at, limit)

    def due_at(self) -> float | None:
        return self.inner.due_at()

    def modify(self, selector: Selector, action: Action, now: float,
               priority: int | None = None, reply: Reply | None = None) -> list[QueueEntry]:
        return self.metrics.timed("modify", self.inner.modify, selector, action, now,
                                  priority=priority, reply=reply)

    def changes_since(self, seq: int) -> tuple[int, list[Change]]:
        return self.inner.changes_since(seq)

    def get(self, qid: str) -> QueueEntry | None:
        return self.inner.get(qid)

    def entries(self, selector: Selector, *, after: str | None = None,
                limit: int | None = None) -> Iterator[QueueEntry]:
        return self.inner.entries(selector, after=after, limit=limit)

    def count(self, selector: Selector | None = None) -> Counts:
        return self.inner.count(selector)

    def shape(self, selector: Selector, now: float,
              edges_s: Sequence[float]) -> dict[str, list[int]]:
        return self.inner.shape(selector, now, edges_s)

    def open_content(self, spid: str) -> IO[bytes]:
        return self.inner.open_content(spid)

    def close(self) -> None:
        self.inner.close()
