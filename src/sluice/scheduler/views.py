"""Read-only pictures of the scheduler for the API, metrics and the CLI.

SUMMARY
    QueueStats, SubQueueView, CounterView, SuspensionView, DestinationView:
    plain frozen data, built on request (O(size of what they show)), never
    on the pickup path.

SEE ALSO
    Scheduler.stats(), .subqueues(), .counters(), .suspensions(),
    .destinations(), .explain()
"""

from __future__ import annotations

from dataclasses import dataclass

from sluice.scheduler.events import Route

__all__ = ["CounterView", "DestinationView", "QueueStats", "SubQueueView", "SuspensionView",
           "TenantView"]


@dataclass(frozen=True, slots=True)
class QueueStats:
    """Memory (in recipients) and work in numbers."""

    memory_used: int
    maxmemoryqueue: int
    claim_pending: int
    routing: int
    queued_entries: int
    queued_jobs: int
    inflight_entries: int
    inflight_jobs: int
    max_deliveries: int
    subqueues: int
    parked_subqueues: int
    counter_entries: int
    destinations: int
    pickups: int


@dataclass(frozen=True, slots=True)
class SubQueueView:
    """One sub-queue: its route and priority, what it holds, and what holds it."""
    route: Route
    priority: int
    jobs: int
    entries: int
    parked: bool
    held_by: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class CounterView:
    """One counter entry against its thresholds."""

    counter: str
    key: tuple[tuple[str, str], ...]
    inflight: int
    concurrency: int | None
    rate: str | None
    rate_used: int
    connectinterval_s: float | None
    next_connect_at: float | None
    exceeded: bool
    waiting_subqueues: int
    condition: str | None


@dataclass(frozen=True, slots=True)
class SuspensionView:
    """A suspension: by hand (``automatic`` False) or a counter over threshold."""

    id: str
    fields: tuple[tuple[str, str], ...]
    automatic: bool
    expires_at: float | None
    tag: str
    reason: str
    waiting_subqueues: int
    from_file: bool = False  # listed in the policy file (a reload may lift it)


@dataclass(frozen=True, slots=True)
class DestinationView:
    """Slow start and the status cache for one destination."""

    destination: str
    window: float
    limit: int
    inflight: int
    dead: bool
    dead_until_at: float | None
    failed_cohorts: float
    queued_jobs: int


@dataclass(frozen=True, slots=True)
class TenantView:
    """A tenant's share and what it has in the active queue (no recipients)."""

    tenant: str
    weight: float
    min_share: float
    queued_jobs: int
    queued_entries: int
    waiting_subqueues: int  # parked on a limit or a suspension
    inflight: int
    pickups: int
