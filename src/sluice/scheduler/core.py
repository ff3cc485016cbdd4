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
    number of queued jobs or parked sub-queues.  A line (_Line) is a deque
    of sub-queues: one that leaves it other than at its head (woken by
    another of its blockers, unparked) leaves a stale entry that it counts
    and the line skips, so that waking and parking are a popleft and an
    append.

    Counting in groups.  Counters over the same fields (a _Table) key a
    delivery alike: their entries for one key are one _Row.  Rows that
    exactly the same source IPs of sub-queues use are counted by exactly
    the same deliveries, so they are one _Group: one in-flight count, one
    list of pickup times (none while quiet, below), one last pickup, and
    their tightest limits checked in two comparisons.  A sub-queue that needs only part of a
    group splits it in two with the same counts (partition refinement).
    A pickup thus touches one group per distinct set of sub-queues among
    its entries (a tenant's, a source IP's, its own), not one per entry:
    100 counters are 1 group for one sub-queue, 6 or 7 among 100 000.
    Thresholds nothing can reach (a concurrency at or above
    max_deliveries, or a global counter's) are not tracked at all.

    Source IP pools (Halon).  A job may use any of its route's source IPs;
    the IPs are tried in turn from where the sub-queue's last pickup left
    off, and a suspended IP is skipped.

    Leaky bucket (rate).  A rate "X/Y" keeps the times of the entry's
    pickups (its group's, for one window); one more is allowed when the
    X-th latest is Y seconds old, so no Y-second window ever holds more
    than X pickups.

    Rates far from full keep no times per group (quiet rate classes).
    Groups with the same rates share a _Rates class.  While fewer than
    half its smallest X of all pickups fall in its longest window, the
    class is quiet: its groups log nothing per pickup, because one log of
    every pickup's groups (_Pickups, one list per handle() call) holds
    their pickups, and the class's bound (that window's pickups when it
    was checked, plus every pickup since) says none of their windows can
    be full until pickup number arm_at, when it is checked again.  A class
    found busy is armed: its groups take their times from that log and
    log their own from then on, as above.  A pickup among groups with
    such rates therefore logs once, not once per group.

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
    raises ValueError, and the state is unchanged).  A quiet class's
    groups have fewer pickups in any of their windows than its bound,
    which stays below its smallest X until pickup number arm_at; their
    pickups in those windows are all in _Pickups.  In a line, a sub-queue's
    stale entries come before its live one, and it has at most one live
    entry, when it is parked on the line's blocker.

LIMITATIONS
    connectinterval spaces pickups, each of which may open a connection; a
    runtime that reuses a connection still waits for the interval.  Rate
    windows are kept per group as the pickup times of one window (pruned
    when they double), or for quiet classes as every pickup's groups for
    the longest quiet window: memory grows with the pickups in a window.
    An entry a reload keeps carries the pickups its old window holds: a
    longer window counts those, not older ones.  A class once armed stays
    armed until a reload finds no group with its rates.
    Counter entries with no threshold, or none reachable, are not tracked
    (the views do not list them).  A reload starts new counters' rate
    windows empty.  A pickup checks and counts in every group of its
    sub-queue: its cost grows with the distinct sets of sub-queues its
    entries are shared by, not with the number of counters, sub-queues or
    jobs.  Groups do not merge again when sub-queues go away.

SEE ALSO
    sluice.scheduler.policy, sluice.scheduler.events, docs/scheduler.md,
    seeds/001, seeds/003, seeds/004.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_right
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Sequence
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


class _Line(deque["_SubQueue"]):
    """Sub-queues parked on a blocker at one priority, oldest first.

    A sub-queue that leaves the line other than at its head (woken by
    another of its blockers, unparked) is not looked for: its entry stays,
    stale, and the sub-queue counts it (``stale``, per line).  A line holds
    a sub-queue's stale entries before its live one (it can only be parked
    again behind them), so a head entry is stale when its sub-queue still
    counts one here; stale entries are dropped there, or when they
    outnumber the others.  ``live`` counts the sub-queues in line.

    Among 100 000 sub-queues that take turns at one blocker, a wake and a
    park are then a popleft and an append of the sub-queue itself, where a
    dict keyed by sub-queue missed the cache at each.
    """

    __slots__ = ("live", "solo")
    __hash__ = object.__hash__  # type: ignore[assignment]  # a key of _SubQueue.stale
    __eq__ = object.__eq__

    def __init__(self, solo: tuple[_Blocker, ...] = ()) -> None:
        super().__init__()
        self.live = 0
        self.solo = solo  # (its blocker,): the parked_on of a sub-queue held by it alone

    def leave(self, sq: _SubQueue) -> None:
        """``sq`` left this line elsewhere than at its head."""
        self.live -= 1
        stale = sq.stale
        if stale is None:
            sq.stale = {self: 1}
        else:
            stale[self] = stale.get(self, 0) + 1
        if len(self) > 2 * self.live + 32:
            live = self.members(True)
            self.clear()
            self.extend(live)

    def members(self, drop: bool = False) -> list[_SubQueue]:
        """Its sub-queues in line, oldest first (``drop``: and forget the stale entries)."""
        skipped: dict[_SubQueue, int] = {}
        out = []
        for sq in self:
            stale = sq.stale
            if stale is not None and skipped.get(sq, 0) < stale.get(self, 0):
                skipped[sq] = skipped.get(sq, 0) + 1
                continue
            out.append(sq)
        if drop:
            for sq in skipped:
                stale = sq.stale
                assert stale is not None
                del stale[self]
                if not stale:
                    sq.stale = None
        return out


def _lines(blocker: _Blocker) -> tuple[_Line, _Line]:
    """A blocker's own lines, per priority."""
    solo = (blocker,)
    return (_Line(solo), _Line(solo))


#: Shared by every blocker that never had a waiter (most of them): reading
#: it is safe, and _park gives a blocker its own lines before the first write.
_NO_WAITERS: tuple[_Line, _Line] = (_Line(), _Line())


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
    """The pickup times of every group that keeps none (no rate, or a quiet one)."""

    def append(self, value: float) -> None:
        raise RuntimeError("broken invariant: a pickup logged in a group without a log")


_NO_LOG: deque[float] = _NoLog()

_RateSet = tuple[tuple[int, float], ...]


class _Rates:
    """A set of rates (count, seconds), shared by every group that has
    exactly these: a *rate class*, and whether it is quiet.

    A quiet class is one whose windows are far from full for the whole
    scheduler: fewer than half its smallest count (min_n) of all pickups
    fell in its longest window when it was last checked.  Its groups keep
    no pickup times of their own (their pickups are in _Pickups, which
    keeps every pickup's groups for the windows of quiet classes), because
    none can be held by these rates: a window of one of them holds at most
    ``bound()`` of its pickups, the ``w0`` pickups of the window when the
    class was checked (at pickup number ``p0``) plus every pickup since,
    and that stays below min_n until pickup number ``arm_at``, when
    Scheduler._verify checks the class again.  A class found busy is armed
    for good: its groups get their pickup times from _Pickups, and log
    their own from then on.
    """

    __slots__ = ("arm_at", "max_s", "min_n", "mixed", "p0", "pk", "quiet", "rate_cap", "rates",
                 "w0")

    def __init__(self, rates: _RateSet, pk: _Pickups) -> None:
        self.rates = rates  # the smallest count first: the likeliest full
        self.pk = pk
        if rates:
            self.max_s = max(per for _, per in rates)
            self.min_n = min(n for n, _ in rates)
            self.rate_cap = min(n for n, per in rates if per == self.max_s)
            self.mixed = any(per != self.max_s for _, per in rates)
        else:
            self.max_s = 0.0
            self.min_n = self.rate_cap = _BIG
            self.mixed = False
        self.quiet = False
        self.p0 = self.w0 = 0
        self.arm_at = _BIG

    def bound(self) -> int:
        """At most how many pickups of one of its quiet groups a window holds."""
        return self.w0 + self.pk.n - self.p0


