"""The active queue: which delivery goes next, from which source IP, and when.

SUMMARY
    sched = Scheduler(Settings.from_config(cfg), policy, suspensions)
    commands = sched.handle(event, now)      # or handle_all(events, now)
    at = sched.next_wakeup()                 # sleep until then, or an event

DESCRIPTION
    A sans-IO core: it never reads the clock, touches a socket or a file.
    The runtime feeds it events with the current time and carries out the
    commands it returns (events.py lists both).  Memory is bounded: the
    scheduler asks for at most ``maxmemoryqueue`` recipients (Refill) and
    holds only those, whatever the backlog on disk.

    Delivery jobs wait in virtual *sub-queues*, one per distinct Route and
    priority (every field a policy or a suspension can name is in the
    Route, so all jobs of a sub-queue are held by exactly the same limits).

STRATEGIES
    Bounded active queue (Postfix, Mailismus).  Refill asks the store for
    room's worth of entries, alternating incoming and due deferred with at
    least quota_deferred percent deferred; new mail therefore goes first
    when it arrives faster than it leaves, delayed mail fills the rest.

    Round robin (Postfix fairness).  Ready sub-queues take turns, one
    delivery each; priority 1 sub-queues are all served before priority 0.
    FIFO inside a sub-queue.

    Parking, not scanning.  A sub-queue whose head cannot go is parked on
    the thing that holds it (a counter entry over its concurrency, rate or
    connect interval, a suspension, a full destination window) and is not
    looked at again until that thing can let one more through: a delivery
    finishing, a rate window passing, an interval elapsing, a suspension
    lifted or expiring.  A blocker with n free slots wakes at most n of its
    waiters, oldest first, and a woken sub-queue that finds its slot taken
    keeps its place in line.  Pickup cost therefore does not depend on the
    number of queued jobs or parked sub-queues.

    Private counting.  A counter entry that only one sub-queue uses, from
    one source IP, is counted together with the sub-queue's other private
    entries (_Private): one in-flight count, one list of pickup times, and
    their tightest limits checked at once.  A second user makes it shared,
    with its own counts.  Thresholds nothing can reach (a concurrency at or
    above max_deliveries, or a global counter's) are not tracked at all.

    Source IP pools (Halon).  A job may use any of its route's source IPs;
    the IPs are tried in turn from where the sub-queue's last pickup left
    off, and a suspended IP is skipped.

    Leaky bucket (rate).  A rate "X/Y" keeps the times of the entry's
    last X pickups; one more is allowed when the oldest is Y seconds old,
    so no Y-second window ever holds more than X pickups.

    Slow start (Postfix).  Per destination, the concurrency window starts
    at initial_destination_concurrency and grows by 1/window per delivery
    whose session worked, up to the policy's limit for that destination;
    a connection failure lowers it by 1/window (by one per failed
    pseudo-cohort, not to the current concurrency minus one, so one
    failure among many does not stop a destination).

    Destination status cache (Postfix).  When failures since the last
    success add up to destination_concurrency_failed_cohort_limit whole
    cohorts, the destination is dead for dead_destination_ttl: its queued
    jobs are deferred at once (DeferJob, 4.4.1) without a connection
    attempt, and so are new ones, until the entry expires.  The cache
    holds at most destination_cache_size idle destinations.

INVARIANTS
    In flight per counter entry <= its concurrency; pickups of an entry in
    any window of Y seconds <= X; no parked sub-queue whose blocker has
    room unless it has been woken; time never goes backwards (handle()
    raises ValueError, and the state is unchanged).

LIMITATIONS
    connectinterval spaces pickups, each of which may open a connection; a
    runtime that reuses a connection still waits for the interval.  Rate
    windows are kept per entry as the last X pickup times: memory grows
    with X.  Counter entries with no threshold, or none reachable, are not
    tracked (the views do not list them).  A reload starts new counters'
    rate windows empty.  A pickup checks every shared entry of its
    sub-queue one by one: its cost grows with the counters over shared
    fields, not with the number of sub-queues or jobs.

SEE ALSO
    sluice.scheduler.policy, sluice.scheduler.events, docs/scheduler.md,
    seeds/001, seeds/003, seeds/004.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from sluice.model import Reply, TempFail
from sluice.scheduler.events import (
    ClockTicked,
    Command,
    ConditionAdded,
    ConditionRemoved,
    DeferJob,
    DeliveryFinished,
    DeliveryJob,
    EntriesClaimed,
    EntriesModified,
    Event,
    JobsQueued,
    MailArrived,
    PolicyReloaded,
    Refill,
    Route,
    StartDelivery,
    SuspensionAdded,
    SuspensionRemoved,
)
from sluice.scheduler.explanation import Explanation, Reason, Waiting, format_at
from sluice.scheduler.policy import (
    CASELESS_FIELDS,
    Condition,
    Counter,
    Pattern,
    Policy,
    Suspension,
    Thresholds,
)
from sluice.scheduler.views import (
    CounterView,
    DestinationView,
    QueueStats,
    SubQueueView,
    SuspensionView,
)

__all__ = ["Scheduler", "Settings"]

_BIG = 1 << 60
_NEVER = math.inf

# Timer kinds, in the heap as (at, seq, kind, object).
_T_ENTRY = 0  # a rate window or connect interval frees a counter entry
_T_SUSPENSION = 1  # a suspension expires
_T_DEAD = 2  # a dead destination comes back
_T_CONDITION = 3  # a run-time condition expires

DEAD_REPLY = Reply(451, "4.4.1", "destination not responding; delivery temporarily suspended")


class _SchedulerSection(Protocol):
    @property
    def initial_destination_concurrency(self) -> int: ...
    @property
    def default_destination_concurrency_limit(self) -> int: ...
    @property
    def destination_concurrency_failed_cohort_limit(self) -> int: ...
    @property
    def dead_destination_ttl(self) -> float: ...
    @property
    def destination_cache_size(self) -> int: ...
    @property
    def refill_interval(self) -> float: ...


@dataclass(frozen=True, slots=True)
class Settings:
    """The scheduler's knobs, with the specification's names and defaults."""

    maxmemoryqueue: int = 10000
    quota_deferred: int = 10
    max_deliveries: int = 200
    initial_destination_concurrency: int = 2
    default_destination_concurrency_limit: int = 20
    destination_concurrency_failed_cohort_limit: int = 1
    dead_destination_ttl_s: float = 300.0
    destination_cache_size: int = 10000
    refill_interval_s: float = 1.0
    refill_batch: int = 1000

    def __post_init__(self) -> None:
        if self.maxmemoryqueue < 1 or self.max_deliveries < 1 or self.refill_batch < 1:
            raise ValueError("maxmemoryqueue, max_deliveries and refill_batch must be >= 1")
        if self.initial_destination_concurrency < 1:
            raise ValueError("initial_destination_concurrency must be >= 1")
        if not 0 <= self.quota_deferred <= 100:
            raise ValueError("quota_deferred is a percentage")

    @classmethod
    def from_config(cls, config: Any) -> Settings:
        """From a sluice.config.Config (duck-typed: this module imports no config)."""
        sched: _SchedulerSection = config.scheduler
        return cls(
            maxmemoryqueue=config.queue.maxmemoryqueue,
            quota_deferred=config.queue.quota_deferred,
            max_deliveries=getattr(sched, "max_deliveries", 0) or config.delivery.max_connections,
            initial_destination_concurrency=sched.initial_destination_concurrency,
            default_destination_concurrency_limit=sched.default_destination_concurrency_limit,
            destination_concurrency_failed_cohort_limit=(
                sched.destination_concurrency_failed_cohort_limit),
            dead_destination_ttl_s=sched.dead_destination_ttl,
            destination_cache_size=sched.destination_cache_size,
            refill_interval_s=sched.refill_interval,
            refill_batch=getattr(sched, "refill_batch", 1000),
        )


# --------------------------------------------------------------------------
# Blockers: things a sub-queue can be parked on.


_Line = OrderedDict["_SubQueue", None]

#: Shared by every blocker that never had a waiter (most of them): reading
#: it is safe, and _park gives a blocker its own lines before the first write.
_NO_WAITERS: tuple[_Line, _Line] = (OrderedDict(), OrderedDict())


class _Blocker:
    """Something that can hold sub-queues; it keeps them in line, per priority."""

    __slots__ = ("pending", "timer_at", "waiters")

    def __init__(self) -> None:
        # waiters[p]: parked sub-queues of priority p, oldest first.
        self.waiters: tuple[_Line, _Line] = _NO_WAITERS
        self.pending = 0  # woken, not yet looked at
        self.timer_at: float | None = None

    def free(self, now: float) -> int:
        raise NotImplementedError

    def free_at(self, now: float) -> float | None:
        """When a timed limit lets one more through; None = an event will."""
        return None


class _NoLog(deque[float]):
    """The pickup times of every entry that keeps none of its own."""

    def append(self, value: float) -> None:
        raise RuntimeError("broken invariant: a pickup logged in an entry without a log")


_NO_LOG: deque[float] = _NoLog()


class _Entry(_Blocker):
    """One counter entry: the counter's fields with one combination of values.

    While only one sub-queue (from one source IP) uses it, an entry is
    *private* (``priv`` set): its in-flight count, pickup times and last
    pickup are that sub-queue's, kept once in the _Private they share, so
    that a pickup does not touch it at all.
    """

    # The fields a pickup reads come first: with a hundred thousand
    # sub-queues an entry is rarely in the CPU cache, and one line is
    # cheaper than three.
    __slots__ = (  # noqa: RUF023
        "conc",
        "inflight",
        "timed",
        "refs",
        "rate_n",
        "log",
        "rate_s",
        "interval",
        "last_at",
        "priv",
        "counter",
        "key",
        "thresholds",
        "condition",
    )

    def __init__(self, counter: _CCounter, key: tuple[str, ...], thresholds: Thresholds,
                 condition: Condition | None) -> None:
        super().__init__()
        self.counter = counter
        self.key = key
        self.inflight = 0
        self.refs = 0  # sub-queue references (one per source IP that uses it)
        # Its own pickup times, once it is shared and has a rate (an empty
        # deque costs half a kilobyte, and most entries never need one).
        self.log: deque[float] = _NO_LOG
        self.last_at = -_NEVER
        self.priv: _Private | None = None
        self.set_thresholds(thresholds, condition)

    def set_thresholds(self, thresholds: Thresholds, condition: Condition | None) -> None:
        self.thresholds = thresholds
        self.condition = condition
        self.conc = thresholds.concurrency
        self.rate_n = thresholds.rate.count if thresholds.rate is not None else None
        self.rate_s = thresholds.rate.per_s if thresholds.rate is not None else 1.0
        self.interval = thresholds.connectinterval_s or None
        self.timed = self.rate_n is not None or self.interval is not None

    def state(self, now: float) -> tuple[int, deque[float], float]:
        """In flight, pickup times (oldest first), last pickup: its own or its
        sub-queue's.  Its own pickup times are pruned to its window."""
        pv = self.priv
        if pv is not None:
            pv.prune(now)
            return pv.inflight, pv.log, pv.last_at
        if self.rate_n is not None:
            # "log[0] + rate_s <= now", not "log[0] <= now - rate_s": the
            # same sum free_at() gives the timer, so that the timer's time
            # always finds the slot free (floats do not round both alike).
            log = self.log
            per = self.rate_s
            while log and log[0] + per <= now:
                log.popleft()
        return self.inflight, self.log, self.last_at

    def holds(self, now: float) -> bool:
        """Whether a shared entry holds the next delivery back: the pickup's
        check, cheap in the common case (a log shorter than the rate cannot
        be full, whatever its times: it never grows past the rate)."""
        conc = self.conc
        if conc is not None and self.inflight >= conc:
            return True
        n = self.rate_n
        if n is not None and len(self.log) >= n and self.free(now) <= 0:
            return True
        interval = self.interval
        return interval is not None and now < self.last_at + interval

    def rate_full(self, log: deque[float], now: float) -> bool:
        n = self.rate_n
        return n is not None and (n == 0 or (len(log) >= n and log[-n] + self.rate_s > now))

    def free(self, now: float) -> int:
        inflight, log, last_at = self.state(now)
        free = _BIG
        if self.conc is not None:
            free = self.conc - inflight
        if self.rate_n is not None:
            if self.rate_full(log, now):
                free = 0
            elif self.priv is None:
                free = min(free, self.rate_n - len(log))
            else:
                free = min(free, 1)  # a private entry has one sub-queue to wake
        if self.interval is not None and now < last_at + self.interval and free > 0:
            free = 0
        return free

    def free_at(self, now: float) -> float | None:
        inflight, log, last_at = self.state(now)
        if self.conc is not None and inflight >= self.conc:
            return None  # a finishing delivery will say
        at = now
        if self.rate_n is not None:
            n = self.rate_n
            if n == 0:
                return None
            if len(log) >= n:
                at = max(at, log[-n] + self.rate_s)
        if self.interval is not None:
            at = max(at, last_at + self.interval)
        return at if at > now else None

    def blocking_kind(self, now: float) -> Waiting | None:
        inflight, log, last_at = self.state(now)
        if self.conc is not None and inflight >= self.conc:
            return Waiting.CONCURRENCY
        if self.rate_full(log, now):
            return Waiting.RATE
        if self.interval is not None and now < last_at + self.interval:
            return Waiting.CONNECTINTERVAL
        return None

    def rate_used(self, now: float) -> int:
        _, log, _ = self.state(now)
        return sum(1 for t in log if t + self.rate_s > now)

    def keep_until(self) -> float:
        """Until when an idle entry must be remembered (its windows)."""
        at = -_NEVER
        if self.rate_n is not None and self.log:
            at = self.log[-1] + self.rate_s
        if self.interval is not None:
            at = max(at, self.last_at + self.interval)
        return at


