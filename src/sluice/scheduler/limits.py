"""Limits: the one seam through which the scheduler checks and counts a pickup.

SUMMARY
    limits.load(policy, now)              the counters (again, on a reload)
    binding = limits.bind(route, ip)      what a pickup from (route, ip) must pass
    entry = limits.holder(binding, now)   may it go now?  None: yes
    limits.record(binding, now)           it went: count it
    waited = limits.release(binding, now) its delivery finished; the entries
                                          sub-queues wait on, to wake
    limits.free(entry, now)               how many more the entry lets through now
    limits.next_slot_at(entry, now)       when it lets one more through (None: an
                                          event will say: a delivery finishing)

DESCRIPTION
    A *counter entry* (Entry) is one counter of the policy and one key,
    the values of the counter's fields for a delivery (or a condition's
    pattern, for all the values it matches: Counter.entry_key).  Its thresholds
    come from the counter's conditions (the first that matches) or its
    fall-back; its state is what was counted: deliveries in flight, the
    times of recent pickups, and the last pickup.  The scheduler knows
    entries only as blockers that sub-queues park on (sluice.scheduler.
    lines): it asks a Limits which entry holds a pickup, parks the
    sub-queue there, and asks free() and next_slot_at() when to wake it.

    The rules an entry follows are defined once, here (held, free,
    slot_at), and both implementations call them:

    ReferenceLimits   (limits_reference.py) keeps a dict of entries and
                      evaluates the policy afresh at every question: the
                      meaning, readable in a minute, and what the tests
                      compare the fast one with.
    GroupedLimits     (limits_grouped.py) compiles the policy, caches a
                      binding per sub-queue and source IP, and counts the
                      entries of counters over the same fields in one row:
                      a pickup checks a row in two comparisons.

    tests/property/test_limits_equivalence.py drives two schedulers, one
    with each, through the same random events and asserts the same
    commands and wake-ups.

STRATEGIES
    Leaky bucket (rate X/Y).  An entry keeps the times of its pickups; one
    more is allowed when the X-th latest is Y seconds old, so that no
    Y-second window ever holds more than X.  The time a slot frees is
    computed as ``times[-X] + Y``, the same sum the check compares with,
    so that a timer set for that time always finds the slot free.

    Reloads keep what still counts.  A counter that survives a reload
    (same id and fields) keeps, per key, the pickup times its old longest
    rate window holds and its last pickup if its old longest connect
    interval still covers it; in-flight counts are recounted from the
    deliveries in flight (the scheduler binds each again and calls
    recount()).  Any other counter starts empty.

LIMITS THAT ARE NOT HELD HERE
    The interface is synchronous and pure, so that the scheduler stays
    sans-IO, but nothing in it assumes the counts live in this process:

    - A limit changed at run time (a shaping rule backing off) is a
      condition with an expiry (ConditionAdded): load() runs again and the
      counter keeps its windows.
    - A cluster-wide limit keeps its counts elsewhere (Redis).  Its Limits
      wraps a local one and admits a pickup only against capacity granted
      ahead of time (leases of concurrency slots, a budget of rate tokens)
      that the runtime obtains asynchronously and reports with an event;
      holder() names the entry whose grant is used up, next_slot_at()
      gives the grant's renewal time (or None until the runtime reports
      more), and the scheduler's commands carry the requests for more.
      Nothing above this seam changes for that.

INVARIANTS
    After record(), holder() of the same binding answers as if the pickup
    had happened; release() undoes record()'s in-flight count exactly
    once.  free(entry) > 0 exactly when held(entry) is None.  Answers
    depend only on the policy, the events and ``now``, never on the
    implementation (the equivalence test).

SEE ALSO
    sluice.scheduler.scheduler (who asks), sluice.scheduler.policy (what
    a counter is), docs/scheduler.md
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from sluice.scheduler.events import Command, Event, Route
from sluice.scheduler.explanation import Waiting
from sluice.scheduler.lines import Blocker
from sluice.scheduler.policy import Condition, Counter, Policy, Thresholds

__all__ = [
    "NEVER",
    "Binding",
    "Entry",
    "EntryState",
    "Limits",
    "LocalOnly",
    "Tally",
    "destination_limit",
    "entry_key",
    "free",
    "held",
    "keeps",
    "slot_at",
    "used",
]

NEVER = math.inf
_MANY = 1 << 60


class Entry(Blocker):
    """One counter entry, as a blocker sub-queues park on.

    ``index`` is the counter's place in the policy: when several entries
    hold a pickup, the first in the policy is the one named.
    """

    __slots__ = ("counter", "index", "key", "owner")

    def __init__(self, owner: Limits[Any], counter: Counter, index: int,
                 key: tuple[str, ...]) -> None:
        super().__init__()
        self.owner = owner
        self.counter = counter
        self.index = index
        self.key = key

    def free(self, now: float) -> int:
        """How many more pickups the entry lets through now."""
        return self.owner.free(self, now)

    def free_at(self, now: float) -> float | None:
        """When the entry, held by a rate or an interval, frees a slot."""
        return self.owner.next_slot_at(self, now)

    @property
    def fields(self) -> tuple[tuple[str, str], ...]:
        """The entry's key as (field, value) pairs of its counter."""
        return tuple(zip(self.counter.field_names, self.key, strict=True))

    def __repr__(self) -> str:
        return f"Entry({self.counter.id}, {self.key})"