class _Pickups:
    """Every pickup's groups, for as long as a quiet rate class needs them.

    Pickups are kept per call of handle_all() (all at one time): ``times``,
    ``start`` (the number of its first pickup) and ``groups`` (one tuple per
    pickup), from ``head`` on; ``cur`` is the running call's.  Calls are
    dropped once older than the longest window of a quiet class
    (``horizon``), so that a quiet group's pickups in its window are all
    here.  ``n`` counts every pickup.
    """

    __slots__ = ("arm_at", "classes", "cur", "cur_p", "groups", "head", "horizon", "n",
                 "no_rates", "now", "pending", "sources", "start", "times")

    def __init__(self, now: float) -> None:
        self.n = 0
        self.now = now
        self.times: list[float] = []
        self.start: list[int] = []
        self.groups: list[list[tuple[_Group, ...]]] = []
        self.head = 0
        self.cur: list[tuple[_Group, ...]] = []
        self.cur_p = 0
        self.classes: dict[_RateSet, _Rates] = {}
        self.no_rates = _Rates((), self)
        self.arm_at = _BIG  # the first pickup number at which a quiet class is checked
        self.horizon = -_NEVER  # the longest window of a quiet class
        # Groups that take over the pickups of others (a split's half, a
        # reload's new group): source -> heirs, and heir -> sources.
        self.pending: dict[_Group, list[tuple[_Group, float]]] = {}
        self.sources: dict[_Group, list[tuple[_Group, float]]] = {}

    def rates(self, rates: _RateSet) -> _Rates:
        """The class of ``rates``; a new one is quiet if the pickups allow."""
        if not rates:
            return self.no_rates
        rc = self.classes.get(rates)
        if rc is None:
            rc = self.classes[rates] = _Rates(rates, self)
            self.check(rc)
            self.update()
        return rc

    def check(self, rc: _Rates) -> bool:
        """Keep ``rc`` quiet while fewer than half its min_n pickups are in
        its window; False: it is not (any more)."""
        w = self.window(rc.max_s)
        if 2 * w < rc.min_n:
            rc.quiet = True
            rc.p0 = self.n
            rc.w0 = w
            rc.arm_at = self.n - w + rc.min_n  # bound() reaches min_n there
            return True
        rc.quiet = False
        rc.arm_at = _BIG
        return False

    def update(self) -> None:
        quiet = [rc for rc in self.classes.values() if rc.quiet]
        self.arm_at = min((rc.arm_at for rc in quiet), default=_BIG)
        self.horizon = max((rc.max_s for rc in quiet), default=-_NEVER)

    def window(self, per: float) -> int:
        """The pickups at a time t with t + per > now (as a rate counts them)."""
        now = self.now
        times = self.times
        i = bisect_right(times, now, self.head, key=lambda t: t + per)
        return self.n - (self.start[i] if i < len(times) else self.cur_p)

    def end_call(self) -> None:
        """The running call is over: keep its pickups, drop what no quiet window needs."""
        times = self.times
        if self.cur:
            times.append(self.now)
            self.start.append(self.cur_p)
            self.groups.append(self.cur)
            self.cur = []
        self.cur_p = self.n
        head, end = self.head, len(times)
        horizon, now = self.horizon, self.now
        while head < end and times[head] + horizon <= now:
            head += 1
        if head and 2 * head >= end:
            del times[:head]
            del self.start[:head]
            del self.groups[:head]
            head = 0
        self.head = head

    def inherit(self, source: _Group, heir: _Group, window: float) -> None:
        """``heir`` counts the pickups so far of ``source`` that a window of
        ``window`` seconds holds now (flush() writes it)."""
        chain = [(source, window)]
        chain += [(src, min(w, window)) for src, w in self.sources.get(source, ())]
        for src, w in chain:
            self.pending.setdefault(src, []).append((heir, w))
            self.sources.setdefault(heir, []).append((src, w))

    def flush(self) -> None:
        """Add the heirs to the pickups of their sources (before the next pickup)."""
        pending, now = self.pending, self.now
        windows = sorted({w for heirs in pending.values() for _, w in heirs})
        memo: dict[int, tuple[tuple[_Group, ...], tuple[_Group, ...]]] = {}
        active = 0
        calls = [(self.times[i], self.groups[i]) for i in range(self.head, len(self.times))]
        calls.append((now, self.cur))
        for t, call in calls:  # in time order: windows only join
            n = sum(1 for w in windows if t + w > now)
            if n != active:
                memo = {}
                active = n
            if not n:
                continue
            for i, gs in enumerate(call):
                hit = memo.get(id(gs))
                if hit is None:
                    extra = dict.fromkeys(h for g in gs for h, w in pending.get(g, ())
                                          if t + w > now)
                    hit = memo[id(gs)] = (gs, (*gs, *extra) if extra else gs)
                if hit[1] is not gs:
                    call[i] = hit[1]
        pending.clear()
        self.sources.clear()

    def history(self, wanted: Iterable[_Group] | None) -> dict[_Group, deque[float]]:
        """The pickup times kept of ``wanted`` (None: of every quiet group)."""
        if self.pending:
            self.flush()
        targets = None if wanted is None else set(wanted)
        out: dict[_Group, deque[float]] = {}
        memo: dict[int, tuple[tuple[_Group, ...], list[_Group]]] = {}
        calls = [(self.times[i], self.groups[i]) for i in range(self.head, len(self.times))]
        calls.append((self.now, self.cur))
        for t, call in calls:
            for gs in call:
                hit = memo.get(id(gs))
                if hit is None:
                    mine = [g for g in gs if (g in targets if targets is not None
                                              else g.mode == 0 and g.rc.rates)]
                    hit = memo[id(gs)] = (gs, mine)
                for g in hit[1]:
                    log = out.get(g)
                    if log is None:
                        log = out[g] = deque()
                    log.append(t)
        return out


class _Table:
    """The counters of one field signature that entered the policy together.

    They key a delivery alike, so their entries for one key are counted by
    exactly the same deliveries since the table exists: they are one _Row,
    with one set of counts.  A counter that joins a signature on a reload
    gets a table of its own, so that its rate windows start empty.
    """

    __slots__ = ("ccs", "limits", "profiles", "reuse", "rows", "sig", "specs")

    _MEMO_MAX = 100_000

    def __init__(self, ccs: Sequence[_CCounter], limits: tuple[int, int],
                 memos: dict[str, dict[str, str]]) -> None:
        self.sig = ccs[0].sig
        # Per field: its name, and for a field with groups, the spec and a
        # memo of its group look-ups (raw value -> key component), shared by
        # every table with the same groups for the field.
        self.specs = tuple((f.name, f, memos.setdefault(f.signature, {})) if f.groups
                           else (f.name, None, None) for f in ccs[0].counter.fields)
        self.rows: dict[tuple[str, ...], _Row] = {}
        # Rows of the previous policy, until a look-up takes them back (_rebuild).
        self.reuse: dict[tuple[str, ...], _Row] = {}
        self.ccs: tuple[_CCounter, ...] = ()
        self.profiles: dict[tuple[int, ...], _Profile] = {}
        self.limits = limits
        self.reset(ccs, limits)

    def reset(self, ccs: Sequence[_CCounter], limits: tuple[int, int]) -> None:
        """New counters (the same signature) and limits: rows wait to be looked up again."""
        self.ccs = tuple(ccs)
        self.limits = limits
        self.profiles = {}
        self.reuse = self.rows
        self.rows = {}

    def key(self, route: Route, ip: str) -> tuple[str, ...]:
        parts: list[str] = []
        for name, spec, memo in self.specs:
            raw = ip if name == "localip" else getattr(route, name)
            if spec is not None and memo is not None:
                value = memo.get(raw)
                if value is None:
                    if len(memo) >= self._MEMO_MAX:
                        memo.clear()
                    value = memo[raw] = spec.component(raw)
                raw = value
            parts.append(raw)
        return tuple(parts)

    def profile(self, key: tuple[str, ...]) -> _Profile:
        """The thresholds of ``key`` under each counter; shared by every key
        that the same conditions (or fall-backs) choose for."""
        chosen = tuple(cc.match(key) for cc in self.ccs)
        prof = self.profiles.get(chosen)
        if prof is None:
            prof = _Profile(self, chosen)
            self.profiles[chosen] = prof
        return prof


