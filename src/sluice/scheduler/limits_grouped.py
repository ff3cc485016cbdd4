"""GroupedLimits: the limits seam as the scheduler serves it, compiled and grouped.

SUMMARY
    Scheduler(settings, policy)              (the default Limits)

DESCRIPTION
    The policy is compiled once per load: each counter's conditions become
    matchers over a key tuple, and each field with groups keeps a memo of
    its look-ups (value -> ``#group``), so that a regex runs once per
    distinct value, not once per delivery.

STRATEGIES
    Counting in rows.  Counters over the same fields that entered the
    policy together (a *table*) key a delivery alike, so their entries for
    one key are counted by exactly the same deliveries: they are one
    *row*, with one in-flight count, one list of pickup times and one last
    pickup, and the tightest limits of its entries kept ready -- the
    smallest concurrency (``conc``) and the time until which a rate or an
    interval holds the next pickup (``busy``, computed when a pickup is
    counted).  A pickup checks each row of its binding in two comparisons;
    only a pickup that is held looks at the entries one by one, to name
    the first in the policy (as ReferenceLimits would).

    Bindings are cached by the caller (one per sub-queue and source IP),
    so a pickup computes no key and evaluates no condition.

    Pooled entries are rows too.  A condition that names a pattern keys
    the entries it chooses by the pattern (Counter.entry_key): the binding
    of every matching host gets the same row, so they share its counts.
    Counters in a table must key alike, so a table holds counters with the
    same fields *and* the same pooling (Counter.pooling); a counter whose
    pooling changes with a condition added or removed leaves a table it
    shared for one of its own, seeded with the rows' windows.

    Reloads keep rows.  A counter that survives with the same fields and
    the same memory (longest rate window and connect interval) stays in
    its table, whose rows keep their counts; one whose memory changes gets
    a table of its own, seeded with what its old windows held; new
    counters get new tables.  Rows' thresholds are worked out again.

    Forgetting.  A row no binding uses and nothing is in flight for is
    forgotten once its windows are over (a heap by the time that happens),
    so memory follows the sub-queues and deliveries, not the history.

INVARIANTS
    row.conc is the smallest concurrency of its entries; now < row.busy
    exactly when a rate or an interval of one of its entries holds a
    pickup at ``now``; row.users counts the live bindings that use it.

SEE ALSO
    sluice.scheduler.limits (the interface and the rules),
    sluice.scheduler.limits_reference (the meaning)
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from sluice.scheduler import limits
from sluice.scheduler.events import Route
from sluice.scheduler.limits import NEVER, Entry, EntryState, LocalOnly
from sluice.scheduler.policy import (
    CASELESS_FIELDS,
    Condition,
    Counter,
    FieldSpec,
    Pattern,
    Policy,
    Thresholds,
    key_fits,
    pooled_key,
)

__all__ = ["GroupedLimits"]

_MANY = 1 << 60
_MEMO_MAX = 100_000

_Matcher = tuple[tuple[int, str | Pattern], ...]

#: The pickup times of every row that has none (an empty deque costs 600 bytes).
_NO_TIMES: deque[float] = deque(maxlen=0)


class _Member:
    """A counter of a table, compiled."""

    __slots__ = ("counter", "index", "keeps", "matchers")

    def __init__(self, counter: Counter, index: int) -> None:
        self.counter = counter
        self.index = index
        self.keeps = limits.keeps(counter)
        self.matchers: tuple[tuple[_Matcher, Condition], ...] = tuple(
            (_compile(c, counter.field_names), c) for c in counter.conditions)

    def pick(self, key: tuple[str, ...]) -> int:
        """The index of the first condition ``key`` meets; -1: the fall-back."""
        for n, (matcher, _) in enumerate(self.matchers):
            if key_fits(matcher, key):
                return n
        return -1

    def chosen(self, n: int) -> tuple[Thresholds, Condition | None]:
        if n < 0:
            return self.counter.default, None
        cond = self.matchers[n][1]
        return cond.thresholds, cond


def _compile(cond: Condition, names: tuple[str, ...]) -> _Matcher:
    out: list[tuple[int, str | Pattern]] = []
    for name, value in cond.match:
        pos = names.index(name)
        if Pattern.is_pattern(value):
            out.append((pos, Pattern.compile(value)))
        elif value.startswith("#") or name not in CASELESS_FIELDS:
            out.append((pos, value))
        else:
            out.append((pos, value.lower()))
    return tuple(out)


class _Entry(Entry):
    __slots__ = ("row", "slot")

    def __init__(self, owner: GroupedLimits, member: _Member, key: tuple[str, ...], row: _Row,
                 slot: int) -> None:
        super().__init__(owner, member.counter, member.index, key)
        self.row = row
        self.slot = slot  # its place in the table's members


class _Profile:
    """The thresholds one key gets under each counter of a table.

    Shared by every key for which the same conditions (or fall-backs) are
    chosen.
    """

    __slots__ = ("conc", "conds", "dest_concs", "ths")

    def __init__(self, members: tuple[_Member, ...],
                 chosen: list[tuple[Thresholds, Condition | None]]) -> None:
        self.ths = tuple(th for th, _ in chosen)
        self.conds = tuple(cond for _, cond in chosen)
        self.dest_concs = tuple(th.concurrency for m, th in zip(members, self.ths, strict=True)
                                if m.counter.limits_destination and th.concurrency is not None)
        self.conc = min((th.concurrency for th in self.ths if th.concurrency is not None),
                        default=_MANY)


class _Row:
    """The entries of one key of a table, counted once.

    Its Entry objects (blockers) are made when first asked for -- most
    rows never hold anything -- and its pickup times only once a counter
    of its table has a rate.
    """

    __slots__ = ("busy", "conc", "inflight", "key", "last_at", "made", "prof", "table", "times",
                 "users")

    def __init__(self, table: _Table, key: tuple[str, ...]) -> None:
        self.table = table
        self.key = key
        self.inflight = 0
        self.times: deque[float] = _NO_TIMES
        self.last_at = -NEVER
        self.users = 0
        self.prof: _Profile = table.no_profile
        self.made: list[_Entry | None] | None = None
        self.conc = _MANY
        self.busy = -NEVER

    def compile(self) -> None:
        """Work out the thresholds of its entries (a new row, a reload)."""
        self.prof = self.table.profile(self.key)
        self.conc = self.prof.conc
        self.made = None  # a reload voids the old blockers
        self.stamp()

    def entry(self, slot: int) -> _Entry:
        """The blocker of its entry ``slot`` (made once)."""
        made = self.made
        if made is None:
            made = self.made = [None] * len(self.prof.ths)
        entry = made[slot]
        if entry is None:
            entry = made[slot] = _Entry(self.table.owner, self.table.members[slot], self.key,
                                        self, slot)
        return entry

    def peek(self, slot: int) -> _Entry:
        """Its entry ``slot`` for a view: the blocker if made, else a stand-in."""
        if self.made is not None and self.made[slot] is not None:
            return self.entry(slot)
        return _Entry(self.table.owner, self.table.members[slot], self.key, self, slot)

    def stamp(self) -> None:
        """Until when a rate or an interval holds the next pickup."""
        busy = -NEVER
        times = self.times
        for th in self.prof.ths:
            rate = th.rate
            if rate is not None:
                n = rate.count
                if n == 0:
                    busy = NEVER
                elif len(times) >= n:
                    at = times[-n] + rate.per_s
                    if at > busy:
                        busy = at
            interval = th.connectinterval_s
            if interval:
                at = self.last_at + interval
                if at > busy:
                    busy = at
        self.busy = busy

    def keep_until(self) -> float:
        rate_keep, interval_keep = self.table.keeps
        at = self.last_at + interval_keep if interval_keep else -NEVER
        if self.times:
            at = max(at, self.times[-1] + rate_keep)
        return at


class _Table:
    """Counters over the same fields with the same history, and their rows."""

    __slots__ = ("keeps", "members", "no_profile", "owner", "pool", "profiles", "rows", "specs")

    def __init__(self, owner: GroupedLimits, members: list[_Member]) -> None:
        self.owner = owner
        self.rows: dict[tuple[str, ...], _Row] = {}
        self.profiles: dict[tuple[int, ...], _Profile] = {}
        self.members: tuple[_Member, ...] = ()
        self.keeps = (0.0, 0.0)
        # The conditions that key its rows, when one pools (all members' are alike).
        self.pool: tuple[_Matcher, ...] = ()
        # Per field: its spec, and for a field with groups, the memo of its look-ups.
        self.specs: tuple[tuple[FieldSpec, dict[str, str] | None], ...] = ()
        self.take(members)

    def take(self, members: list[_Member]) -> None:
        self.members = tuple(members)
        self.keeps = (max(m.keeps[0] for m in members), max(m.keeps[1] for m in members))
        first = members[0]
        self.pool = tuple(m for m, _ in first.matchers) if first.counter.pooling else ()
        self.profiles = {}
        self.no_profile = _Profile((), [])

    def profile(self, key: tuple[str, ...]) -> _Profile:
        """The thresholds of ``key``, shared with every key that chooses alike."""
        picks = tuple(m.pick(key) for m in self.members)
        prof = self.profiles.get(picks)
        if prof is None:
            prof = self.profiles[picks] = _Profile(self.members, [
                m.chosen(n) for m, n in zip(self.members, picks, strict=True)])
        return prof


@dataclass(frozen=True, slots=True)
class _Binding:
    rows: tuple[_Row, ...]  # one per table, in the order of GroupedLimits.tables
    order: tuple[tuple[int, int], ...]  # (table, slot) per entry, in the policy's order
    destination_limit: int
    generation: int

    @property
    def entries(self) -> tuple[_Entry, ...]:
        rows = self.rows
        return tuple(rows[t].entry(slot) for t, slot in self.order)


class GroupedLimits(LocalOnly):
    """Compiled counters; entries of counters over the same fields in one row."""

    def __init__(self) -> None:
        self.policy = Policy()
        self.tables: list[_Table] = []
        self.order: tuple[tuple[int, int], ...] = ()
        self.generation = 0
        # Per field with groups (by its signature): raw value -> key component.
        self.memos: dict[str, dict[str, str]] = {}
        self.gc: list[tuple[float, int, _Row]] = []
        self.seq = 0

    # ------------------------------------------------------------ policy

    def load(self, policy: Policy, now: float) -> None:
        """Limits.load: tables of unchanged counters stay, the rest are compiled anew."""
        placed: dict[tuple[str, str], tuple[_Table, tuple[float, float]]] = {}
        for table in self.tables:
            for m in table.members:
                placed[(m.counter.id, m.counter.signature)] = (table, m.keeps)
        stays: dict[tuple[int, object], tuple[_Table, list[_Member]]] = {}
        fresh: dict[tuple[str, object], list[_Member]] = {}
        seeded: list[_Table] = []
        for index, counter in enumerate(policy.counters):
            member = _Member(counter, index)
            found = placed.get((counter.id, counter.signature))
            if found is None:
                fresh.setdefault((counter.signature, counter.pooling), []).append(member)
            elif found[1] == member.keeps:
                stays.setdefault((id(found[0]), counter.pooling), (found[0], []))[1].append(member)
            else:
                seeded.append(self._seed(found[0], found[1], [member], now))
        tables: list[_Table] = []
        kept = {id(t): t.keeps for t in self.tables}  # before take() changes them
        taken: set[int] = set()
        for table, members in stays.values():
            if id(table) in taken:
                # Its pooling parted it from the counters it shared the table with.
                seeded.append(self._seed(table, kept[id(table)], members, now))
                continue
            taken.add(id(table))
            table.take(members)
            for row in table.rows.values():
                row.inflight = 0  # recounted from the deliveries in flight
                row.users = 0
                row.compile()
            tables.append(table)
        tables += seeded
        tables += [_Table(self, members) for members in fresh.values()]
        for table in tables:
            table.specs = tuple(
                (spec, self.memos.setdefault(spec.signature, {}) if spec.groups else None)
                for spec in table.members[0].counter.fields)
        self.tables = tables
        self.order = tuple(sorted(((t, slot) for t, table in enumerate(tables)
                                   for slot in range(len(table.members))),
                                  key=lambda o: tables[o[0]].members[o[1]].index))
        self.policy = policy
        self.generation += 1
        self.gc = []
        for table in tables:
            for row in table.rows.values():
                self._forget_later(row)

    def _seed(self, old: _Table, keeps: tuple[float, float], members: list[_Member],
              now: float) -> _Table:
        """A table for surviving counters whose memory or pooling changed.

        Its rows start with what the old windows hold now.
        """
        table = _Table(self, members)
        rate_keep, interval_keep = keeps
        for key, old_row in old.rows.items():
            row = _Row(table, key)
            times = [t for t in old_row.times if t + rate_keep > now]
            if times:
                row.times = deque(times)
            if old_row.last_at + interval_keep > now:
                row.last_at = old_row.last_at
            row.compile()
            table.rows[key] = row
        return table

    # ----------------------------------------------------------- binding

    def _key(self, table: _Table, route: Route, ip: str) -> tuple[str, ...]:
        parts = []
        for spec, memo in table.specs:
            raw = route.value(spec.name, ip)
            if memo is not None:
                value = memo.get(raw)
                if value is None:
                    if len(memo) >= _MEMO_MAX:
                        memo.clear()
                    value = memo[raw] = spec.component(raw)
                raw = value
            parts.append(raw)
        for matcher in table.pool:
            if key_fits(matcher, parts):
                return pooled_key(matcher, parts)
        return tuple(parts)

    def bind(self, route: Route, ip: str) -> _Binding:
        """Limits.bind: the route's row in every table, made if new."""
        rows = []
        concs: list[int] = []
        for table in self.tables:
            key = self._key(table, route, ip)
            row = table.rows.get(key)
            if row is None:
                row = table.rows[key] = _Row(table, key)
                row.compile()
            row.users += 1
            rows.append(row)
            concs += row.prof.dest_concs
        return _Binding(tuple(rows), self.order, limits.destination_limit(concs),
                        self.generation)

    def unbind(self, binding: _Binding) -> None:
        """Limits.unbind: a row nothing uses any more is forgotten later."""
        if binding.generation != self.generation:
            return  # a load() voided it
        for row in binding.rows:
            row.users -= 1
            if not row.users and not row.inflight:
                self._forget_later(row)

    # ---------------------------------------------------------- pickups

    def holder(self, binding: _Binding, now: float) -> Entry | None:
        """Limits.holder: the first entry in the policy's order of the rows that hold."""
        for row in binding.rows:
            if row.inflight >= row.conc or now < row.busy:
                break
        else:
            return None
        rows = binding.rows
        for t, slot in binding.order:  # the first in the policy's order
            row = rows[t]
            if limits.held(row.prof.ths[slot], row.inflight, row.times, row.last_at,
                           now) is not None:
                return row.entry(slot)
        raise RuntimeError(f"broken invariant: a row of {binding} is full, but no entry")

    def record(self, binding: _Binding, now: float) -> None:
        """Limits.record, per row: in flight, last pickup, and the rate window's times."""
        for row in binding.rows:
            row.inflight += 1
            row.last_at = now
            rate_keep = row.table.keeps[0]
            if rate_keep:
                times = row.times
                if times is _NO_TIMES:
                    row.times = times = deque()
                times.append(now)
                while times[0] + rate_keep <= now:
                    times.popleft()
            row.stamp()

    def recount(self, binding: _Binding) -> None:
        """Limits.recount: the rows count the delivery in flight again."""
        for row in binding.rows:
            row.inflight += 1

    def release(self, binding: _Binding, now: float) -> list[Entry]:
        """Limits.release, per row; releasing more than was recorded is a broken invariant."""
        if binding.generation != self.generation:
            raise RuntimeError("broken invariant: a delivery released a binding of an old policy")
        waited: list[_Entry] = []
        for row in binding.rows:
            if row.inflight <= 0:
                raise RuntimeError(f"broken invariant: row {row.key} released more than recorded")
            row.inflight -= 1
            if row.made is not None:
                waited += (e for e in row.made if e is not None and e.waiters is not None)
            if not row.inflight and not row.users:
                self._forget_later(row)
        if len(waited) > 1:
            waited.sort(key=lambda e: e.index)
        return list(waited)

    # ------------------------------------------------------------ entries

    @staticmethod
    def _parts(entry: Entry) -> tuple[_Row, Thresholds]:
        assert isinstance(entry, _Entry)
        return entry.row, entry.row.prof.ths[entry.slot]

    def free(self, entry: Entry, now: float) -> int:
        """Limits.free, from the entry's row and thresholds."""
        row, th = self._parts(entry)
        return limits.free(th, row.inflight, row.times, row.last_at, now)

    def next_slot_at(self, entry: Entry, now: float) -> float | None:
        """Limits.next_slot_at, from the entry's row and thresholds."""
        row, th = self._parts(entry)
        return limits.slot_at(th, row.inflight, row.times, row.last_at, now)

    def state(self, entry: Entry, now: float) -> EntryState:
        """Limits.state, from the entry's row and thresholds."""
        row, th = self._parts(entry)
        assert isinstance(entry, _Entry)
        return EntryState(entry, th, row.prof.conds[entry.slot], row.inflight,
                          limits.used(th, row.times, now), row.last_at,
                          limits.held(th, row.inflight, row.times, row.last_at, now),
                          limits.slot_at(th, row.inflight, row.times, row.last_at, now))

    def states(self, now: float) -> Iterator[EntryState]:
        """Limits.states: every entry of every row, table by table in the policy's order."""
        for table in sorted(self.tables, key=lambda t: t.members[0].index):
            for row in list(table.rows.values()):
                for slot in range(len(table.members)):
                    yield self.state(row.peek(slot), now)

    def count(self) -> int:
        """Limits.count: rows times counters, over every table."""
        return sum(len(t.rows) * len(t.members) for t in self.tables)

    # ----------------------------------------------------------- memory

    def _forget_later(self, row: _Row) -> None:
        self.seq += 1
        heapq.heappush(self.gc, (row.keep_until(), self.seq, row))

    def collect(self, now: float) -> None:
        """Limits.collect: drop the rows due for forgetting that nothing uses or holds."""
        gc = self.gc
        while gc and gc[0][0] <= now:
            _, _, row = heapq.heappop(gc)
            if row.users or row.inflight or row.keep_until() > now:
                continue
            rows = row.table.rows
            if rows.get(row.key) is row:
                del rows[row.key]