class Tally:
    """What an entry counted: in flight, recent pickup times, the last pickup."""

    __slots__ = ("inflight", "last_at", "times")

    def __init__(self) -> None:
        self.inflight = 0
        self.times: deque[float] = deque()
        self.last_at = -NEVER

    def forget(self, rate_keep_s: float, interval_keep_s: float, now: float) -> None:
        """Drop what windows of these lengths no longer hold at ``now``."""
        times = self.times
        while times and times[0] + rate_keep_s <= now:
            times.popleft()
        if self.last_at + interval_keep_s <= now:
            self.last_at = -NEVER


# --------------------------------------------------------------------------
# The rules of one entry: defined once, used by every implementation.


def held(th: Thresholds, inflight: int, times: Sequence[float], last_at: float,
         now: float) -> Waiting | None:
    """What, if anything, stops one more pickup of an entry now."""
    conc = th.concurrency
    if conc is not None and inflight >= conc:
        return Waiting.CONCURRENCY
    rate = th.rate
    if rate is not None:
        n = rate.count
        if n == 0 or (len(times) >= n and times[-n] + rate.per_s > now):
            return Waiting.RATE
    interval = th.connectinterval_s
    if interval and now < last_at + interval:
        return Waiting.CONNECTINTERVAL
    return None


def free(th: Thresholds, inflight: int, times: Sequence[float], last_at: float,
         now: float) -> int:
    """How many more pickups an entry lets through now (0 while held)."""
    if held(th, inflight, times, last_at, now) is not None:
        return 0
    room = _MANY
    if th.concurrency is not None:
        room = th.concurrency - inflight
    rate = th.rate
    if rate is not None:
        room = min(room, rate.count - used(th, times, now))
    if th.connectinterval_s:
        room = min(room, 1)
    return room


def slot_at(th: Thresholds, inflight: int, times: Sequence[float], last_at: float,
            now: float) -> float | None:
    """When an entry held by a rate or an interval lets one more through.

    None while its concurrency is full (a finishing delivery will say), for
    a rate of 0, or when nothing timed holds it.
    """
    conc = th.concurrency
    if conc is not None and inflight >= conc:
        return None
    at = now
    rate = th.rate
    if rate is not None:
        n = rate.count
        if n == 0:
            return None
        if len(times) >= n:
            at = max(at, times[-n] + rate.per_s)
    interval = th.connectinterval_s
    if interval:
        at = max(at, last_at + interval)
    return at if at > now else None


def used(th: Thresholds, times: Sequence[float], now: float) -> int:
    """Pickups in the entry's rate window now."""
    rate = th.rate
    if rate is None:
        return 0
    return sum(1 for t in times if t + rate.per_s > now)


def keeps(counter: Counter) -> tuple[float, float]:
    """How long a counter's entries must remember pickups.

    Its longest rate window, and its longest connect interval (0: not at
    all).
    """
    every = (counter.default, *(c.thresholds for c in counter.conditions))
    rate = max((t.rate.per_s for t in every if t.rate is not None), default=0.0)
    interval = max((t.connectinterval_s or 0.0 for t in every), default=0.0)
    return rate, interval