def _cannot_bind(thresholds: Thresholds, limit: int) -> bool:
    """A concurrency no lower than what can ever be in flight, with no rate
    or interval, never holds a delivery back: such entries are not tracked."""
    return (thresholds.rate is None and not thresholds.connectinterval_s
            and thresholds.concurrency is not None and thresholds.concurrency >= limit)


class _Profile:
    """The tracked entries of one key of a table: per counter, its thresholds
    and condition; and their tightest limits together."""

    __slots__ = ("conc", "dest_concs", "interval", "items", "rates", "table")

    def __init__(self, table: _Table, chosen: tuple[int, ...]) -> None:
        self.table = table
        limit_global, limit = table.limits
        items: list[tuple[_CCounter, Thresholds, Condition | None]] = []
        dest: list[tuple[int, int]] = []
        for cc, n in zip(table.ccs, chosen, strict=True):
            thresholds, cond = cc.chosen(n)
            conc = thresholds.concurrency
            if cc.dest and conc is not None:  # untracked or not, it is the policy
                dest.append((cc.index, conc))
            if thresholds.is_empty or _cannot_bind(thresholds,
                                                   limit if cc.names else limit_global):
                continue
            items.append((cc, thresholds, cond))
        self.items = tuple(items)
        # The concurrencies of the counters that limit the destination.
        self.dest_concs = tuple(dest)
        concs = [t.concurrency for _, t, _ in items if t.concurrency is not None]
        self.conc: int | None = min(concs) if concs else None
        self.rates = tuple(sorted({(t.rate.count, t.rate.per_s) for _, t, _ in items
                                   if t.rate is not None}))
        intervals = [t.connectinterval_s for _, t, _ in items if t.connectinterval_s]
        self.interval: float | None = max(intervals) if intervals else None


class _Row:
    """The entries of one key of a table (one per counter that tracks it)."""

    __slots__ = ("grp", "key", "prof")

    def __init__(self, key: tuple[str, ...], prof: _Profile) -> None:
        self.key = key
        self.prof = prof
        self.grp: _Group | None = None


class _Group(_Blocker):
    """Rows that the same deliveries count in, counted once.

    Every source IP of a sub-queue (a *user*) that uses one row of a group
    uses all of them, so a pickup counts in all or none: the group keeps one
    in-flight count, one list of pickup times and one last pickup for all
    its rows, and a pickup checks their tightest limits here, in two
    comparisons (``inflight >= conc``, ``now < busy``).  A user that needs
    only some rows of a group splits it (Scheduler._split) in two with the
    same counts.  A row alone with one sub-queue (a destination's entries)
    is one group per sub-queue; the rows of a tenant, a source IP, a job,
    are one group per distinct set of sub-queues that use them.

    Its rates are its rate class (``rc``, shared with every group that has
    the same ones).  While the class is quiet, the group logs no pickup
    times (its pickups are in _Pickups): ``log`` is _NO_LOG and ``mode`` 0.
    """

    # CPython lays slots out sorted by name, after _Blocker's (pending,
    # timer_at, waiters): what a pickup checks (busy, conc, inflight) and
    # counts (inflight, last_pick, mode) are at the front.
    __slots__ = ("busy", "conc", "inflight", "interval", "last_at", "last_pick", "log", "log_n",
                 "mode", "old", "rc", "rows", "users", "watch")

    def __init__(self, rows: list[_Row], pk: _Pickups) -> None:
        super().__init__()
        self.rows = rows
        for row in rows:
            row.grp = self
        # Sub-queues whose source IPs use it (for splits and forgetting).
        self.users: dict[_SubQueue, None] = {}
        # Whether a finished delivery has more to do than count it: it has
        # waiters' lines, or no user (read where those would be misses).
        self.watch = True
        self.inflight = 0
        self.log: deque[float] = _NO_LOG
        self.last_at = -_NEVER  # the last pickup, for an interval
        self.last_pick = -_NEVER  # the last pickup its rates count
        self.old = False  # a policy change made it stale (_rebuild)
        self.rc = pk.no_rates
        self.mode = 0
        self.refresh(pk, False)

    def copy_counts(self, pk: _Pickups, log: deque[float] | None, inflight: int,
                    last_pick: float, last_at: float) -> None:
        """Counts taken over from another group: in flight as given, its
        pickup times (``log``; None: they are in ``pk``, which Scheduler._copy
        has this group inherit), its last pickup its rates count and its last
        pickup for an interval."""
        self.inflight = inflight
        self.log = deque(log) if log and self.rc.rates else _NO_LOG
        self.last_pick = last_pick if self.rc.rates else -_NEVER
        self.last_at = last_at
        self.refresh(pk, log is None and bool(self.rc.rates))

    def refresh(self, pk: _Pickups, inherited: bool) -> None:
        """Recompute the tightest limits of the rows (after a split, a reload).

        ``inherited``: it has pickups that are only in ``pk`` (it was
        quiet, or inherits a quiet group's): mode 3 if it must log them
        (Scheduler._settle), unless it stays quiet.
        """
        conc = _BIG
        rates: set[tuple[int, float]] = set()
        interval: float | None = None
        for row in self.rows:
            prof = row.prof
            if prof.conc is not None and prof.conc < conc:
                conc = prof.conc
            rates.update(prof.rates)
            if prof.interval is not None and (interval is None or prof.interval > interval):
                interval = prof.interval
        self.conc = conc  # _BIG: no concurrency
        self.interval = interval
        rc = self.rc = pk.rates(tuple(sorted(rates)))
        # What a pickup does to it (_start): 0 nothing (untimed, or quiet);
        # 1 log it inline (rates only, and a log of its own: a group that
        # never had a pickup has none yet); 2 stamp() (an interval, or a
        # first pickup); 3 never: it is settled before any pickup.
        if not rc.rates:
            self.log = _NO_LOG
            self.mode = 2 if interval is not None else 0
        elif self.log is not _NO_LOG:
            self.mode = 1 if interval is None else 2
        elif rc.quiet and interval is None:
            self.mode = 0
        else:
            self.mode = 3 if inherited else 2
        self.log_n = min(rc.min_n, max(64, 2 * len(self.log)))
        self.busy = self._busy()

    def arm(self, log: deque[float] | None) -> None:
        """Log its own pickup times from now on, starting with ``log`` (its
        pickups in _Pickups): its class is no longer quiet, or a count is due."""
        self.log = log if log else _NO_LOG
        self.mode = (1 if self.interval is None else 2) if log else 2
        self.log_n = min(self.rc.min_n, max(64, 2 * len(self.log)))
        self.busy = self._busy()

    def _busy(self) -> float:
        """Until when a timed limit (a rate, an interval) holds the next pickup."""
        busy = self._rates_busy() if len(self.log) >= self.rc.min_n else -_NEVER
        if self.interval is not None:
            at = self.last_at + self.interval
            if at > busy:
                busy = at
        return busy

    def _rates_busy(self) -> float:
        """Until when a rate holds the next pickup (the log holds at least min_n)."""
        busy = -_NEVER
        log = self.log
        n_log = len(log)
        for n, per in self.rc.rates:
            if n == 0:
                return _NEVER
            if n_log >= n:
                at = log[-n] + per
                if at > busy:
                    busy = at
        return busy

    def stamp(self, now: float) -> None:
        """A pickup at ``now`` (of a timed group): log it, and when the next may go.

        "log[-n] + per" is the sum free_at() gives the timer and the one the
        pickup's "now < busy" compares with, so that the timer's time always
        finds the slot free (floats do not round "log[-n] <= now - per" alike).
        """
        busy = -_NEVER
        if self.rc.rates:
            log = self.log
            if log is _NO_LOG:  # its first pickup (an empty deque is 600 bytes)
                self.log = log = deque()
                self.mode = 1 if self.interval is None else 2
            log.append(now)
            if len(log) >= self.log_n:
                busy = self.logged(now)
        interval = self.interval
        if interval is not None:
            self.last_at = now
            if now + interval > busy:
                busy = now + interval
        self.busy = busy

    def logged(self, now: float) -> float:
        """After a pickup was logged, once the log reached log_n: prune it
        (when it doubled since the last time, so that pickup times are kept
        for one window, not for X pickups), and until when the rates hold
        the next pickup.  Scheduler._start calls it directly for a group
        with rates and no interval, whose log is all stamp() would update
        otherwise: the busy time of its rates stays -inf, or a time already
        past, below log_n (which is at most min_n)."""
        log = self.log
        rc = self.rc
        per = rc.max_s
        while log[0] + per <= now:
            log.popleft()
        self.log_n = min(rc.min_n, max(64, 2 * len(log)))
        busy = self._rates_busy() if len(log) >= rc.min_n else -_NEVER
        if self.interval is None:
            self.busy = busy
        return busy

    def prune(self, now: float) -> None:
        log = self.log
        per = self.rc.max_s
        while log and log[0] + per <= now:
            log.popleft()

    def free(self, now: float) -> int:
        free = self.conc - self.inflight
        if free <= 0:
            return free
        if now < self.busy:
            return 0
        rc = self.rc
        if rc.rates:
            if self.mode == 0:
                # Quiet: none of its windows holds more than bound() pickups.
                if rc.rate_cap - rc.bound() >= free:
                    return min(free, 1) if rc.mixed else free
                self.arm(rc.pk.history((self,)).get(self))  # the count is due
            # A log shorter than rate_cap by at least the free slots cannot be
            # what limits them, pruned or not: prune only when it might.
            if rc.rate_cap - len(self.log) < free:
                self.prune(now)
                free = min(free, rc.rate_cap - len(self.log))
            if rc.mixed:
                free = min(free, 1)  # shorter windows: let one through at a time
        return free

    def free_at(self, now: float) -> float | None:
        if self.inflight >= self.conc:
            return None  # a finishing delivery will say
        busy = self.busy
        return busy if now < busy < _NEVER else None

    def keep_until(self) -> float:
        """Until when a group nobody uses must be remembered (its windows)."""
        rc = self.rc
        at = self.last_pick + rc.max_s if rc.rates else -_NEVER
        if self.interval is not None:
            at = max(at, self.last_at + self.interval)
        return at


