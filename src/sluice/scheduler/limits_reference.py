"""ReferenceLimits: the limits seam, plainly, for reading and for comparing.

SUMMARY
    Scheduler(settings, policy, limits=ReferenceLimits())

DESCRIPTION
    Every counter entry is a Tally in a dict keyed by (counter id, the
    counter's fields, key); the key is limits.entry_key's, pooled under a
    condition's pattern where one is chosen.  Every question evaluates the
    policy afresh:
    the entry's thresholds are the counter's first matching condition or
    its fall-back (Counter.thresholds_for), compared with the tally by the
    rules in sluice.scheduler.limits.  Nothing is cached but the keys of a
    binding and the Entry objects (which must stay the same objects,
    because sub-queues wait on them).

LIMITATIONS
    Slow on purpose (a policy evaluation per entry per question), and it
    never forgets an entry: for tests and for reading, not for serving.

SEE ALSO
    sluice.scheduler.limits (the interface and the rules),
    sluice.scheduler.limits_grouped (the one that serves),
    tests/property/test_limits_equivalence.py
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from sluice.scheduler import limits
from sluice.scheduler.events import Route
from sluice.scheduler.limits import Entry, EntryState, LocalOnly, Tally
from sluice.scheduler.policy import Policy, Thresholds

__all__ = ["ReferenceLimits"]

_Ident = tuple[str, str, tuple[str, ...]]  # counter id, signature, key


@dataclass(frozen=True, slots=True)
class _Binding:
    entries: tuple[Entry, ...]
    destination_limit: int


def _ident(entry: Entry) -> _Ident:
    return entry.counter.id, entry.counter.signature, entry.key


class ReferenceLimits(LocalOnly):
    """Every answer computed from the policy and the tallies, as written."""

    def __init__(self) -> None:
        self.policy = Policy()
        self.tallies: dict[_Ident, Tally] = {}
        self.entries: dict[_Ident, Entry] = {}

    def load(self, policy: Policy, now: float) -> None:
        """Limits.load: tallies of unchanged counters stay, with what their windows hold."""
        old = {(c.id, c.signature): limits.keeps(c) for c in self.policy.counters}
        new = {(c.id, c.signature) for c in policy.counters}
        kept: dict[_Ident, Tally] = {}
        for ident, tally in self.tallies.items():
            keep = old.get(ident[:2])
            if keep is None or ident[:2] not in new:
                continue  # the counter is gone (or changed its fields): it starts empty
            tally.forget(keep[0], keep[1], now)
            tally.inflight = 0  # the scheduler recounts the deliveries in flight
            kept[ident] = tally
        self.tallies = kept
        self.entries = {}
        self.policy = policy

    def bind(self, route: Route, ip: str) -> _Binding:
        """Limits.bind: the entry of every counter for the route, made if new."""
        entries = []
        concs = []
        for index, counter in enumerate(self.policy.counters):
            key = limits.entry_key(counter, route, ip)
            ident = (counter.id, counter.signature, key)
            entry = self.entries.get(ident)
            if entry is None:
                entry = self.entries[ident] = Entry(self, counter, index, key)
                self.tallies.setdefault(ident, Tally())
            entries.append(entry)
            thresholds, _ = counter.thresholds_for(key)
            if counter.limits_destination and thresholds.concurrency is not None:
                concs.append(thresholds.concurrency)
        return _Binding(tuple(entries), limits.destination_limit(concs))

    def unbind(self, binding: _Binding) -> None:
        """Limits.unbind: nothing to reclaim here."""
        pass

    def _look(self, entry: Entry) -> tuple[Thresholds, Tally]:
        thresholds, _ = entry.counter.thresholds_for(entry.key)
        return thresholds, self.tallies[_ident(entry)]

    def holder(self, binding: _Binding, now: float) -> Entry | None:
        """Limits.holder: the first entry whose thresholds hold the pickup."""
        for entry in binding.entries:
            th, t = self._look(entry)
            if limits.held(th, t.inflight, t.times, t.last_at, now) is not None:
                return entry
        return None

    def record(self, binding: _Binding, now: float) -> None:
        """Limits.record, per entry's tally."""
        for entry in binding.entries:
            t = self.tallies[_ident(entry)]
            rate_keep, _ = limits.keeps(entry.counter)
            t.inflight += 1
            t.last_at = now
            t.times.append(now)
            while t.times and t.times[0] + rate_keep <= now:
                t.times.popleft()

    def recount(self, binding: _Binding) -> None:
        """Limits.recount: the tallies count the delivery in flight again."""
        for entry in binding.entries:
            self.tallies[_ident(entry)].inflight += 1

    def release(self, binding: _Binding, now: float) -> list[Entry]:
        """Limits.release, per tally; releasing more than was recorded is a broken invariant."""
        for entry in binding.entries:
            t = self.tallies[_ident(entry)]
            if t.inflight <= 0:
                raise RuntimeError(f"broken invariant: {entry} released more than recorded")
            t.inflight -= 1
        return [e for e in binding.entries if e.waiters is not None]

    def free(self, entry: Entry, now: float) -> int:
        """Limits.free, from the entry's thresholds and tally."""
        th, t = self._look(entry)
        return limits.free(th, t.inflight, t.times, t.last_at, now)

    def next_slot_at(self, entry: Entry, now: float) -> float | None:
        """Limits.next_slot_at, from the entry's thresholds and tally."""
        th, t = self._look(entry)
        return limits.slot_at(th, t.inflight, t.times, t.last_at, now)

    def state(self, entry: Entry, now: float) -> EntryState:
        """Limits.state, the thresholds chosen for the entry's key as written."""
        th, cond = entry.counter.thresholds_for(entry.key)
        t = self.tallies[_ident(entry)]
        return EntryState(entry, th, cond, t.inflight, limits.used(th, t.times, now), t.last_at,
                          limits.held(th, t.inflight, t.times, t.last_at, now),
                          limits.slot_at(th, t.inflight, t.times, t.last_at, now))

    def states(self, now: float) -> Iterator[EntryState]:
        """Limits.states, in the policy's order."""
        for entry in sorted(self.entries.values(), key=lambda e: (e.index, e.key)):
            yield self.state(entry, now)

    def count(self) -> int:
        """Limits.count: every entry made so far."""
        return len(self.entries)

    def collect(self, now: float) -> None:
        """Limits.collect: the reference forgets nothing."""
        pass

