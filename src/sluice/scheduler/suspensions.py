"""Suspensions: pickup stopped for every delivery that matches some fields.

SUMMARY
    susps = Suspensions()
    blocker = susps.add(suspension, now, from_file)   (None if it expired already)
    blocker = susps.remove(id)                         (lifted: release its waiters)
    found = susps.lookup(route, ips)                   one per source IP, or None

DESCRIPTION
    A suspension names fields and values (``recipientdomain=gmail.com``,
    ``localip=192.0.2.1`` and ``tenantid=t1``); a sub-queue whose route
    matches all of them waits on it, per source IP: a pool of source IPs
    sends from the IPs that are not suspended (seed 004, "Excluding IPs
    from pool").  They come from the policy file (replaced on a reload),
    from an operator at run time, or from a rule; each may expire.

STRATEGIES
    Index by the fields named.  Suspensions are kept in one dict per set
    of field names, keyed by their values: a look-up is one dict probe per
    distinct set of names, not one test per suspension.  A sub-queue
    caches what it found with the registry's version, which every add and
    remove bumps.

    Patterns are scanned.  A suspension whose remotemx or recipientdomain
    is a host name pattern (``remotemx=*.google.com``: every Gmail MX host)
    cannot be found by a probe; those few are also kept apart and tested
    one by one, after the probes found nothing.  The scan runs only when
    the registry's version moved, like every look-up of a sub-queue.

    One suspension per set of values (Halon).  Adding one whose fields and
    values match an existing suspension only moves its expiry (and tag and
    reason): the running one stays, with its id and waiters.

SEE ALSO
    sluice.scheduler.policy.Suspension (the data), sluice.scheduler.scheduler
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence

from sluice.scheduler.events import Route
from sluice.scheduler.lines import Blocker
from sluice.scheduler.policy import Suspension

__all__ = ["Suspended", "Suspensions"]

_MANY = 1 << 60


class Suspended(Blocker):
    """A suspension in force, as a blocker; it lets everything through once lifted."""

    __slots__ = ("from_file", "lifted", "suspension")

    def __init__(self, suspension: Suspension, from_file: bool) -> None:
        super().__init__()
        self.suspension = suspension
        self.from_file = from_file
        self.lifted = False

    def free(self, now: float) -> int:
        """Room for everything once lifted; none while in force."""
        return _MANY if self.lifted else 0

    def __repr__(self) -> str:
        return f"Suspended({self.suspension.id})"


class Suspensions:
    """The suspensions in force, by id and indexed by the fields they name."""

    __slots__ = ("by_id", "index", "patterned", "version")

    def __init__(self) -> None:
        self.by_id: dict[str, Suspended] = {}
        self.index: dict[tuple[str, ...], dict[tuple[str, ...], Suspended]] = {}
        #: The suspensions that name a pattern, by id (also in ``index``).
        self.patterned: dict[str, Suspended] = {}
        self.version = 0

    def check(self, susp: Suspension) -> None:
        """Raise ValueError if add() would refuse ``susp``."""
        known = self.by_id.get(susp.id)
        same = self.index.get(susp.field_names, {}).get(susp.values)
        if known is not None and known is not same:
            raise ValueError(f"a suspension with id {susp.id!r} exists with other fields")

    def add(self, susp: Suspension, now: float, from_file: bool) -> Suspended | None:
        """Put ``susp`` in force (or move the expiry of the one that matches).

        Returns the blocker, whose expiry the caller times; None if it had
        expired already (nothing is added).
        """
        self.check(susp)
        index = self.index.setdefault(susp.field_names, {})
        old = index.get(susp.values)
        if old is not None:
            old.suspension = Suspension(susp.fields, old.suspension.id, susp.expires_at,
                                        susp.tag or old.suspension.tag,
                                        susp.reason or old.suspension.reason)
            old.from_file = old.from_file and from_file
            return old
        if susp.expires_at is not None and susp.expires_at <= now:
            if not index:
                del self.index[susp.field_names]
            return None
        blocker = Suspended(susp, from_file)
        index[susp.values] = blocker
        self.by_id[susp.id] = blocker
        if susp.is_pattern:
            self.patterned[susp.id] = blocker
        self.version += 1
        return blocker

    def remove(self, sid: str) -> Suspended | None:
        """Lift a suspension; the caller releases its waiters."""
        blocker = self.by_id.pop(sid, None)
        if blocker is None:
            return None
        self.patterned.pop(sid, None)
        susp = blocker.suspension
        index = self.index.get(susp.field_names)
        if index is not None:
            index.pop(susp.values, None)
            if not index:
                del self.index[susp.field_names]
        self.version += 1
        blocker.lifted = True
        return blocker

    def lookup(self, route: Route, ips: Sequence[str]) -> list[Suspended | None]:
        """Per source IP, the suspension that holds a delivery from it, if any."""
        found: list[Suspended | None] = []
        for ip in ips:
            hit: Suspended | None = None
            for names, index in self.index.items():
                hit = index.get(tuple(route.value(n, ip) for n in names))
                if hit is not None:
                    break
            if hit is None and self.patterned:
                value = functools.partial(route.value, localip=ip)
                hit = next((b for b in self.patterned.values() if b.suspension.matches(value)),
                           None)
            found.append(hit)
        return found

    def is_due(self, blocker: Suspended, at: float) -> bool:
        """Whether a timer set for ``at`` still expires ``blocker``."""
        return (not blocker.lifted and self.by_id.get(blocker.suspension.id) is blocker
                and blocker.suspension.expires_at == at)

    def __iter__(self) -> Iterator[Suspended]:
        return iter(self.by_id.values())

    def __len__(self) -> int:
        return len(self.by_id)