class _Private:
    """The private entries of one sub-queue from one source IP, counted once.

    Every delivery of the sub-queue from that IP counts in all of them, so
    they share one in-flight count, one list of pickup times and one last
    pickup; a pickup checks their tightest limits here instead of each.
    """

    __slots__ = ("conc", "conc_entry", "entries", "inflight", "interval",
                 "interval_entry", "ip", "last_at", "log", "max_s", "min_n", "rates", "sq")

    def __init__(self, sq: _SubQueue, ip: int, entries: list[_Entry]) -> None:
        self.sq = sq
        self.ip = ip
        self.entries = entries
        self.inflight = 0
        self.log: deque[float] = deque()
        self.last_at = -_NEVER
        self.refresh()

    def refresh(self) -> None:
        self.conc: int | None = None
        self.conc_entry: _Entry | None = None
        self.interval: float | None = None
        self.interval_entry: _Entry | None = None
        rates: list[tuple[int, float, _Entry]] = []
        for entry in self.entries:
            if entry.conc is not None and (self.conc is None or entry.conc < self.conc):
                self.conc, self.conc_entry = entry.conc, entry
            if entry.rate_n is not None:
                rates.append((entry.rate_n, entry.rate_s, entry))
            if entry.interval is not None and (self.interval is None
                                               or entry.interval > self.interval):
                self.interval, self.interval_entry = entry.interval, entry
        self.rates = tuple(rates)
        self.max_s = max((per for _, per, _ in rates), default=0.0)
        # Fewer pickups logged than the smallest rate allows: none is full.
        self.min_n = min((n for n, _, _ in rates), default=0)

    def prune(self, now: float) -> None:
        log = self.log
        per = self.max_s
        while log and log[0] + per <= now:
            log.popleft()

    def blocker(self, now: float) -> _Entry | None:
        """The first private entry that holds the next delivery, if any."""
        if self.conc is not None and self.inflight >= self.conc:
            return self.conc_entry
        if self.rates and len(self.log) >= self.min_n:
            self.prune(now)
            log = self.log
            for n, per, entry in self.rates:
                if n == 0 or (len(log) >= n and log[-n] + per > now):
                    return entry
        if self.interval is not None and now < self.last_at + self.interval:
            return self.interval_entry
        return None


class _Susp(_Blocker):
    __slots__ = ("from_file", "lifted", "suspension")

    def __init__(self, suspension: Suspension, from_file: bool) -> None:
        super().__init__()
        self.suspension = suspension
        self.from_file = from_file
        self.lifted = False

    def free(self, now: float) -> int:
        return _BIG if self.lifted else 0


class _Dest(_Blocker):
    """Slow start and the status cache of one destination (next hop)."""

    __slots__ = (
        "cap",
        "dead_until",
        "delivered",
        "fail_cohorts",
        "failed",
        "inflight",
        "ip_limits",
        "last_reply",
        "limit",
        "name",
        "subqueues",
        "window",
    )

    def __init__(self, name: str, window: float, cap: int) -> None:
        super().__init__()
        self.name = name
        self.window = window  # slow start's progress
        self.cap = cap  # the policy's limit for the destination
        self.limit = min(int(window), cap)  # what is enforced: the smaller
        # Per source IP, the tightest concurrency a destination counter sets.
        self.ip_limits: dict[str, int] = {}
        self.inflight = 0
        self.dead_until = -_NEVER
        self.fail_cohorts = 0.0
        self.last_reply: Reply | None = None
        self.subqueues: set[_SubQueue] = set()
        self.delivered = 0
        self.failed = 0

    def free(self, now: float) -> int:
        return self.limit - self.inflight

    def set_window(self, window: float) -> None:
        self.window = window
        self.limit = min(int(window), self.cap)

    def set_cap(self, cap: int) -> None:
        self.cap = cap
        self.limit = min(int(self.window), cap)


