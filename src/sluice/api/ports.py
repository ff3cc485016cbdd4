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
    def policy(self) -> Policy: ...

    @property
    def now(self) -> float: ...

    def stats(self) -> QueueStats: ...

    def subqueues(self) -> list[SubQueueView]: ...

    def counters(self, now: float | None = None) -> list[CounterView]: ...

    def suspensions(self, now: float | None = None) -> list[SuspensionView]: ...

    def destinations(self, now: float | None = None) -> list[DestinationView]: ...

    def explain(self, qid: str, now: float | None = None) -> Explanation: ...

    def tenants(self) -> list[TenantView]: ...


class ManagerCounters(Protocol):
    """Recipients the queue manager handled since it started."""

    @property
    def claimed(self) -> int: ...

    @property
    def deliveries(self) -> int: ...

    @property
    def delivered(self) -> int: ...

    @property
    def deferred(self) -> int: ...

    @property
    def bounced(self) -> int: ...

    @property
    def unrouted(self) -> int: ...

    @property
    def started_at(self) -> float: ...


class ConnectionCounters(Protocol):
    """The delivery agent's connections."""

    @property
    def open(self) -> int: ...

    @property
    def idle(self) -> int: ...

    @property
    def connections_opened(self) -> int: ...

    @property
    def connections_reused(self) -> int: ...

    @property
    def connect_failures(self) -> int: ...

    @property
    def transactions(self) -> int: ...


class PartStatus(Protocol):
    """One part of the process (a refill, a watcher, the recorder...) and its failures."""

    @property
    def name(self) -> str: ...

    @property
    def failing(self) -> bool: ...

    @property
    def failing_since_at(self) -> float | None: ...

    @property
    def errors_total(self) -> int: ...

    @property
    def storage(self) -> bool: ...

    @property
    def last_error(self) -> str: ...


class Manager(Protocol):
    """The running queue manager, as much as the API uses of it."""

    @property
    def scheduler(self) -> SchedulerViews: ...

    @property
    def policy_path(self) -> str | None: ...

    @property
    def stats(self) -> ManagerCounters: ...

    @property
    def connections(self) -> ConnectionCounters: ...

    @property
    def shaper(self) -> Shaper:
        """Adaptive shaping (sluice.shaping): its rules, actions and their audit."""
        ...

    @property
    def cluster(self) -> ClusterAgent | None:
        """This node's part in a cluster (limits shared through Redis), or None."""
        ...

    def change(self, event: Event) -> None:
        """Hand the scheduler an operator change (a policy reload, a condition or
        suspension added or removed), checked first: ValueError says why not."""
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