def _kind(thresholds: Thresholds, grp: _Group, log: deque[float], now: float) -> Waiting | None:
    """Whether one entry (its thresholds, counted in ``grp``, whose pickup
    times are ``log``) holds back the next pickup."""
    conc = thresholds.concurrency
    if conc is not None and grp.inflight >= conc:
        return Waiting.CONCURRENCY
    rate = thresholds.rate
    if rate is not None:
        n = rate.count
        if n == 0 or (len(log) >= n and log[-n] + rate.per_s > now):
            return Waiting.RATE
    interval = thresholds.connectinterval_s
    if interval and now < grp.last_at + interval:
        return Waiting.CONNECTINTERVAL
    return None


def _free_at(thresholds: Thresholds, grp: _Group, log: deque[float], now: float
             ) -> float | None:
    """When one entry lets one more through; None = an event will (or never)."""
    conc = thresholds.concurrency
    if conc is not None and grp.inflight >= conc:
        return None
    at = now
    rate = thresholds.rate
    if rate is not None:
        n = rate.count
        if n == 0:
            return None
        if len(log) >= n:
            at = max(at, log[-n] + rate.per_s)
    interval = thresholds.connectinterval_s
    if interval:
        at = max(at, grp.last_at + interval)
    return at if at > now else None


def _rate_used(thresholds: Thresholds, log: deque[float], now: float) -> int:
    rate = thresholds.rate
    if rate is None:
        return 0
    return sum(1 for t in log if t + rate.per_s > now)


class _Logs:
    """Pickup times of groups for the views: a group's own log, or for a
    quiet group, its pickups in _Pickups (all quiet groups' at once, the
    first time one is asked for)."""

    __slots__ = ("found", "pk")

    def __init__(self, pk: _Pickups) -> None:
        self.pk = pk
        self.found: dict[_Group, deque[float]] | None = None

    def of(self, grp: _Group) -> deque[float]:
        if grp.mode != 0 or not grp.rc.rates:
            return grp.log
        if self.found is None:
            self.found = self.pk.history(None)
        return self.found.get(grp, _NO_LOG)


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
    __slots__ = ("dest", "dropped", "g0", "groups", "in_ring", "ip0", "ips", "jobs", "live",
                 "parked_on", "pool", "priority", "route", "rr", "s0", "stale", "susp",
                 "susp_version", "version", "woken_by")

    def __init__(self, route: Route, priority: int, dest: _Dest) -> None:
        self.route = route
        self.priority = priority
        self.dest = dest
        self.jobs: deque[_Job] = deque()
        self.live = 0
        self.dropped = 0
        self.ips: tuple[str, ...] = route.localip or ("",)
        self.pool = len(self.ips) > 1
        # Per source IP: the groups a pickup checks and counts in.
        self.groups: list[tuple[_Group, ...]] = []
        # The first IP's, and its suspension, at hand: the common case of
        # one IP reads no list (each a cache miss among 100 000 sub-queues).
        self.ip0 = self.ips[0]
        self.g0: tuple[_Group, ...] = ()
        self.s0: _Susp | None = None
        self.version = -1
        self.susp: list[_Susp | None] = []
        self.susp_version = -1
        self.parked_on: tuple[_Blocker, ...] = ()
        self.in_ring = False
        self.woken_by: _Blocker | None = None
        self.rr = 0
        # Per line, its entries there that it left without being woken there.
        self.stale: dict[_Line, int] | None = None


class _Job:
    __slots__ = ("dropped", "job", "qids", "queued_at", "sq")

    def __init__(self, job: DeliveryJob, sq: _SubQueue, now: float) -> None:
        self.job = job
        self.qids = job.qids
        self.sq = sq
        self.dropped = False
        self.queued_at = now


class _Flight:
    __slots__ = ("dest", "groups", "ip", "job", "qids", "started_at")

    def __init__(self, job: DeliveryJob, qids: tuple[str, ...], ip: str,
                 groups: tuple[_Group, ...], dest: _Dest, now: float) -> None:
        self.job = job
        self.qids = qids
        self.ip = ip
        # The groups it counts in (its user's at the start, plus the halves
        # split off them since: Scheduler._split).
        self.groups = groups
        self.dest = dest
        self.started_at = now


