"""Sub-queues: delivery jobs that wait together, FIFO, under the same limits.

SUMMARY
    SubQueue, Job, Flight; SubQueues, the registry that keeps them and
    remembers emptied ones for a while.

DESCRIPTION
    Jobs wait in virtual *sub-queues*, one per distinct Route and priority
    (seed 004, Halon's pickup policies).  Every field a policy or a
    suspension can name is in the Route, so all jobs of a sub-queue are
    held by exactly the same limits, and the scheduler decides once per
    sub-queue, not once per job.  A sub-queue keeps, per source IP of its
    pool, its binding to the counter entries (limits.Binding) and the
    suspension that matches, if any.

STRATEGIES
    FIFO inside a sub-queue.  A job an operator takes away is marked
    dropped and skipped at the head; the deque is compacted when dropped
    jobs outnumber live ones.

    Emptied sub-queues are kept (least recently used first, bounded by
    maxmemoryqueue plus destination_cache_size) so that a destination
    with a trickle of mail does not bind its counter entries afresh for
    every message.  The bound comes from the settings, never the backlog.

SEE ALSO
    sluice.scheduler.lines (where they wait), sluice.scheduler.scheduler
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterator

from sluice.scheduler.destinations import Destination
from sluice.scheduler.events import DeliveryJob, Route
from sluice.scheduler.limits import Binding
from sluice.scheduler.lines import Blocker
from sluice.scheduler.suspensions import Suspended

__all__ = ["Flight", "Job", "SubQueue", "SubQueues"]


class SubQueue:
    """Jobs of one route and priority, oldest first."""

    __slots__ = ("bindings", "dest", "dropped", "in_ring", "ips", "jobs", "live", "parked_on",
                 "priority", "route", "rr", "susp", "susp_version", "tenant", "version",
                 "woken_by")

    def __init__(self, route: Route, priority: int, dest: Destination) -> None:
        self.route = route
        self.tenant = route.tenantid
        self.priority = priority
        self.dest = dest
        self.jobs: deque[Job] = deque()
        self.live = 0  # jobs not dropped
        self.dropped = 0  # dropped jobs still in the deque
        self.ips: tuple[str, ...] = route.localip or ("",)
        # Per source IP: what a pickup from it counts in, and the matching
        # suspension (looked up again when the suspensions change).
        self.bindings: list[Binding] = []
        self.version = -1  # the policy version of its bindings
        self.susp: list[Suspended | None] = []
        self.susp_version = -1
        self.rr = 0  # the pool's next source IP to try
        # Where it is: the ring (in_ring), woken by a blocker (woken_by), or
        # parked in the lines of the blockers that hold it.
        self.parked_on: tuple[Blocker, ...] = ()
        self.in_ring = False
        self.woken_by: Blocker | None = None

    @property
    def pool(self) -> bool:
        """Whether the route delivers from a pool of source IPs."""
        return len(self.ips) > 1

    def head(self) -> Job | None:
        """The first live job (dropped ones before it are discarded)."""
        jobs = self.jobs
        while jobs and jobs[0].dropped:
            jobs.popleft()
            self.dropped -= 1
        return jobs[0] if jobs else None

    def drop(self, job: Job) -> None:
        """An operator took ``job`` away."""
        job.dropped = True
        self.live -= 1
        self.dropped += 1
        if self.live and self.dropped > 32 and self.dropped > self.live:
            self.jobs = deque(j for j in self.jobs if not j.dropped)
            self.dropped = 0

    def ahead_of(self, job: Job) -> int:
        """Live jobs before ``job``."""
        n = 0
        for other in self.jobs:
            if other is job:
                break
            if not other.dropped:
                n += 1
        return n

    def entries(self) -> int:
        """How many recipients the sub-queue's live jobs hold."""
        return sum(len(j.qids) for j in self.jobs if not j.dropped)

    def __repr__(self) -> str:
        return f"SubQueue({self.route.destination}, p{self.priority}, {self.live} jobs)"


class Job:
    """A DeliveryJob waiting in a sub-queue (its qids shrink as operators take some)."""

    __slots__ = ("dropped", "job", "qids", "queued_at", "sq")

    def __init__(self, job: DeliveryJob, sq: SubQueue, now: float) -> None:
        self.job = job
        self.qids = job.qids
        self.sq = sq
        self.dropped = False
        self.queued_at = now


class Flight:
    """A delivery in flight: what it counts in, so that its end releases it."""

    __slots__ = ("binding", "dest", "ip", "job", "qids", "started_at", "tenant")

    def __init__(self, job: DeliveryJob, qids: tuple[str, ...], ip: str, binding: Binding,
                 dest: Destination, tenant: str, now: float) -> None:
        self.tenant = tenant
        self.job = job
        self.qids = qids
        self.ip = ip
        self.binding = binding
        self.dest = dest
        self.started_at = now


class SubQueues:
    """Every sub-queue by (route, priority); emptied ones are kept a while."""

    __slots__ = ("by_key", "empty", "empty_max", "forget")

    def __init__(self, empty_max: int, forget: Callable[[SubQueue], None]) -> None:
        self.by_key: dict[tuple[Route, int], SubQueue] = {}
        self.empty: OrderedDict[SubQueue, None] = OrderedDict()
        self.empty_max = empty_max
        self.forget = forget  # the scheduler lets go of what it held for one

    def get(self, route: Route, priority: int) -> SubQueue | None:
        """The sub-queue of ``route`` and ``priority``, if any; an emptied one is in use again."""
        sq = self.by_key.get((route, priority))
        if sq is not None and not sq.live:
            self.empty.pop(sq, None)
        return sq

    def add(self, sq: SubQueue) -> None:
        """Keep a new sub-queue, and list it under its destination."""
        self.by_key[(sq.route, sq.priority)] = sq
        sq.dest.subqueues[sq] = None

    def retire(self, sq: SubQueue) -> None:
        """``sq`` has no live job: it joins the emptied ones."""
        if sq.live:
            raise RuntimeError(f"broken invariant: retiring {sq} with live jobs")
        sq.jobs.clear()
        sq.dropped = 0
        self.empty[sq] = None
        if len(self.empty) > self.empty_max:
            old, _ = self.empty.popitem(last=False)
            self._drop(old)

    def _drop(self, sq: SubQueue) -> None:
        key = (sq.route, sq.priority)
        if self.by_key.get(key) is sq:
            del self.by_key[key]
        sq.dest.subqueues.pop(sq, None)
        self.forget(sq)

    def __iter__(self) -> Iterator[SubQueue]:
        return iter(self.by_key.values())

    def __len__(self) -> int:
        return len(self.by_key)