def destination_limit(concurrencies: Iterable[int]) -> int:
    """The policy's limit for a destination from one source IP.

    The tightest concurrency among the counters over a destination field
    that apply (0: none does; a concurrency of 0 stops the pickups anyway).
    """
    return min((c for c in concurrencies if c > 0), default=0)


def entry_key(counter: Counter, route: Route, ip: str) -> tuple[str, ...]:
    """The key of ``counter``'s entry for a delivery of ``route`` from ``ip``.

    The values of its fields (a group's ``#id`` for a value in a group),
    pooled under a condition's pattern where the condition chosen names
    one (Counter.entry_key).
    """
    key = tuple(spec.component(route.value(spec.name, ip)) if spec.groups
                else route.value(spec.name, ip) for spec in counter.fields)
    return counter.entry_key(key) if counter.pooling else key


# --------------------------------------------------------------------------
# The interface.


@dataclass(frozen=True, slots=True)
class EntryState:
    """An entry against its thresholds, for the views and explanations."""

    entry: Entry
    thresholds: Thresholds
    condition: Condition | None
    inflight: int
    rate_used: int
    last_at: float
    held: Waiting | None
    free_at: float | None


class Binding(Protocol):
    """What a pickup from one route and source IP must pass."""

    @property
    def entries(self) -> tuple[Entry, ...]:
        """Its entries, in the policy's order of counters."""

    @property
    def destination_limit(self) -> int:
        """The tightest concurrency that counters over a destination field set (0: none does)."""


B = TypeVar("B", bound=Binding)


class Limits(Protocol[B]):
    """The checking and counting of pickups against the policy's thresholds.

    ``B`` is the implementation's own Binding: the scheduler only hands
    back what bind() gave it.
    """

    def load(self, policy: Policy, now: float) -> None:
        """Take a policy (first, or on a reload); every binding is void."""

    def bind(self, route: Route, ip: str) -> B:
        """The entries a pickup from ``route`` and ``ip`` counts in."""

    def unbind(self, binding: B) -> None:
        """The caller no longer uses ``binding`` (memory may be reclaimed)."""

    def holder(self, binding: B, now: float) -> Entry | None:
        """None if the pickup may go now; else the first entry that holds it."""

    def record(self, binding: B, now: float) -> None:
        """A pickup went at ``now``: count it in flight and in every window."""

    def recount(self, binding: B) -> None:
        """After load(): a delivery still in flight counts in ``binding``."""

    def release(self, binding: B, now: float) -> list[Entry]:
        """A delivery that record() counted finished.

        Returns the entries of ``binding`` that sub-queues have waited on
        (their lines exist), in the policy's order: the caller releases them.
        """

    def free(self, entry: Entry, now: float) -> int:
        """How many more pickups ``entry`` lets through now."""

    def next_slot_at(self, entry: Entry, now: float) -> float | None:
        """When ``entry``, held by a rate or an interval, frees a slot."""

    def state(self, entry: Entry, now: float) -> EntryState:
        """``entry`` against its thresholds."""

    def states(self, now: float) -> Iterator[EntryState]:
        """Every entry that is remembered, for the views."""

    def count(self) -> int:
        """How many entries are remembered (cheaply, for /metrics)."""

    def collect(self, now: float) -> None:
        """Forget what nothing uses and no window holds (called once per step)."""

    def handle(self, event: Event, now: float) -> list[Entry]:
        """An event for limits held elsewhere (GrantsChanged, ClusterModeChanged).

        Returns the entries that may have room now.
        """

    def outbox(self, now: float) -> list[Command]:
        """What the runtime should ask of limits held elsewhere, after a step."""

    def wakeup(self) -> float | None:
        """When the limits next need a step of their own (None: never)."""


class LocalOnly:
    """The three Limits methods for limits held wholly in this process.

    No event concerns them, nothing is asked of anyone, no step of their
    own.
    """

    def handle(self, event: Event, now: float) -> list[Entry]:
        """No event concerns local limits: nothing has room because of one."""
        return []

    def outbox(self, now: float) -> list[Command]:
        """Local limits ask nothing of anyone."""
        return []

    def wakeup(self) -> float | None:
        """Local limits need no step of their own."""
        return None