class _CCounter:
    """A policy counter, compiled: its conditions as matchers over a key."""

    __slots__ = ("counter", "dest", "id", "index", "matchers", "names", "sig")

    def __init__(self, counter: Counter, index: int) -> None:
        self.counter = counter
        self.index = index  # its place in the policy
        self.id = counter.id
        self.sig = counter.signature
        self.names = counter.field_names
        self.dest = counter.limits_destination
        self.matchers = tuple((c, _compile_match(c, self.names)) for c in counter.conditions)

    def match(self, key: tuple[str, ...]) -> int:
        """The index of the first condition ``key`` meets; -1: the fall-back."""
        for n, (_, matcher) in enumerate(self.matchers):
            for pos, want in matcher:
                have = key[pos]
                if isinstance(want, Pattern):
                    if not want.matches(have):
                        break
                elif have != want:
                    break
            else:
                return n
        return -1

    def chosen(self, n: int) -> tuple[Thresholds, Condition | None]:
        if n < 0:
            return self.counter.default, None
        cond = self.matchers[n][0]
        return cond.thresholds, cond

    def thresholds(self, key: tuple[str, ...]) -> tuple[Thresholds, Condition | None]:
        return self.chosen(self.match(key))

    def timed_kinds(self) -> set[str]:
        """Which timed limits (rate, interval) any of its thresholds has."""
        out: set[str] = set()
        for thresholds in (self.counter.default, *(c.thresholds for c in self.counter.conditions)):
            if thresholds.rate is not None:
                out.add("rate")
            if thresholds.connectinterval_s:
                out.add("interval")
        return out


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


#: One tracked counter entry, for the views: counter, thresholds, condition,
#: key, and the group it is counted in.
_Ent = tuple[_CCounter, Thresholds, Condition | None, tuple[str, ...], _Group]


# --------------------------------------------------------------------------


