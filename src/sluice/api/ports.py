"""What the API needs of a running `sluice serve`: a narrow protocol, not the runtime.

SUMMARY
    Manager         the queue manager as the API sees it: its scheduler's
                    views, the operator changes it takes, its counters
    SchedulerViews  the read-only views of the scheduler
    PartStatus      one part of the process and whether it is failing

DESCRIPTION
    The runtime owns the API server: sluice.runtime.serve starts it and
    hands it the queue (sluice.queue.Queue) and its queue manager.  The
    API depends only on these protocols, never on sluice.runtime, so the
    two packages do not import each other (tests/unit/test_api_imports.py
    walks the imports to keep it so).  The queue manager satisfies
    Manager as it is; a test may hand the API anything else that does.

    Every call is made on the event loop the queue manager runs on: the
    scheduler is not thread-safe.

SEE ALSO
    sluice.api.control, sluice.runtime.manager, sluice.runtime.parts
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from sluice.scheduler import (
    CounterView,
    DestinationView,
    Event,
    Explanation,
    Policy,
    QueueStats,
    SubQueueView,
    SuspensionView,
)
from sluice.scheduler.views import TenantView

if TYPE_CHECKING:
    from sluice.cluster.agent import ClusterAgent
    from sluice.shaping.runtime import Shaper

__all__ = ["ConnectionCounters", "Manager", "ManagerCounters", "PartStatus", "SchedulerViews"]


class SchedulerViews(Protocol):
    """The scheduler, read only."""

    @property
    def policy(self) -> Policy:
        """The running pickup policy."""
        ...

    @property
    def now(self) -> float:
        """The scheduler's clock: the time of its last step."""
        ...

    def stats(self) -> QueueStats:
        """The active queue's memory and work in numbers."""
        ...

    def subqueues(self) -> list[SubQueueView]:
        """Every sub-queue with jobs."""
        ...

    def counters(self, now: float | None = None) -> list[CounterView]:
        """Counter entries with a threshold, against it."""
        ...

    def suspensions(self, now: float | None = None) -> list[SuspensionView]:
        """Suspensions in force, by hand and automatic."""
        ...

    def destinations(self, now: float | None = None) -> list[DestinationView]:
        """Every destination's slow start and status cache."""
        ...

    def explain(self, qid: str, now: float | None = None) -> Explanation:
        """Why recipient ``qid`` waits, as far as the scheduler knows."""
        ...

    def tenants(self) -> list[TenantView]:
        """Every tenant's share and what it has in the active queue."""
        ...


class ManagerCounters(Protocol):
    """Recipients the queue manager handled since it started."""

    @property
    def claimed(self) -> int:
        """Entries claimed from the store."""
        ...

    @property
    def deliveries(self) -> int:
        """Deliveries started."""
        ...

    @property
    def delivered(self) -> int:
        """Recipients delivered."""
        ...

    @property
    def deferred(self) -> int:
        """Recipients deferred."""
        ...

    @property
    def bounced(self) -> int:
        """Recipients bounced."""
        ...

    @property
    def unrouted(self) -> int:
        """Entries settled without a delivery attempt (no route, or the pre-delivery hook)."""
        ...

    @property
    def started_at(self) -> float:
        """When the queue manager started (POSIX time)."""
        ...


class ConnectionCounters(Protocol):
    """The delivery agent's connections."""

    @property
    def open(self) -> int:
        """Connections open now, idle or not."""
        ...

    @property
    def idle(self) -> int:
        """Connections open and waiting in the pool for reuse."""
        ...

    @property
    def connections_opened(self) -> int:
        """Connections opened since start."""
        ...

    @property
    def connections_reused(self) -> int:
        """Deliveries that reused an open connection."""
        ...

    @property
    def connect_failures(self) -> int:
        """Connection attempts that failed."""
        ...

    @property
    def transactions(self) -> int:
        """Mail transactions made."""
        ...


class PartStatus(Protocol):
    """One part of the process (a refill, a watcher, the recorder...) and its failures."""

    @property
    def name(self) -> str:
        """The part's name, as logs and /metrics give it."""
        ...

    @property
    def failing(self) -> bool:
        """Whether the part's last run failed."""
        ...

    @property
    def failing_since_at(self) -> float | None:
        """When the current run of failures began; None while the part works."""
        ...

    @property
    def errors_total(self) -> int:
        """Failures since start."""
        ...

    @property
    def storage(self) -> bool:
        """Whether the last failure was the storage's (a full disk) rather than a bug."""
        ...

    @property
    def last_error(self) -> str:
        """The last failure, described in one line."""
        ...


class Manager(Protocol):
    """The running queue manager, as much as the API uses of it."""

    @property
    def scheduler(self) -> SchedulerViews:
        """The scheduler's read-only views."""
        ...

    @property
    def policy_path(self) -> str | None:
        """The policy file a reload reads (scheduler.policy); None without one."""
        ...

    @property
    def stats(self) -> ManagerCounters:
        """What the queue manager handled since it started."""
        ...

    @property
    def connections(self) -> ConnectionCounters:
        """The delivery agent's connections."""
        ...

    @property
    def shaper(self) -> Shaper:
        """Adaptive shaping (sluice.shaping): its rules, actions and their audit."""
        ...

    @property
    def cluster(self) -> ClusterAgent | None:
        """This node's part in a cluster (limits shared through Redis), or None."""
        ...

    def change(self, event: Event) -> None:
        """Hand the scheduler an operator change, checked first: ValueError says why not.

        An operator change is a policy reload, or a condition or suspension
        added or removed.
        """
        ...

    def apply_changes(self, qids: set[str]) -> None:
        """Entries an operator changed in the store: forget the copies in memory."""
        ...

    def notify_mail(self, count: int = 1) -> None:
        """Mail was queued (NDRs of a bounce): refill soon."""
        ...

    def parts(self) -> Sequence[PartStatus]:
        """The parts of the process, for /metrics."""
        ...