# --------------------------------------------------------------------------
# Sub-queues, jobs, deliveries in flight.


class _SubQueue:
    __slots__ = ("checks", "counted", "dest", "dropped", "entries", "in_ring", "ips", "jobs",
                 "live", "parked_on", "priority", "priv", "route", "rr", "susp", "susp_version",
                 "timed", "version", "woken_by")

    def __init__(self, route: Route, priority: int, dest: _Dest) -> None:
        self.route = route
        self.priority = priority
        self.dest = dest
        self.jobs: deque[_Job] = deque()
        self.live = 0
        self.dropped = 0
        self.ips: tuple[str, ...] = route.localip or ("",)
        # Per source IP: every tracked entry; the shared ones to check, to
        # count in flight, to log pickups in; and the private ones, together.
        self.entries: list[tuple[_Entry, ...]] = []
        self.checks: list[tuple[_Entry, ...]] = []
        self.counted: list[tuple[_Entry, ...]] = []
        self.timed: list[tuple[_Entry, ...]] = []
        self.priv: list[_Private | None] = []
        self.version = -1
        self.susp: list[_Susp | None] = []
        self.susp_version = -1
        self.parked_on: tuple[_Blocker, ...] = ()
        self.in_ring = False
        self.woken_by: _Blocker | None = None
        self.rr = 0


class _Job:
    __slots__ = ("dropped", "job", "qids", "queued_at", "sq")

    def __init__(self, job: DeliveryJob, sq: _SubQueue, now: float) -> None:
        self.job = job
        self.qids = job.qids
        self.sq = sq
        self.dropped = False
        self.queued_at = now


class _Flight:
    __slots__ = ("dest", "entries", "extra", "ip", "job", "priv", "qids", "started_at")

    def __init__(self, job: DeliveryJob, qids: tuple[str, ...], ip: str,
                 entries: tuple[_Entry, ...], priv: _Private | None, dest: _Dest,
                 now: float) -> None:
        self.job = job
        self.qids = qids
        self.ip = ip
        self.entries = entries  # shared entries it counts in
        self.priv = priv  # and the private ones, through their sub-queue
        self.extra: list[_Entry] = []  # private when it started, shared since
        self.dest = dest
        self.started_at = now


class _CCounter:
    """A policy counter, compiled: key building with a memo of group lookups."""

    __slots__ = ("counter", "dest", "id", "matchers", "memo", "names", "sig", "specs")

    _MEMO_MAX = 100_000

    def __init__(self, counter: Counter) -> None:
        self.counter = counter
        self.id = counter.id
        self.sig = counter.signature
        self.names = counter.field_names
        self.specs = tuple((f.name, f if f.groups else None) for f in counter.fields)
        self.memo: dict[tuple[str, str], str] = {}
        self.dest = counter.limits_destination
        self.matchers = tuple((c, _compile_match(c, self.names)) for c in counter.conditions)

    def key(self, route: Route, ip: str) -> tuple[str, ...]:
        parts: list[str] = []
        for name, spec in self.specs:
            raw = ip if name == "localip" else getattr(route, name)
            if spec is not None:
                memo_key = (name, raw)
                value = self.memo.get(memo_key)
                if value is None:
                    if len(self.memo) >= self._MEMO_MAX:
                        self.memo.clear()
                    value = spec.component(raw)
                    self.memo[memo_key] = value
                raw = value
            parts.append(raw)
        return tuple(parts)

    def thresholds(self, key: tuple[str, ...]) -> tuple[Thresholds, Condition | None]:
        for cond, matcher in self.matchers:
            for pos, want in matcher:
                have = key[pos]
                if isinstance(want, Pattern):
                    if not want.matches(have):
                        break
                elif have != want:
                    break
            else:
                return cond.thresholds, cond
        return self.counter.default, None


def _compile_match(cond: Condition, names: Sequence[str]
                   ) -> tuple[tuple[int, str | Pattern], ...]:
    out: list[tuple[int, str | Pattern]] = []
    for name, value in cond.match:
        pos = list(names).index(name)
        if Pattern.is_pattern(value):
            out.append((pos, Pattern.compile(value)))
        elif value.startswith("#") or name not in CASELESS_FIELDS:
            out.append((pos, value))
        else:
            out.append((pos, value.lower()))
    return tuple(out)


# --------------------------------------------------------------------------