class Scheduler:
    """The active queue's decisions; see the module docstring."""

    def __init__(self, settings: Settings | None = None, policy: Policy | None = None,
                 suspensions: Iterable[Suspension] = (), now: float = 0.0) -> None:
        self.settings = settings or Settings()
        self._now = now
        # Every pickup's groups, for rate classes that keep no pickup times
        # per group (quiet ones); and groups that must get theirs (_settle).
        self._pk = _Pickups(now)
        self._unsettled: list[_Group] = []
        self._seq = 0
        self._timers: list[tuple[float, int, int, Any]] = []
        self._gc: list[tuple[float, int, _Group]] = []
        # Policy: the counters, and their entries in tables (one per field
        # signature), rows (one per key) and groups (counted together).
        self._policy = Policy()
        self._ccounters: tuple[_CCounter, ...] = ()
        self._tables: tuple[_Table, ...] = ()
        self._memos: dict[str, dict[str, str]] = {}  # group look-ups, per field spec
        self._n_entries = 0  # tracked counter entries, over every row
        # While _rebuild runs: the stale group each row taken back comes
        # from, and whether it kept pickup times (a rate) and a last pickup
        # (an interval) under the old policy.
        self._origins: dict[_Row, tuple[_Group, bool, bool]] = {}
        self._max_inflight = self.settings.max_deliveries
        self._version = 0
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
        # Blockers that finished deliveries freed, to release (in this order).
        self._dirty: dict[_Blocker, None] = {}
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
        self._set_policy(policy or Policy(), now)
        for susp in suspensions:
            self._add_suspension(susp, now, from_file=False)
        self._settle()

    # ------------------------------------------------------------------ API

    @property
    def policy(self) -> Policy:
        return self._policy

    @property
    def pickups(self) -> int:
        """Deliveries started so far (a statistic)."""
        return self._pk.n

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
        pk = self._pk
        pk.now = now
        out: list[Command] = []
        self._fire_timers(now, out)
        if self._unsettled or pk.pending:
            self._settle()
        for event in events:
            if type(event) is DeliveryFinished:
                self._finish(event, now, out)
            else:
                if self._dirty:
                    self._release_dirty(now)  # in the order things happened
                self._dispatch(event, now, out)
                if self._unsettled or pk.pending:
                    self._settle()
        if self._dirty:
            self._release_dirty(now)
        self._select(now, out)
        pk.end_call()
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
                self._settle()  # its new groups, before the next timer looks

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
        """Compile the counters into tables; _rebuild must follow.

        A counter that keeps its id and signature stays in its table, whose
        rows keep their counts; the others start new tables.  So does a
        kept counter that gains its first rate (or interval) while its table
        holds other counters: the pickup times (last pickup) its rows keep
        are theirs, and its own window starts empty, as a new counter's.
        Every group goes stale: _rebuild places the rows again.
        """
        self._policy = policy
        ccs = tuple(_CCounter(c, i) for i, c in enumerate(policy.counters))
        self._ccounters = ccs
        limit = self.settings.max_deliveries
        for counter in policy.counters:
            if not counter.fields and counter.default.concurrency is not None:
                limit = min(limit, counter.default.concurrency)
        self._max_inflight = limit
        limits = (self.settings.max_deliveries, limit)
        old: dict[tuple[str, str], tuple[_Table, _CCounter]] = {}
        for table in self._tables:
            for cc in table.ccs:
                old[(cc.id, cc.sig)] = (table, cc)
            for row in table.rows.values():
                grp = row.grp
                if grp is not None and not grp.old:
                    grp.old = True
                    grp.timer_at = None
                    grp.pending = 0
                    grp.waiters = _NO_WAITERS  # _rebuild parks nobody on it
        members: dict[_Table | str, list[_CCounter]] = {}
        for cc in ccs:
            owner: _Table | str = cc.sig
            found = old.get((cc.id, cc.sig))
            if found is not None:
                table, before = found
                if len(table.ccs) == 1 or (before.timed_kinds() >= cc.timed_kinds()):
                    owner = table
            members.setdefault(owner, []).append(cc)
        tables: list[_Table] = []
        for owner, group in members.items():
            if isinstance(owner, _Table):
                owner.reset(group, limits)
                tables.append(owner)
            else:
                tables.append(_Table(group, limits, self._memos))
        self._tables = tuple(tables)

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
        """Place every row again after a policy change; wake every parked sub-queue.

        Rows whose counter (id and fields) survives keep their rate windows
        and intervals (the stale group they come from); in-flight counts are
        recounted from the deliveries in flight.  O(sub-queues + deliveries):
        an operator action, not a pickup.
        """
        self._version += 1
        for dest in self._dests.values():
            dest.ip_limits.clear()
            dest.set_cap(self.settings.default_destination_concurrency_limit)
            if dest.waiters is not _NO_WAITERS:
                dest.waiters = _lines(dest)
            dest.pending = 0
        for susp in self._susps.values():
            if susp.waiters is not _NO_WAITERS:
                susp.waiters = _lines(susp)
            susp.pending = 0
        for flight in self._flights.values():
            groups = self._place(self._rows_for(flight.job.route, flight.ip)[0], None)
            flight.groups = groups
            for grp in groups:
                grp.inflight += 1
        for sq in self._subqueues.values():
            sq.parked_on = ()
            sq.stale = None  # the lines are new
            sq.woken_by = None
            self._resolve(sq)
            if sq.live and not sq.in_ring:
                self._ring[sq.priority].append(sq)
                sq.in_ring = True
        for queue in (*self._woken, *self._ring):
            for sq in queue:
                sq.woken_by = None
        n = 0
        used: set[_Rates] = set()
        for table in self._tables:
            table.reuse = {}  # rows nobody looked up again are forgotten
            for row in table.rows.values():
                n += len(row.prof.items)
                if row.grp is not None:
                    used.add(row.grp.rc)
        self._n_entries = n
        self._origins = {}
        pk = self._pk  # rate classes no group has any more are forgotten
        pk.classes = {rates: rc for rates, rc in pk.classes.items() if rc in used}
        pk.update()

    def _rows_for(self, route: Route, ip: str) -> tuple[list[_Row], int]:
        """The rows of ``route`` from ``ip`` (created as needed), and the
        tightest concurrency among the counters that limit the destination
        (0: none)."""
        rows: list[_Row] = []
        dest: list[tuple[int, int]] = []
        for table in self._tables:
            key = table.key(route, ip)
            row = table.rows.get(key)
            if row is None:
                prof = table.profile(key)
                if table.reuse:
                    row = table.reuse.pop(key, None)
                if prof.items:
                    if row is None:
                        row = _Row(key, prof)
                        self._n_entries += len(prof.items)
                    else:
                        # Its stale group holds its counts: the pickup
                        # times if it had a rate, the last pickup if it had
                        # an interval (what each entry kept on its own).
                        old, stale = row.prof, row.grp
                        if stale is not None:
                            self._origins[row] = (stale, bool(old.rates),
                                                  old.interval is not None)
                        row.prof = prof
                    table.rows[key] = row
                else:
                    row = None
            else:
                prof = row.prof
            if row is not None:
                rows.append(row)
            if prof.dest_concs:
                dest.extend(prof.dest_concs)
        limit = 0
        if dest:
            dest.sort()
            for _, conc in dest:  # counter by counter, in the policy's order
                limit = conc if not limit else min(limit, conc)
        return rows, limit

    def _resolve(self, sq: _SubQueue) -> None:
        """Look up a sub-queue's rows and place them in groups, per source IP."""
        self._unuse(sq)
        limits: list[int] = []
        for ip in sq.ips:
            rows, limit = self._rows_for(sq.route, ip)
            groups = self._place(rows, sq)
            sq.groups.append(groups)
            if len(sq.groups) == 1:
                sq.g0 = groups
            limits.append(limit)
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

    def _unuse(self, sq: _SubQueue) -> None:
        """The sub-queue no longer uses its groups (dropped, or resolved again)."""
        for groups in sq.groups:
            for grp in groups:
                grp.users.pop(sq, None)
                if not grp.users:
                    grp.watch = True
                    if not grp.inflight and not grp.old:
                        self._forget_later(grp)
        sq.groups = []
        sq.g0 = ()

    def _place(self, rows: list[_Row], sq: _SubQueue | None) -> tuple[_Group, ...]:
        """The groups of one user's rows: a source IP of ``sq``, or (None) a
        delivery in flight that a reload recounts.

        Rows in no group yet make new groups: fresh ones, with zero counts,
        or one per stale group they come from, with its counts (in flight
        recounted by the caller).  A group whose rows the user all uses, it
        joins; one it uses in part is split.
        """
        new: dict[tuple[_Group, bool, bool] | None, list[_Row]] = {}
        used: dict[_Group, list[_Row]] = {}
        for row in rows:
            grp = row.grp
            if grp is None or grp.old:
                new.setdefault(self._origins.get(row), []).append(row)
            else:
                used.setdefault(grp, []).append(row)
        out: list[_Group] = []
        for origin, fresh in new.items():
            grp = _Group(fresh, self._pk)
            if origin is not None:
                stale, log, last = origin
                self._copy(grp, stale, 0, log, last)
            out.append(grp)
        for grp, mine in used.items():
            out.append(grp if len(mine) == len(grp.rows) else self._split(grp, mine))
        if sq is not None:
            for grp in out:
                grp.users[sq] = None
                grp.watch = grp.waiters is not _NO_WAITERS
        return tuple(out)

    def _split(self, grp: _Group, mine: list[_Row]) -> _Group:
        """Take ``mine`` out of ``grp`` into a new group with the same counts.

        Its users use both halves from now on; deliveries in flight that
        count in it count in both (a scan of the deliveries, only when it
        has some: splits happen when a sub-queue is created, and a group
        splits at most once per row); sub-queues parked on it wait on both.
        """
        part = _Group(mine, self._pk)
        self._copy(part, grp, grp.inflight)
        grp.rows = [row for row in grp.rows if row.grp is grp]
        grp.refresh(self._pk, grp.mode in (0, 3) and bool(grp.rc.rates))
        if grp.mode == 3:
            self._unsettled.append(grp)
        for user in grp.users:
            part.users[user] = None
            for i, groups in enumerate(user.groups):
                if grp in groups:
                    k = groups.index(grp) + 1
                    user.groups[i] = (*groups[:k], part, *groups[k:])
                    if i == 0:
                        user.g0 = user.groups[0]
        if grp.inflight:
            for flight in self._flights.values():
                if grp in flight.groups:
                    flight.groups = (*flight.groups, part)
        waiters = grp.waiters
        if waiters[0].live or waiters[1].live:
            self._settle()  # before anything looks at their counts
            part.waiters = _lines(part)
            for p in (0, 1):
                line = part.waiters[p]
                for sq in waiters[p].members():
                    line.append(sq)
                    line.live += 1
                    sq.parked_on = (*sq.parked_on, part)
            now = self._now
            at = part.free_at(now)
            if at is not None:
                self._schedule_blocker(part, at)
            self._release(grp, now)
            self._release(part, now)
        part.watch = not part.users or part.waiters is not _NO_WAITERS
        return part

    def _copy(self, grp: _Group, other: _Group, inflight: int, log: bool = True,
              last: bool = True) -> None:
        """Give a new group ``other``'s counts: its in flight as given, the
        pickups its rates count (if ``log``: those its longest window holds
        now) and its last pickup (if ``last``, for an interval).  Pickups
        ``other`` keeps in _Pickups (it is quiet, or inherits them itself)
        become the new group's there too (_Pickups.inherit)."""
        pk = self._pk
        now = self._now
        window = other.rc.max_s
        in_pk = other.log is _NO_LOG and other.mode in (0, 3) and bool(other.rc.rates)
        times: deque[float] | None = _NO_LOG
        last_pick = -_NEVER
        if log:
            times = None if in_pk else deque(t for t in other.log if t + window > now)
            if other.last_pick + window > now:
                last_pick = other.last_pick
        grp.copy_counts(pk, times, inflight, last_pick, other.last_at if last else -_NEVER)
        if times is None and grp.rc.rates:
            pk.inherit(other, grp, window)
            if grp.mode == 3:
                self._unsettled.append(grp)

    def _settle(self) -> None:
        """Before the next pickup: heirs get their sources' pickups in _Pickups,
        and groups that must log theirs (mode 3) get them."""
        pk = self._pk
        if pk.pending:
            pk.flush()
        if self._unsettled:
            groups = [grp for grp in dict.fromkeys(self._unsettled) if grp.mode == 3]
            self._unsettled = []
            logs = pk.history(groups)
            for grp in groups:
                grp.arm(logs.get(grp))

    def _verify(self) -> None:
        """A quiet class's bound reached its check (pickup number arm_at):
        it stays quiet, with a new bound, or its groups log their pickups."""
        pk = self._pk
        for rc in list(pk.classes.values()):
            if rc.quiet and rc.arm_at <= pk.n and not pk.check(rc):
                members = {row.grp: None for table in self._tables for row in table.rows.values()
                           if row.grp is not None and row.grp.rc is rc and row.grp.mode == 0}
                logs = pk.history(members)
                for grp in members:
                    grp.arm(logs.get(grp))
        pk.update()

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
            sq.s0 = found[0]
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
        """Forget an empty sub-queue: it no longer uses its groups."""
        key = (sq.route, sq.priority)
        if self._subqueues.get(key) is sq:
            del self._subqueues[key]
        # Its deliveries in flight keep the groups they count in.
        self._unuse(sq)
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
        p = sq.priority
        for blocker in blockers:
            if blocker.waiters is _NO_WAITERS:
                blocker.waiters = _lines(blocker)
                if type(blocker) is _Group:
                    blocker.watch = True
            line = blocker.waiters[p]
            if blocker is woken:
                line.appendleft(sq)  # it keeps its place in line
            else:
                line.append(sq)
            line.live += 1
            at = blocker.free_at(now)
            if at is not None:
                self._schedule_blocker(blocker, at)
        sq.parked_on = blockers[0].waiters[p].solo if len(blockers) == 1 else tuple(blockers)

    def _unpark(self, sq: _SubQueue) -> None:
        p = sq.priority
        for blocker in sq.parked_on:
            blocker.waiters[p].leave(sq)
        sq.parked_on = ()

    def _release(self, blocker: _Blocker, now: float) -> None:
        """Wake as many waiters as ``blocker`` has free slots not yet promised."""
        waiters = blocker.waiters
        if not (waiters[1].live or waiters[0].live):
            return
        free = blocker.free(now)
        pending = blocker.pending
        room = free - pending
        if room > 0:
            for p in (1, 0):
                line = waiters[p]
                live = line.live
                if not live:
                    continue
                popleft = line.popleft
                wake = self._woken[p].append
                while room > 0 and live:
                    sq = popleft()
                    stale = sq.stale
                    if stale is not None and line in stale:
                        n = stale[line] - 1  # an entry it left: not its turn
                        if n:
                            stale[line] = n
                        else:
                            del stale[line]
                            if not stale:
                                sq.stale = None
                        continue
                    live -= 1
                    if len(sq.parked_on) > 1:
                        for other in sq.parked_on:
                            if other is not blocker:
                                other.waiters[p].leave(sq)
                    sq.parked_on = ()
                    sq.woken_by = blocker
                    wake(sq)
                    sq.in_ring = True
                    room -= 1
                    pending += 1
                line.live = live
            blocker.pending = pending
        # Only a blocker without a free slot can be held by a timed limit
        # (free_at() is None otherwise): then a timer wakes the rest.
        if free <= 0 and (waiters[1].live or waiters[0].live):
            at = blocker.free_at(now)
            if at is not None:
                self._schedule_blocker(blocker, at)

    def _release_dirty(self, now: float) -> None:
        """The releases of finished deliveries, one per blocker: a batch of
        results wakes the same waiters, oldest first, as one release each
        would, for one look at the blocker's room."""
        dirty = self._dirty
        while dirty:
            blocker = next(iter(dirty))
            del dirty[blocker]
            self._release(blocker, now)

    # ------------------------------------------------------------ pickup

    def _select(self, now: float, out: list[Command]) -> None:
        limit = self.settings.max_deliveries
        flights = self._flights
        woken_low, woken_high = self._woken  # indexed by priority: 0, then 1
        ring_low, ring_high = self._ring
        while len(flights) < limit:
            # Woken first, then the ring; priority 1 before priority 0.
            if woken_high:
                sq = woken_high.popleft()
            elif ring_high:
                sq = ring_high.popleft()
            elif woken_low:
                sq = woken_low.popleft()
            elif ring_low:
                sq = ring_low.popleft()
            else:
                return
            sq.in_ring = False
            woken = sq.woken_by
            if woken is None:
                self._visit(sq, now, out, None)
                continue
            sq.woken_by = None
            woken.pending -= 1
            if not self._visit(sq, now, out, woken):
                # The slot it was woken for may be free still: the next in line
                # (unless it went back into that line: releasing would find no room).
                self._release(woken, now)

    def _visit(self, sq: _SubQueue, now: float, out: list[Command],
               woken: _Blocker | None) -> bool:
        """Look at a sub-queue: start its head, or park it.  True: it took
        the slot ``woken`` promised and went back into that blocker's line."""
        if sq.dropped:
            jobs = sq.jobs
            while jobs and jobs[0].dropped:
                jobs.popleft()
                sq.dropped -= 1
        if not sq.live or sq.parked_on:
            return False  # a stale ring entry: retired, or parked meanwhile
        if sq.version != self._version:
            self._resolve(sq)
            self._settle()
        dest = sq.dest
        if dest.dead_until > now:
            self._defer_subqueue(sq, dest, out)
            return False
        if dest.inflight >= dest.limit:
            self._park(sq, [dest], woken, now)
            return False
        if not sq.pool:
            # The common case, without the bookkeeping of a pool.
            held: _Blocker | None = (sq.s0 if sq.susp_version == self._susp_version
                                     else self._suspensions_for(sq)[0])
            if held is None:
                for grp in sq.g0:
                    # Every limit of the group's rows, in two comparisons.
                    if grp.inflight >= grp.conc or now < grp.busy:
                        held = grp
                        break
                else:
                    self._start(sq, 0, now, out)
                    return self._requeue(sq, woken, now)
            self._park(sq, [held], woken, now)
            return False
        susps = sq.susp if sq.susp_version == self._susp_version else self._suspensions_for(sq)
        n = len(sq.ips)
        blockers: list[_Blocker] = []
        for k in range(n):
            i = (sq.rr + k) % n
            susp = susps[i]
            if susp is not None:
                if susp not in blockers:
                    blockers.append(susp)
                continue
            held = None
            for grp in sq.groups[i]:
                if grp.inflight >= grp.conc or now < grp.busy:
                    held = grp
                    break
            if held is not None:
                if held not in blockers:
                    blockers.append(held)
                continue
            sq.rr = (i + 1) % n
            self._start(sq, i, now, out)
            return self._requeue(sq, woken, now)
        self._park(sq, blockers, woken, now)
        return False

    def _requeue(self, sq: _SubQueue, woken: _Blocker | None, now: float) -> bool:
        """After a pickup: the sub-queue goes to the back of the line.

        If a blocker woke it for the slot it just took and has no other
        free slot, that line is the blocker's: looking at the sub-queue
        again now would only find it full.  Not so for a pool of source
        IPs, whose next delivery may leave from another IP (unless the
        blocker is the destination, which all of them share).
        """
        if not sq.live:
            self._retire(sq)
            return False
        if woken is not None and (not sq.pool or woken is sq.dest):
            if type(woken) is _Group and woken.conc - woken.inflight <= woken.pending:
                # free() is at most conc - inflight, so there is no room; and
                # it is <= 0 exactly when the group is full or a timed limit
                # holds it (a rate full at its cap is busy too).  Spares
                # free() at each pickup of a line that takes turns.
                full = woken.inflight >= woken.conc or now < woken.busy
            else:
                free = woken.free(now)
                if free - woken.pending > 0:
                    self._ring[sq.priority].append(sq)
                    sq.in_ring = True
                    return False
                full = free <= 0
            # _park(sq, [woken], None, now), for the one blocker.
            waiters = woken.waiters
            if waiters is _NO_WAITERS:
                woken.waiters = waiters = _lines(woken)
                if type(woken) is _Group:
                    woken.watch = True
            line = waiters[sq.priority]
            sq.parked_on = line.solo
            line.append(sq)
            line.live += 1
            if full:
                at = woken.free_at(now)
                if at is not None:
                    self._schedule_blocker(woken, at)
            return True
        self._ring[sq.priority].append(sq)
        sq.in_ring = True
        return False

    def _start(self, sq: _SubQueue, i: int, now: float, out: list[Command]) -> None:
        rec = sq.jobs.popleft()
        sq.live -= 1
        if i:
            ip = sq.ips[i]
            groups = sq.groups[i]
        else:
            ip = sq.ip0
            groups = sq.g0
        for grp in groups:
            grp.inflight += 1
            grp.last_pick = now
            if grp.mode:
                if grp.mode == 1:
                    # stamp(), inlined for a group with rates only.
                    log = grp.log
                    log.append(now)
                    if len(log) >= grp.log_n:
                        grp.logged(now)
                else:
                    grp.stamp(now)
        dest = sq.dest
        dest.inflight += 1
        job = rec.job
        qids = rec.qids
        self._flights[job.ref] = flight = _Flight(job, qids, ip, groups, dest, now)
        index = self._qids
        for qid in qids:
            index[qid] = flight
        n = len(qids)
        self._queued_n -= n
        self._inflight_entries += n
        pk = self._pk
        pk.cur.append(groups)
        pk.n += 1
        if pk.n >= pk.arm_at:
            self._verify()
        out.append(StartDelivery(job, ip, qids))

    # ------------------------------------------------------------ results

    def _finish(self, event: DeliveryFinished, now: float, out: list[Command]) -> None:
        flight = self._flights.pop(event.ref)
        index = self._qids
        for qid in flight.qids:
            if index.get(qid) is flight:
                del index[qid]
        self._inflight_entries -= len(flight.qids)
        dirty = self._dirty
        for grp in flight.groups:
            grp.inflight -= 1
            if grp.watch:  # most groups never had a waiter, and have users
                if grp.waiters is not _NO_WAITERS:
                    dirty[grp] = None  # released once the batch of results is in
                if not grp.inflight and not grp.users:
                    self._forget_later(grp)  # nobody left to use it
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
            dirty[dest] = None
        if not dest.inflight and not dest.subqueues:
            self._forget_dest(dest)

    # ---------------------------------------------------- garbage entries

    def _forget_later(self, grp: _Group) -> None:
        if grp.mode == 3:
            self._settle()
        self._seq += 1
        heapq.heappush(self._gc, (grp.keep_until(), self._seq, grp))

    def _collect(self, now: float) -> None:
        """Forget the rows of groups nobody uses once their windows are over."""
        gc = self._gc
        while gc and gc[0][0] <= now:
            _, _, grp = heapq.heappop(gc)
            if grp.old or grp.users or grp.inflight or not grp.rows or grp.keep_until() > now:
                continue
            for row in grp.rows:
                rows = row.prof.table.rows
                if rows.get(row.key) is row:
                    del rows[row.key]
                    self._n_entries -= len(row.prof.items)
            grp.rows = []

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
            counter_entries=self._n_entries,
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

    def _entries(self) -> Iterator[_Ent]:
        """Every tracked counter entry: table by table, key by key."""
        for table in self._tables:
            for row in table.rows.values():
                grp = row.grp
                if grp is None:
                    continue
                for cc, thresholds, cond in row.prof.items:
                    yield cc, thresholds, cond, row.key, grp

    @staticmethod
    def _group_entries(groups: Iterable[_Group]) -> list[_Ent]:
        """The entries of ``groups``, in the policy's order of counters."""
        out = [(cc, thresholds, cond, row.key, grp) for grp in groups for row in grp.rows
               for cc, thresholds, cond in row.prof.items]
        out.sort(key=lambda e: e[0].index)
        return out

    def _logs(self) -> _Logs:
        """For the views: each group's pickup times (a quiet group's from _Pickups)."""
        return _Logs(self._pk)

    @staticmethod
    def _waiting(grp: _Group) -> int:
        return grp.waiters[0].live + grp.waiters[1].live

    def counters(self, now: float | None = None) -> list[CounterView]:
        """Tracked counter entries against their thresholds.

        An entry counts the sub-queues parked on its group as waiting on it
        while it is exceeded (its group's tightest limit may be another
        entry's).
        """
        now = self._now if now is None else now
        out = []
        logs = self._logs()
        for cc, thresholds, cond, key, grp in self._entries():
            log = logs.of(grp)
            kind = _kind(thresholds, grp, log, now)
            interval = thresholds.connectinterval_s or None
            out.append(CounterView(
                counter=cc.id,
                key=tuple(zip(cc.names, key, strict=True)),
                inflight=grp.inflight,
                concurrency=thresholds.concurrency,
                rate=str(thresholds.rate) if thresholds.rate else None,
                rate_used=_rate_used(thresholds, log, now),
                connectinterval_s=interval,
                next_connect_at=(grp.last_at + interval
                                 if interval is not None and grp.last_at > -_NEVER else None),
                exceeded=kind is not None,
                waiting_subqueues=self._waiting(grp) if kind is not None else 0,
                condition=cond.id if cond is not None else None,
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
                waiting_subqueues=blocker.waiters[0].live + blocker.waiters[1].live,
                from_file=blocker.from_file,
            ))
        logs = self._logs()
        for ent in self._entries():
            cc, thresholds, _, key, grp = ent
            log = logs.of(grp)
            kind = _kind(thresholds, grp, log, now)
            if kind is None:
                continue
            out.append(SuspensionView(
                id=f"{cc.id}:{','.join(key)}",
                fields=tuple(zip(cc.names, key, strict=True)),
                automatic=True, expires_at=_free_at(thresholds, grp, log, now), tag=str(kind),
                reason=self._entry_text(ent, log, kind, now),
                waiting_subqueues=self._waiting(grp),
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

    def _entry_text(self, ent: _Ent, log: deque[float], kind: Waiting, now: float) -> str:
        cc, thresholds, cond, key, grp = ent
        keys = ", ".join(f"{n}={v or '(default)'}" for n, v in
                         zip(cc.names, key, strict=True)) or "all mail"
        why = f" (condition {cond.id or 'if ' + str(dict(cond.match))})" \
            if cond is not None else ""
        name = f"counter {cc.id} [{keys}]{why}"
        if kind is Waiting.CONCURRENCY:
            return f"{name}: {grp.inflight} in flight, concurrency {thresholds.concurrency}"
        if kind is Waiting.RATE and thresholds.rate is not None:
            return (f"{name}: {_rate_used(thresholds, log, now)} pickups in the last "
                    f"{thresholds.rate.per_s:g}s, rate {thresholds.rate}")
        return (f"{name}: connectinterval {thresholds.connectinterval_s or 0:g}s "
                "since the last pickup")

    def _blocker_text(self, blocker: _Blocker) -> str:
        now = self._now
        if isinstance(blocker, _Group):
            ents = self._group_entries((blocker,))
            log = self._logs().of(blocker)
            for ent in ents:
                kind = _kind(ent[1], blocker, log, now)
                if kind is not None:
                    return self._entry_text(ent, log, kind, now)
            if ents:
                return self._entry_text(ents[0], log, Waiting.CONCURRENCY, now)
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
        logs = self._logs()
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
            groups = sq.groups[i] if i < len(sq.groups) else ()
            for ent in self._group_entries(groups):
                cc, thresholds, _, key, grp = ent
                rate = thresholds.rate
                if rate is not None and rate.count:
                    spacing = max(spacing, rate.per_s / rate.count)
                if thresholds.connectinterval_s:
                    spacing = max(spacing, thresholds.connectinterval_s)
                log = logs.of(grp)
                kind = _kind(thresholds, grp, log, now)
                if kind is None:
                    continue
                free_at = _free_at(thresholds, grp, log, now)
                reasons.append(Reason(
                    kind, self._entry_text(ent, log, kind, now), localip=shown_ip,
                    counter=cc.id, key=tuple(zip(cc.names, key, strict=True)),
                    threshold=str(thresholds), current=str(grp.inflight),
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