class Scheduler:
    """The active queue's decisions; see the module docstring."""

    def __init__(self, settings: Settings | None = None, policy: Policy | None = None,
                 suspensions: Iterable[Suspension] = (), now: float = 0.0) -> None:
        self.settings = settings or Settings()
        self._now = now
        self._seq = 0
        self._timers: list[tuple[float, int, int, Any]] = []
        self._gc: list[tuple[float, int, _Entry]] = []
        # Policy.
        self._policy = Policy()
        self._ccounters: tuple[_CCounter, ...] = ()
        self._max_inflight = self.settings.max_deliveries
        self._version = 0
        self._entries: dict[tuple[str, str, tuple[str, ...]], _Entry] = {}
        self._reuse: dict[tuple[str, str, tuple[str, ...]], _Entry] = {}
        self._fresh: set[_Entry] | None = None  # entries created by the current _resolve
        # Suspensions: by id, and indexed by the fields they name.
        self._susps: dict[str, _Susp] = {}
        self._susp_index: dict[tuple[str, ...], dict[tuple[str, ...], _Susp]] = {}
        self._susp_version = 0
        # Destinations with a sub-queue, a delivery in flight, or a dead mark.
        self._dests: dict[str, _Dest] = {}
        # Sub-queues and the rings of ready ones: [priority] -> woken first, then ring.
        self._subqueues: dict[tuple[Route, int], _SubQueue] = {}
        # Sub-queues that ran empty stay (resolved) for a while, least
        # recently used first: a destination with a trickle of mail does not
        # pay for its counters each time.  Bounded by the settings (as many
        # as the queue can hold jobs, plus the destination cache), never by
        # the backlog.
        self._empty: OrderedDict[_SubQueue, None] = OrderedDict()
        self._empty_max = self.settings.destination_cache_size + self.settings.maxmemoryqueue
        self._woken: tuple[deque[_SubQueue], deque[_SubQueue]] = (deque(), deque())
        self._ring: tuple[deque[_SubQueue], deque[_SubQueue]] = (deque(), deque())
        # Jobs and deliveries.
        self._qids: dict[str, _Job | _Flight] = {}
        self._flights: dict[str, _Flight] = {}
        # Memory accounting, in recipients.
        self._claim_pending = 0
        self._routing = 0
        self._queued_n = 0
        self._inflight_entries = 0
        self._store_ready_at = -_NEVER
        # Statistics.
        self.pickups = 0
        self._set_policy(policy or Policy(), now)
        for susp in suspensions:
            self._add_suspension(susp, now, from_file=False)

    # ------------------------------------------------------------------ API

    @property
    def policy(self) -> Policy:
        return self._policy

    @property
    def now(self) -> float:
        return self._now

    @property
    def memory_used(self) -> int:
        """Recipients held or asked for (claimed, routing, queued, in flight)."""
        return self._memory_used()

    def check(self, event: Event) -> None:
        """Raise ValueError if ``event`` would be refused, changing nothing.

        For callers that accept operator changes (an API) and want to answer
        a bad request at once, before posting the event to the loop.
        """
        self._check(event)

    def handle(self, event: Event, now: float) -> list[Command]:
        """Take one event at ``now``; return what to do."""
        return self.handle_all((event,), now)

    def tick(self, now: float) -> list[Command]:
        """Time passed (the runtime woke at next_wakeup())."""
        return self.handle_all((ClockTicked(),), now)

    def handle_all(self, events: Iterable[Event], now: float) -> list[Command]:
        """Take several events that happened by ``now``, then decide once."""
        if now < self._now:
            raise ValueError(f"time went backwards: {now} < {self._now}")
        events = tuple(events)
        finished: set[str] = set()
        flights = self._flights
        for event in events:
            if type(event) is DeliveryFinished:  # the common case, kept cheap
                flight = flights.get(event.ref)
                if flight is None or event.ref in finished:
                    raise ValueError(f"no delivery {event.ref} in flight")
                if event.localip and event.localip != flight.ip:
                    raise ValueError(f"delivery {event.ref} was started from {flight.ip!r}, "
                                     f"not {event.localip!r}")
                finished.add(event.ref)
            else:
                self._check(event)
        self._now = now
        out: list[Command] = []
        self._fire_timers(now, out)
        for event in events:
            if type(event) is DeliveryFinished:
                self._finish(event, now, out)
            else:
                self._dispatch(event, now, out)
        self._select(now, out)
        self._maybe_refill(now, out)
        self._collect(now)
        return out

    def next_wakeup(self) -> float | None:
        """When the scheduler next needs handle()/tick() if nothing else happens."""
        timers = self._timers
        while timers:
            at, _, kind, obj = timers[0]
            if self._timer_live(at, kind, obj):
                break
            heapq.heappop(timers)
        at_timer = timers[0][0] if timers else None
        at_refill = self._refill_at()
        if at_timer is None:
            return at_refill
        if at_refill is None:
            return at_timer
        return min(at_timer, at_refill)

    # ------------------------------------------------------------ dispatch

    def _check(self, event: Event) -> None:
        """Refuse misuse before anything changes (so state stays whole)."""
        match event:
            case JobsQueued(jobs=jobs):
                seen: set[str] = set()
                refs: set[str] = set()
                for job in jobs:
                    if job.ref in self._flights or job.ref in refs:
                        raise ValueError(f"job {job.ref} is already known")
                    refs.add(job.ref)
                    for qid in job.qids:
                        if qid in self._qids or qid in seen:
                            raise ValueError(f"recipient {qid} is queued twice")
                        seen.add(qid)
            case EntriesClaimed(count=count):
                if count < 0 or count > self._claim_pending:
                    raise ValueError(f"claimed {count} entries, {self._claim_pending} asked for")
            case ConditionAdded(counter_id=cid, condition=cond):
                try:
                    counter = self._policy.counter(cid)
                except KeyError:
                    raise ValueError(f"no counter {cid!r} in the policy") from None
                for name, _ in cond.match:
                    if name not in counter.field_names:
                        raise ValueError(f"counter {cid} does not count {name!r}")
            case ConditionRemoved(counter_id=cid, condition_id=cond_id):
                if cid not in {c.id for c in self._policy.counters}:
                    raise ValueError(f"no counter {cid!r} in the policy")
                if not cond_id:
                    # "" would match every condition that has no id of its own.
                    raise ValueError("name the condition to remove by its id")
            case SuspensionAdded(suspension=susp):
                known = self._susps.get(susp.id)
                same = self._susp_index.get(susp.field_names, {}).get(susp.values)
                if known is not None and known is not same:
                    raise ValueError(f"a suspension with id {susp.id!r} exists with other fields")
            case _:
                pass

    def _dispatch(self, event: Event, now: float, out: list[Command]) -> None:
        match event:
            case JobsQueued(jobs=jobs, unrouted=unrouted):
                # Jobs queued without a Refill (tests, a simulator) count too.
                routed = sum(len(job.qids) for job in jobs)
                self._routing = max(0, self._routing - unrouted - routed)
                for job in jobs:
                    self._enqueue(job, now, out)
            case EntriesClaimed(count=count, exhausted=exhausted, next_due_at=due):
                self._claim_pending = 0
                self._routing += count
                if exhausted:
                    ready = now + self.settings.refill_interval_s
                    if due is not None and due > ready:
                        ready = due
                    self._store_ready_at = ready
                else:
                    self._store_ready_at = now
            case MailArrived():
                self._store_ready_at = now
            case EntriesModified(qids=qids):
                self._modified(qids)
                self._store_ready_at = now
            case PolicyReloaded(policy=policy):
                self._set_policy(policy, now)
            case ConditionAdded(counter_id=cid, condition=cond, position=pos):
                self._edit_conditions(cid, now, add=cond, position=pos)
            case ConditionRemoved(counter_id=cid, condition_id=cond_id):
                self._edit_conditions(cid, now, remove=cond_id)
            case SuspensionAdded(suspension=susp):
                self._add_suspension(susp, now, from_file=False)
            case SuspensionRemoved(suspension_id=sid):
                self._remove_suspension(sid, now)
            case ClockTicked():
                pass

    # ------------------------------------------------------------- timers

    def _schedule(self, at: float, kind: int, obj: Any) -> None:
        self._seq += 1
        heapq.heappush(self._timers, (at, self._seq, kind, obj))

    def _schedule_blocker(self, blocker: _Blocker, at: float) -> None:
        if blocker.timer_at is None or at < blocker.timer_at:
            blocker.timer_at = at
            self._schedule(at, _T_ENTRY, blocker)

    def _timer_live(self, at: float, kind: int, obj: Any) -> bool:
        if kind == _T_ENTRY:
            return bool(obj.timer_at == at)
        if kind == _T_SUSPENSION:
            susp: _Susp = obj
            return (not susp.lifted and self._susps.get(susp.suspension.id) is susp
                    and susp.suspension.expires_at == at)
        if kind == _T_DEAD:
            return bool(obj.dead_until == at)
        return True

    def _fire_timers(self, now: float, out: list[Command]) -> None:
        timers = self._timers
        while timers and timers[0][0] <= now:
            at, _, kind, obj = heapq.heappop(timers)
            if not self._timer_live(at, kind, obj):
                continue
            if kind == _T_ENTRY:
                obj.timer_at = None
                self._release(obj, now)
            elif kind == _T_SUSPENSION:
                self._remove_suspension(obj.suspension.id, now)
            elif kind == _T_DEAD:
                self._revive(obj)
            elif kind == _T_CONDITION:
                counter_id, cond_id = obj
                self._expire_condition(counter_id, cond_id, now)

    # ------------------------------------------------------------- refill

    def _memory_used(self) -> int:
        return self._claim_pending + self._routing + self._queued_n + self._inflight_entries

    def _refill_threshold(self) -> int:
        s = self.settings
        return max(1, min(s.refill_batch, s.maxmemoryqueue) // 4)

    def _refill_at(self) -> float | None:
        if self._claim_pending:
            return None
        room = self.settings.maxmemoryqueue - self._memory_used()
        if room <= 0:
            return None
        if room < self._refill_threshold() and self._memory_used() > 0:
            return None
        return max(self._store_ready_at, self._now)

    def _maybe_refill(self, now: float, out: list[Command]) -> None:
        at = self._refill_at()
        if at is None or at > now:
            return
        room = self.settings.maxmemoryqueue - self._memory_used()
        limit = min(room, self.settings.refill_batch)
        self._claim_pending = limit
        out.append(Refill(limit, self.settings.quota_deferred))

    # ----------------------------------------------------------- policies

    def _compile(self, policy: Policy) -> None:
        self._policy = policy
        self._ccounters = tuple(_CCounter(c) for c in policy.counters)
        limit = self.settings.max_deliveries
        for counter in policy.counters:
            if not counter.fields and counter.default.concurrency is not None:
                limit = min(limit, counter.default.concurrency)
        self._max_inflight = limit

    def _set_policy(self, policy: Policy, now: float) -> None:
        self._compile(policy)
        # Suspensions from the file replace the file's old ones; run-time ones stay.
        file_ids = {s.id for s in policy.suspensions}
        for sid, blocker in list(self._susps.items()):
            if blocker.from_file and sid not in file_ids:
                self._remove_suspension(sid, now)
        for susp in policy.suspensions:
            self._add_suspension(susp, now, from_file=True)
        for counter in policy.counters:
            for cond in counter.conditions:
                if cond.expires_at is not None:
                    self._schedule(cond.expires_at, _T_CONDITION, (counter.id, cond.id))
        self._rebuild()

    def _edit_conditions(self, counter_id: str, now: float, add: Condition | None = None,
                         position: int = 0, remove: str | None = None) -> None:
        counters = list(self._policy.counters)
        for i, counter in enumerate(counters):
            if counter.id != counter_id:
                continue
            conditions = list(counter.conditions)
            if add is not None:
                if not add.id:
                    n = len(conditions) + 1
                    taken = {c.id for c in conditions}
                    while f"c{n}" in taken:
                        n += 1
                    add = Condition(add.match, add.thresholds, f"c{n}", add.expires_at,
                                    add.tag, add.reason)
                conditions = [c for c in conditions if not (add.id and c.id == add.id)]
                conditions.insert(max(0, min(position, len(conditions))), add)
                if add.expires_at is not None:
                    self._schedule(add.expires_at, _T_CONDITION, (counter_id, add.id))
            if remove is not None:
                conditions = [c for c in conditions if c.id != remove]
            counters[i] = Counter(counter.fields, tuple(conditions), counter.default, counter.id)
        self._compile(Policy(tuple(counters), self._policy.suspensions, self._policy.source))
        self._rebuild()

    def _expire_condition(self, counter_id: str, cond_id: str, now: float) -> None:
        try:
            counter = self._policy.counter(counter_id)
        except KeyError:
            return
        for cond in counter.conditions:
            if cond.id == cond_id and cond.expires_at is not None and cond.expires_at <= now:
                self._edit_conditions(counter_id, now, remove=cond_id)
                return

    def _rebuild(self) -> None:
        """Re-key everything after a policy change; wake every parked sub-queue.

        Entries whose counter (id and fields) survives keep their rate
        windows and intervals; in-flight counts are recounted from the
        deliveries in flight.  O(sub-queues + deliveries): an operator
        action, not a pickup.
        """
        self._version += 1
        self._reuse = self._entries
        self._entries = {}
        for entry in self._reuse.values():
            if entry.priv is not None:
                if entry.rate_n is not None:
                    entry.log = deque(entry.priv.log)
                entry.last_at = entry.priv.last_at
                entry.priv = None
            entry.inflight = 0
            entry.refs = 0
            entry.timer_at = None
            entry.pending = 0
            entry.waiters[0].clear()
            entry.waiters[1].clear()
        for dest in self._dests.values():
            dest.ip_limits.clear()
            dest.set_cap(self.settings.default_destination_concurrency_limit)
            dest.waiters[0].clear()
            dest.waiters[1].clear()
            dest.pending = 0
        for susp in self._susps.values():
            susp.waiters[0].clear()
            susp.waiters[1].clear()
            susp.pending = 0
        for flight in self._flights.values():
            found = self._resolve_ip(flight.job.route, flight.ip)[0]
            flight.entries = tuple(e for e in found if e.conc is not None)
            flight.priv = None
            flight.extra = []
            for entry in flight.entries:
                entry.inflight += 1
        for sq in self._subqueues.values():
            sq.parked_on = ()
            sq.woken_by = None
            self._resolve(sq)
            if sq.live and not sq.in_ring:
                self._ring[sq.priority].append(sq)
                sq.in_ring = True
        for queue in (*self._woken, *self._ring):
            for sq in queue:
                sq.woken_by = None
        for entry in self._reuse.values():
            if entry.refs == 0 and entry.inflight == 0:
                self._forget_later(entry)
        self._reuse = {}

    def _entry(self, cc: _CCounter, key: tuple[str, ...]) -> _Entry | None:
        ident = (cc.id, cc.sig, key)
        entry = self._entries.get(ident)
        if entry is not None:
            return entry
        thresholds, cond = cc.thresholds(key)
        if thresholds.is_empty or self._cannot_bind(thresholds, not cc.names):
            return None
        entry = self._reuse.pop(ident, None)
        if entry is None:
            entry = _Entry(cc, key, thresholds, cond)
            if self._fresh is not None:
                self._fresh.add(entry)
        else:
            entry.counter = cc
            entry.set_thresholds(thresholds, cond)
        self._entries[ident] = entry
        return entry

    def _cannot_bind(self, thresholds: Thresholds, is_global: bool) -> bool:
        """A concurrency no lower than what can ever be in flight (the
        smaller of max_deliveries and a global counter's concurrency), with
        no rate or interval, never holds a delivery back: such entries are
        not tracked, so that a pickup does not pay for them."""
        limit = self.settings.max_deliveries if is_global else self._max_inflight
        return (thresholds.rate is None and not thresholds.connectinterval_s
                and thresholds.concurrency is not None
                and thresholds.concurrency >= limit)

    def _resolve_ip(self, route: Route, ip: str) -> tuple[tuple[_Entry, ...], int]:
        """The tracked entries of ``route`` from ``ip``, and the tightest
        concurrency among the counters that limit the destination (0: none)."""
        found: list[_Entry] = []
        dest_limit = 0
        for cc in self._ccounters:
            key = cc.key(route, ip)
            entry = self._entry(cc, key)
            if entry is not None:
                found.append(entry)
                conc = entry.conc
            elif cc.dest:
                conc = cc.thresholds(key)[0].concurrency  # untracked, but still the policy
            else:
                continue
            if cc.dest and conc is not None:
                dest_limit = conc if not dest_limit else min(dest_limit, conc)
        return tuple(found), dest_limit

    def _resolve(self, sq: _SubQueue) -> None:
        """Look up a sub-queue's counter entries, per source IP.

        Called for a new sub-queue, or by _rebuild after it zeroed every
        reference count, so the old entries are not released here.  Entries
        this call creates, that no other source IP of the sub-queue shares
        and that nothing counts yet, become private to the sub-queue.
        """
        self._fresh = set()
        entries: list[tuple[_Entry, ...]] = []
        limits: list[int] = []
        try:
            for ip in sq.ips:
                found, limit = self._resolve_ip(sq.route, ip)
                entries.append(found)
                limits.append(limit)
            fresh = self._fresh
        finally:
            self._fresh = None
        uses: dict[_Entry, int] = {}
        for found in entries:
            for entry in found:
                uses[entry] = uses.get(entry, 0) + 1
        sq.entries = entries
        sq.priv = []
        sq.checks, sq.counted, sq.timed = [], [], []
        for i, found in enumerate(entries):
            private = [e for e in found
                       if e in fresh and uses[e] == 1 and e.inflight == 0 and e.priv is None]
            for entry in found:
                entry.refs += 1
                if entry.priv is not None and entry.priv.sq is not sq:
                    self._materialize(entry)  # shared from now on
            pv = _Private(sq, i, private) if private else None
            for entry in private:
                entry.priv = pv
            sq.priv.append(pv)
            sq.checks.append(())
            sq.counted.append(())
            sq.timed.append(())
            self._set_lists(sq, i)
        sq.version = self._version
        dest = sq.dest
        changed = False
        for ip, limit in zip(sq.ips, limits, strict=True):
            if limit > dest.ip_limits.get(ip, 0) or ip not in dest.ip_limits:
                dest.ip_limits[ip] = limit
                changed = True
        if changed:
            # The policy's limit for the destination over every source IP that
            # sends to it: "5 per localip and domain" from two IPs allows 10.
            # An IP without such a limit counts as the default limit.
            default = self.settings.default_destination_concurrency_limit
            if any(dest.ip_limits.values()):
                dest.set_cap(sum(v or default for v in dest.ip_limits.values()))
            else:
                dest.set_cap(default)

    @staticmethod
    def _set_lists(sq: _SubQueue, i: int) -> None:
        shared = tuple(e for e in sq.entries[i] if e.priv is None)
        sq.checks[i] = shared
        sq.counted[i] = tuple(e for e in shared if e.conc is not None)
        sq.timed[i] = tuple(e for e in shared if e.timed)
        for entry in sq.timed[i]:
            if entry.rate_n is not None and entry.log is _NO_LOG:
                entry.log = deque()

    def _materialize(self, entry: _Entry) -> None:
        """A private entry becomes shared: it takes its own counts.

        The deliveries of its sub-queue in flight were not counted in it;
        they are now, and each will uncount it when it finishes.
        """
        pv = entry.priv
        if pv is None:
            return
        now = self._now
        entry.inflight = pv.inflight
        if entry.rate_n is not None:
            entry.log = deque(t for t in pv.log if t + entry.rate_s > now)
        entry.last_at = pv.last_at
        if entry.conc is not None and pv.inflight:
            # Rare (a second user, or the sub-queue forgotten with deliveries
            # out): cheaper to look for them than to index every delivery.
            for flight in self._flights.values():
                if flight.priv is pv:
                    flight.extra.append(entry)
        entry.priv = None
        pv.entries.remove(entry)
        pv.refresh()
        sq = pv.sq
        if pv.ip < len(sq.priv) and sq.priv[pv.ip] is pv:
            if not pv.entries:
                sq.priv[pv.ip] = None
            self._set_lists(sq, pv.ip)

    def _dest_cap(self, dest: _Dest) -> int:
        return dest.cap

    # -------------------------------------------------------- suspensions

    def _add_suspension(self, susp: Suspension, now: float, from_file: bool) -> None:
        names, values = susp.field_names, susp.values
        index = self._susp_index.setdefault(names, {})
        old = index.get(values)
        if old is not None:
            # Halon: a matching suspension only gets the new TTL (and tag/reason).
            merged = Suspension(susp.fields, old.suspension.id, susp.expires_at,
                                susp.tag or old.suspension.tag,
                                susp.reason or old.suspension.reason)
            old.suspension = merged
            old.from_file = old.from_file and from_file
            if merged.expires_at is not None:
                self._schedule(merged.expires_at, _T_SUSPENSION, old)
            return
        if susp.id in self._susps:
            raise ValueError(f"a suspension with id {susp.id!r} exists with other fields")
        blocker = _Susp(susp, from_file)
        index[values] = blocker
        self._susps[susp.id] = blocker
        self._susp_version += 1
        if susp.expires_at is not None:
            if susp.expires_at <= now:
                self._remove_suspension(susp.id, now)
                return
            self._schedule(susp.expires_at, _T_SUSPENSION, blocker)

    def _remove_suspension(self, sid: str, now: float) -> None:
        blocker = self._susps.pop(sid, None)
        if blocker is None:
            return
        susp = blocker.suspension
        index = self._susp_index.get(susp.field_names)
        if index is not None:
            index.pop(susp.values, None)
            if not index:
                del self._susp_index[susp.field_names]
        self._susp_version += 1
        blocker.lifted = True
        self._release(blocker, now)

    def _suspensions_for(self, sq: _SubQueue) -> list[_Susp | None]:
        if sq.susp_version != self._susp_version:
            route = sq.route
            found: list[_Susp | None] = []
            for ip in sq.ips:
                hit: _Susp | None = None
                for names, index in self._susp_index.items():
                    key = tuple(ip if n == "localip" else getattr(route, n) for n in names)
                    hit = index.get(key)
                    if hit is not None:
                        break
                found.append(hit)
            sq.susp = found
            sq.susp_version = self._susp_version
        return sq.susp

    # ------------------------------------------------------- destinations

    def _dest(self, name: str) -> _Dest:
        dest = self._dests.get(name)
        if dest is None:
            dest = _Dest(name, float(self.settings.initial_destination_concurrency),
                         self.settings.default_destination_concurrency_limit)
            self._dests[name] = dest
        return dest

    def _forget_dest(self, dest: _Dest) -> None:
        """Forget a destination nothing refers to (unless it is marked dead)."""
        if dest.subqueues or dest.inflight or dest.dead_until > self._now:
            return
        if self._dests.get(dest.name) is dest:
            del self._dests[dest.name]

    def _revive(self, dest: _Dest) -> None:
        """A dead destination's cache entry expired: the next delivery probes it."""
        dest.dead_until = -_NEVER
        dest.fail_cohorts = 0.0
        dest.set_window(float(self.settings.initial_destination_concurrency))
        self._forget_dest(dest)

    def _mark_dead(self, dest: _Dest, now: float, out: list[Command]) -> None:
        dest.dead_until = now + self.settings.dead_destination_ttl_s
        self._schedule(dest.dead_until, _T_DEAD, dest)
        for sq in list(dest.subqueues):
            if sq.live:
                self._defer_subqueue(sq, dest, out)

    def _defer_subqueue(self, sq: _SubQueue, dest: _Dest, out: list[Command]) -> None:
        reply = dest.last_reply or DEAD_REPLY
        for rec in sq.jobs:
            if rec.dropped:
                continue
            out.append(DeferJob(rec.job, rec.qids, reply, dest.dead_until))
            for qid in rec.qids:
                del self._qids[qid]
            self._queued_n -= len(rec.qids)
        sq.live = 0
        self._retire(sq)

    # --------------------------------------------------------- queueing

    def _enqueue(self, job: DeliveryJob, now: float, out: list[Command]) -> None:
        route = job.route
        key = (route, job.priority)
        sq = self._subqueues.get(key)
        if sq is None:
            dest = self._dest(route.destination)
            if dest.dead_until > now:
                out.append(DeferJob(job, job.qids, dest.last_reply or DEAD_REPLY,
                                    dest.dead_until))
                self._forget_dest(dest)
                return
            sq = _SubQueue(route, job.priority, dest)
            self._resolve(sq)
            self._subqueues[key] = sq
            dest.subqueues.add(sq)
        else:
            dest = sq.dest
            if dest.dead_until > now:
                out.append(DeferJob(job, job.qids, dest.last_reply or DEAD_REPLY,
                                    dest.dead_until))
                return
            if not sq.live:
                self._empty.pop(sq, None)
            if sq.version != self._version:
                self._resolve(sq)
        n = len(job.qids)
        rec = _Job(job, sq, now)
        sq.jobs.append(rec)
        sq.live += 1
        qids = self._qids
        for qid in job.qids:
            qids[qid] = rec
        self._queued_n += n
        if not sq.in_ring and not sq.parked_on:
            self._ring[sq.priority].append(sq)
            sq.in_ring = True

    def _retire(self, sq: _SubQueue) -> None:
        """A sub-queue has no live job: it joins the empty ones."""
        if sq.live:
            raise RuntimeError("retiring a sub-queue with live jobs")
        if sq.parked_on:
            self._unpark(sq)
        if sq.jobs:
            sq.jobs.clear()
        sq.dropped = 0
        empty = self._empty
        empty[sq] = None
        if len(empty) > self._empty_max:
            old, _ = empty.popitem(last=False)
            self._drop_subqueue(old)

    def _drop_subqueue(self, sq: _SubQueue) -> None:
        """Forget an empty sub-queue: its counter entries lose a reference."""
        key = (sq.route, sq.priority)
        if self._subqueues.get(key) is sq:
            del self._subqueues[key]
        # Its deliveries may still be in flight: their private counts become
        # the entries' own before anyone else can find those entries.
        privs, sq.priv = sq.priv, []
        for pv in privs:
            if pv is not None:
                for entry in list(pv.entries):
                    self._materialize(entry)
        for entries in sq.entries:
            for entry in entries:
                entry.refs -= 1
                self._maybe_forget(entry)
        sq.entries = []
        sq.checks, sq.counted, sq.timed = [], [], []
        sq.version = -1
        dest = sq.dest
        dest.subqueues.discard(sq)
        self._forget_dest(dest)

    def _modified(self, qids: Sequence[str]) -> None:
        for qid in qids:
            rec = self._qids.get(qid)
            if not isinstance(rec, _Job):
                continue  # unknown, or in flight: the store lets the operator win
            del self._qids[qid]
            self._queued_n -= 1
            rec.qids = tuple(q for q in rec.qids if q != qid)
            if rec.qids:
                continue
            rec.dropped = True
            sq = rec.sq
            sq.live -= 1
            sq.dropped += 1
            if sq.live == 0:
                self._retire(sq)
            elif sq.dropped > 32 and sq.dropped > sq.live:
                sq.jobs = deque(r for r in sq.jobs if not r.dropped)
                sq.dropped = 0

    # ----------------------------------------------------------- parking

    def _park(self, sq: _SubQueue, blockers: list[_Blocker], woken: _Blocker | None,
              now: float) -> None:
        sq.parked_on = tuple(blockers)
        p = sq.priority
        for blocker in blockers:
            if blocker.waiters is _NO_WAITERS:
                blocker.waiters = (OrderedDict(), OrderedDict())
            waiters = blocker.waiters[p]
            waiters[sq] = None
            if blocker is woken:
                waiters.move_to_end(sq, last=False)  # it keeps its place in line
            at = blocker.free_at(now)
            if at is not None:
                self._schedule_blocker(blocker, at)

    def _unpark(self, sq: _SubQueue) -> None:
        p = sq.priority
        for blocker in sq.parked_on:
            blocker.waiters[p].pop(sq, None)
        sq.parked_on = ()

    def _release(self, blocker: _Blocker, now: float) -> None:
        """Wake as many waiters as ``blocker`` has free slots not yet promised."""
        waiters = blocker.waiters
        if not (waiters[1] or waiters[0]):
            return
        room = blocker.free(now) - blocker.pending
        for p in (1, 0):
            line = waiters[p]
            woken = self._woken[p]
            while room > 0 and line:
                sq, _ = line.popitem(last=False)
                for other in sq.parked_on:
                    if other is not blocker:
                        other.waiters[p].pop(sq, None)
                sq.parked_on = ()
                sq.woken_by = blocker
                blocker.pending += 1
                woken.append(sq)
                sq.in_ring = True
                room -= 1
        if waiters[1] or waiters[0]:
            at = blocker.free_at(now)
            if at is not None:
                self._schedule_blocker(blocker, at)

    # ------------------------------------------------------------ pickup

    def _next_ready(self) -> _SubQueue | None:
        for p in (1, 0):
            if self._woken[p]:
                return self._woken[p].popleft()
            if self._ring[p]:
                return self._ring[p].popleft()
        return None

    def _select(self, now: float, out: list[Command]) -> None:
        limit = self.settings.max_deliveries
        while len(self._flights) < limit:
            sq = self._next_ready()
            if sq is None:
                return
            sq.in_ring = False
            woken = sq.woken_by
            if woken is not None:
                sq.woken_by = None
                woken.pending -= 1
            self._visit(sq, now, out, woken)
            if woken is not None:
                self._release(woken, now)

    def _visit(self, sq: _SubQueue, now: float, out: list[Command],
               woken: _Blocker | None) -> None:
        if sq.dropped:
            jobs = sq.jobs
            while jobs and jobs[0].dropped:
                jobs.popleft()
                sq.dropped -= 1
        if not sq.live or sq.parked_on:
            return  # a stale ring entry: retired, or parked meanwhile
        if sq.version != self._version:
            self._resolve(sq)
        dest = sq.dest
        if dest.dead_until > now:
            self._defer_subqueue(sq, dest, out)
            return
        if dest.inflight >= dest.limit:
            self._park(sq, [dest], woken, now)
            return
        susps = sq.susp if sq.susp_version == self._susp_version else self._suspensions_for(sq)
        n = len(sq.ips)
        if n == 1:
            # The common case, without the bookkeeping of a pool.
            held: _Blocker | None = susps[0]
            if held is None:
                pv = sq.priv[0]
                if pv is not None:
                    held = pv.blocker(now)
                if held is None:
                    for entry in sq.checks[0]:
                        # Entry.holds(), inlined: the loop a pickup spends its time in.
                        conc = entry.conc
                        if conc is not None and entry.inflight >= conc:
                            held = entry
                            break
                        rate_n = entry.rate_n
                        if rate_n is not None and len(entry.log) >= rate_n \
                                and entry.free(now) <= 0:
                            held = entry
                            break
                        interval = entry.interval
                        if interval is not None and now < entry.last_at + interval:
                            held = entry
                            break
                    else:
                        self._start(sq, 0, now, out)
                        self._requeue(sq, woken, now)
                        return
            self._park(sq, [held], woken, now)
            return
        blockers: list[_Blocker] = []
        for k in range(n):
            i = (sq.rr + k) % n
            susp = susps[i]
            if susp is not None:
                if susp not in blockers:
                    blockers.append(susp)
                continue
            pv = sq.priv[i]
            held = pv.blocker(now) if pv is not None else None
            for entry in () if held is not None else sq.checks[i]:
                if entry.holds(now):
                    held = entry
                    break
            if held is not None:
                if held not in blockers:
                    blockers.append(held)
                continue
            sq.rr = (i + 1) % n
            self._start(sq, i, now, out)
            self._requeue(sq, woken, now)
            return
        self._park(sq, blockers, woken, now)

    def _requeue(self, sq: _SubQueue, woken: _Blocker | None, now: float) -> None:
        """After a pickup: the sub-queue goes to the back of the line.

        If a blocker woke it for the slot it just took and has no other
        free slot, that line is the blocker's: looking at the sub-queue
        again now would only find it full.  Not so for a pool of source
        IPs, whose next delivery may leave from another IP (unless the
        blocker is the destination, which all of them share).
        """
        if not sq.live:
            self._retire(sq)
        elif woken is not None and (len(sq.ips) == 1 or woken is sq.dest) \
                and woken.free(now) - woken.pending <= 0:
            self._park(sq, [woken], None, now)
        else:
            self._ring[sq.priority].append(sq)
            sq.in_ring = True

    def _start(self, sq: _SubQueue, i: int, now: float, out: list[Command]) -> None:
        rec = sq.jobs.popleft()
        sq.live -= 1
        ip = sq.ips[i]
        counted = sq.counted[i]
        for entry in counted:
            entry.inflight += 1
        for entry in sq.timed[i]:
            if entry.rate_n is not None:
                entry.log.append(now)
            if entry.interval is not None:
                entry.last_at = now
        dest = sq.dest
        dest.inflight += 1
        job = rec.job
        qids = rec.qids
        pv = sq.priv[i]
        flight = _Flight(job, qids, ip, counted, pv, dest, now)
        if pv is not None:
            pv.inflight += 1
            if pv.rates:
                pv.log.append(now)
            if pv.interval is not None:
                pv.last_at = now
        self._flights[job.ref] = flight
        index = self._qids
        for qid in qids:
            index[qid] = flight
        n = len(qids)
        self._queued_n -= n
        self._inflight_entries += n
        self.pickups += 1
        out.append(StartDelivery(job, ip, qids))

    # ------------------------------------------------------------ results

    def _finish(self, event: DeliveryFinished, now: float, out: list[Command]) -> None:
        flight = self._flights.pop(event.ref)
        index = self._qids
        for qid in flight.qids:
            if index.get(qid) is flight:
                del index[qid]
        self._inflight_entries -= len(flight.qids)
        for entries in (flight.entries, flight.extra):
            for entry in entries:
                entry.inflight -= 1
                if entry.waiters is not _NO_WAITERS:
                    self._release(entry, now)
                if not entry.inflight and not entry.refs:
                    self._forget_later(entry)
        pv = flight.priv
        if pv is not None:
            pv.inflight -= 1
            for blocker in pv.sq.parked_on:
                if isinstance(blocker, _Entry) and blocker.priv is pv:
                    self._release(blocker, now)
        dest = flight.dest
        dest.inflight -= 1
        if event.connection_failed:
            dest.failed += 1
            for _, outcome in event.outcomes:
                if isinstance(outcome, TempFail):
                    dest.last_reply = outcome.reply
                    break
            window = min(dest.window, float(dest.cap))
            dest.fail_cohorts += 1.0 / window
            dest.set_window(max(1.0, window - 1.0 / window))
            if (dest.fail_cohorts >= self.settings.destination_concurrency_failed_cohort_limit
                    and dest.dead_until <= now):
                self._mark_dead(dest, now, out)
        else:
            dest.delivered += 1
            dest.fail_cohorts = 0.0
            dest.last_reply = None
            if dest.dead_until > now:
                self._revive(dest)  # a delivery got through: it is not dead after all
            if dest.window < dest.cap:
                dest.set_window(min(float(dest.cap), dest.window + 1.0 / dest.window))
        if dest.waiters is not _NO_WAITERS:
            self._release(dest, now)
        if not dest.inflight and not dest.subqueues:
            self._forget_dest(dest)

    # ---------------------------------------------------- garbage entries

    def _maybe_forget(self, entry: _Entry) -> None:
        if entry.refs == 0 and entry.inflight == 0:
            self._forget_later(entry)

    def _forget_later(self, entry: _Entry) -> None:
        until = entry.keep_until()
        self._seq += 1
        heapq.heappush(self._gc, (until, self._seq, entry))

    def _collect(self, now: float) -> None:
        gc = self._gc
        while gc and gc[0][0] <= now:
            _, _, entry = heapq.heappop(gc)
            if entry.refs or entry.inflight or entry.keep_until() > now:
                continue
            ident = (entry.counter.id, entry.counter.sig, entry.key)
            if self._entries.get(ident) is entry:
                del self._entries[ident]

    # -------------------------------------------------------------- views

    def stats(self) -> QueueStats:
        """Memory and work in numbers (for /metrics)."""
        return QueueStats(
            memory_used=self._memory_used(),
            maxmemoryqueue=self.settings.maxmemoryqueue,
            claim_pending=self._claim_pending,
            routing=self._routing,
            queued_entries=self._queued_n,
            queued_jobs=sum(sq.live for sq in self._subqueues.values()),
            inflight_entries=self._inflight_entries,
            inflight_jobs=len(self._flights),
            max_deliveries=self.settings.max_deliveries,
            subqueues=sum(1 for sq in self._subqueues.values() if sq.live),
            parked_subqueues=sum(1 for sq in self._subqueues.values() if sq.parked_on),
            counter_entries=len(self._entries),
            destinations=len(self._dests),
            pickups=self.pickups,
        )

    def subqueues(self) -> list[SubQueueView]:
        """Every sub-queue with work: its route, counts, and what holds it."""
        out = []
        for sq in self._subqueues.values():
            if not sq.live:
                continue
            held = tuple(self._blocker_text(b) for b in sq.parked_on)
            out.append(SubQueueView(
                route=sq.route, priority=sq.priority, jobs=sq.live,
                entries=sum(len(r.qids) for r in sq.jobs if not r.dropped),
                parked=bool(sq.parked_on), held_by=held,
            ))
        return out

    def counters(self, now: float | None = None) -> list[CounterView]:
        """Tracked counter entries against their thresholds."""
        now = self._now if now is None else now
        out = []
        for entry in self._entries.values():
            inflight, _, last_at = entry.state(now)
            kind = entry.blocking_kind(now)
            out.append(CounterView(
                counter=entry.counter.id,
                key=tuple(zip(entry.counter.names, entry.key, strict=True)),
                inflight=inflight,
                concurrency=entry.conc,
                rate=str(entry.thresholds.rate) if entry.thresholds.rate else None,
                rate_used=entry.rate_used(now) if entry.rate_n is not None else 0,
                connectinterval_s=entry.interval,
                next_connect_at=(last_at + entry.interval
                                 if entry.interval is not None and last_at > -_NEVER
                                 else None),
                exceeded=kind is not None,
                waiting_subqueues=len(entry.waiters[0]) + len(entry.waiters[1]),
                condition=entry.condition.id if entry.condition is not None else None,
            ))
        return out

    def suspensions(self, now: float | None = None) -> list[SuspensionView]:
        """Manual suspensions with expiry, then automatic ones (entries over threshold)."""
        now = self._now if now is None else now
        out = []
        for blocker in self._susps.values():
            s = blocker.suspension
            out.append(SuspensionView(
                id=s.id, fields=s.fields, automatic=False, expires_at=s.expires_at,
                tag=s.tag, reason=s.reason,
                waiting_subqueues=len(blocker.waiters[0]) + len(blocker.waiters[1]),
                from_file=blocker.from_file,
            ))
        for entry in self._entries.values():
            kind = entry.blocking_kind(now)
            if kind is None:
                continue
            out.append(SuspensionView(
                id=f"{entry.counter.id}:{','.join(entry.key)}",
                fields=tuple(zip(entry.counter.names, entry.key, strict=True)),
                automatic=True, expires_at=entry.free_at(now), tag=str(kind),
                reason=self._entry_text(entry, kind, now),
                waiting_subqueues=len(entry.waiters[0]) + len(entry.waiters[1]),
            ))
        return out

    def destinations(self, now: float | None = None) -> list[DestinationView]:
        """Slow-start windows and the status cache, per destination."""
        now = self._now if now is None else now
        return [self._dest_view(d, now) for d in self._dests.values()]

    def destination(self, name: str, now: float | None = None) -> DestinationView | None:
        """One destination's view, if the scheduler remembers it."""
        dest = self._dests.get(name)
        return None if dest is None else self._dest_view(dest, self._now if now is None else now)

    def _dest_view(self, d: _Dest, now: float) -> DestinationView:
        return DestinationView(
            destination=d.name, window=min(d.window, float(d.cap)), limit=d.cap,
            inflight=d.inflight, dead=d.dead_until > now,
            dead_until_at=d.dead_until if d.dead_until > now else None,
            failed_cohorts=d.fail_cohorts, queued_jobs=sum(sq.live for sq in d.subqueues),
        )

    # ------------------------------------------------------------ explain

    def _entry_text(self, entry: _Entry, kind: Waiting, now: float) -> str:
        key = ", ".join(f"{n}={v or '(default)'}" for n, v in
                        zip(entry.counter.names, entry.key, strict=True)) or "all mail"
        cond = f" (condition {entry.condition.id or 'if ' + str(dict(entry.condition.match))})" \
            if entry.condition is not None else ""
        name = f"counter {entry.counter.id} [{key}]{cond}"
        if kind is Waiting.CONCURRENCY:
            return f"{name}: {entry.state(now)[0]} in flight, concurrency {entry.conc}"
        if kind is Waiting.RATE:
            return (f"{name}: {entry.rate_used(now)} pickups in the last "
                    f"{entry.rate_s:g}s, rate {entry.thresholds.rate}")
        return f"{name}: connectinterval {entry.interval:g}s since the last pickup"

    def _blocker_text(self, blocker: _Blocker) -> str:
        now = self._now
        if isinstance(blocker, _Entry):
            kind = blocker.blocking_kind(now) or Waiting.CONCURRENCY
            return self._entry_text(blocker, kind, now)
        if isinstance(blocker, _Susp):
            return f"suspension {blocker.suspension.id}"
        if isinstance(blocker, _Dest):
            return f"destination {blocker.name}: concurrency window {blocker.limit} full"
        return repr(blocker)

    def explain(self, qid: str, now: float | None = None) -> Explanation:
        """Why ``qid`` waits, and when it is expected to go.

        Every reason is listed (not only the first, which is what the
        sub-queue is parked on), per source IP when the route has a pool.
        """
        now = self._now if now is None else now
        rec = self._qids.get(qid)
        if rec is None:
            return Explanation(qid, "unknown", (Reason(
                Waiting.UNKNOWN, "not in the active queue's memory: it is in the store "
                "(incoming, deferred, held) or being routed"),), None)
        if isinstance(rec, _Flight):
            return Explanation(qid, "delivering", (Reason(
                Waiting.DELIVERING,
                f"being delivered to {rec.dest.name}, started {format_at(rec.started_at, now)}",
                localip=rec.ip),), None)
        sq = rec.sq
        route = sq.route
        dest = sq.dest
        ahead = 0
        for other in sq.jobs:
            if other is rec:
                break
            if not other.dropped:
                ahead += 1
        reasons: list[Reason] = []
        if dest.dead_until > now:
            reasons.append(Reason(
                Waiting.DESTINATION_DEAD,
                f"destination {dest.name} is marked dead until {format_at(dest.dead_until, now)}"
                ": it is deferred without a connection attempt", until_at=dest.dead_until))
            return Explanation(qid, "queued", tuple(reasons), None, ahead)
        # When each source IP can take it: now, a time (timed limits only),
        # or None (it waits for an event nobody can date).
        best: float | None = None
        undated = False
        spacing = 0.0
        susps = self._suspensions_for(sq)
        for i, ip in enumerate(sq.ips):
            shown_ip = ip if route.localip else None
            susp = susps[i]
            at_ip: float | None = now
            if susp is not None:
                s = susp.suspension
                extra = f" ({s.reason})" if s.reason else ""
                until = f" until {format_at(s.expires_at, now)}" if s.expires_at else ""
                reasons.append(Reason(Waiting.SUSPENDED, f"suspended by {s.id}{until}{extra}",
                                      localip=shown_ip, suspension=s.id, until_at=s.expires_at))
                at_ip = s.expires_at
            entries = sq.entries[i] if i < len(sq.entries) else ()
            for entry in entries:
                if entry.rate_n:
                    spacing = max(spacing, entry.rate_s / entry.rate_n)
                if entry.interval:
                    spacing = max(spacing, entry.interval)
                kind = entry.blocking_kind(now)
                if kind is None:
                    continue
                free_at = entry.free_at(now)
                reasons.append(Reason(
                    kind, self._entry_text(entry, kind, now), localip=shown_ip,
                    counter=entry.counter.id,
                    key=tuple(zip(entry.counter.names, entry.key, strict=True)),
                    threshold=str(entry.thresholds), current=str(entry.state(now)[0]),
                    until_at=free_at))
                if free_at is None:
                    at_ip = None
                elif at_ip is not None:
                    at_ip = max(at_ip, free_at)
            if at_ip is None:
                undated = True
            elif best is None or at_ip < best:
                best = at_ip
        if dest.inflight >= dest.limit:
            window = min(dest.window, float(dest.cap))
            reasons.append(Reason(
                Waiting.DESTINATION_WINDOW,
                f"destination {dest.name}: {dest.inflight} in flight fill its concurrency window "
                f"of {window:.2f} (slow start; the policy allows {dest.cap})",
                current=str(dest.inflight), threshold=f"{window:.2f}"))
            best = None
        elif best is not None and best <= now:
            if len(self._flights) >= self.settings.max_deliveries:
                reasons.append(Reason(Waiting.CAPACITY, "the queue manager has max_deliveries "
                                      f"({self.settings.max_deliveries}) in flight"))
                best = None
            elif ahead == 0:
                reasons.append(Reason(Waiting.READY, "nothing holds it: it goes at the next "
                                                     "pickup"))
        if ahead:
            reasons.insert(0, Reason(Waiting.BEHIND, f"{ahead} earlier deliveries of its "
                                                     "sub-queue go first (FIFO)"))
            if best is not None:
                if spacing:
                    best = max(best, now) + ahead * spacing
                elif undated:
                    best = None
        return Explanation(qid, "queued", tuple(reasons), best, ahead)
