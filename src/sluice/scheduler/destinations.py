"""Destinations: slow start, cohort failure and the destination status cache.

SUMMARY
    dests = Destinations(settings)
    dest = dests.get(name)                 (made on first use)
    died = dests.finished(dest, failed, reply, now)
    dests.revive(dest) / dests.forget(dest, now)

DESCRIPTION
    A *destination* is a next hop (the Route's ``destination``: the
    recipient domain unless routing says otherwise).  It is a blocker:
    while its deliveries in flight fill its concurrency window, its
    sub-queues wait on it.

STRATEGIES
    Slow start (Postfix).  The window starts at
    initial_destination_concurrency and grows by 1/window per delivery
    whose session worked, up to the policy's limit for the destination
    (``cap``); a connection failure lowers it by 1/window -- by one per
    failed pseudo-cohort, not to the current concurrency minus one, so
    that one failure among many deliveries does not stop a destination.

    Destination status cache (Postfix).  When failures since the last
    success add up to destination_concurrency_failed_cohort_limit whole
    cohorts, the destination is dead for dead_destination_ttl: its queued
    jobs are deferred at once (DeferJob with DEAD_REPLY or the last reply)
    without a connection attempt, and so are new ones, until the entry
    expires or a delivery in flight gets through after all.

    The policy's limit.  Counters over a destination field (recipient
    domain, MX, remote IP, grouping) with a concurrency limit the
    destination per source IP: "5 per localip and domain" from two IPs
    allows 10.  ``cap`` is the sum over the source IPs that send to it
    (an IP without such a counter counts as
    default_destination_concurrency_limit).

INVARIANTS
    limit == min(int(window), cap) >= 1; a destination is forgotten only
    when no sub-queue refers to it, nothing is in flight and it is not
    dead.

SEE ALSO
    sluice.scheduler.scheduler, seeds/003 (Postfix qmgr), docs/scheduler.md
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from sluice.model import Reply
from sluice.scheduler.lines import Blocker
from sluice.scheduler.settings import Settings

if TYPE_CHECKING:
    from sluice.scheduler.subqueues import SubQueue

__all__ = ["DEAD_REPLY", "Destination", "Destinations"]

DEAD_REPLY = Reply(451, "4.4.1", "destination not responding; delivery temporarily suspended")

_PAST = -float("inf")


class Destination(Blocker):
    """Slow start and the status cache of one next hop."""

    __slots__ = ("by_tenant", "cap", "dead_until", "delivered", "fail_cohorts", "failed",
                 "inflight", "ip_limits", "last_reply", "limit", "name", "subqueues", "window")

    def __init__(self, name: str, window: float, cap: int) -> None:
        super().__init__()
        self.name = name
        self.window = window  # slow start's progress
        self.cap = cap  # the policy's limit for the destination
        self.limit = min(int(window), cap)  # what is enforced: the smaller
        # Per source IP, the tightest concurrency a destination counter sets (0: none).
        self.ip_limits: dict[str, int] = {}
        self.inflight = 0
        self.by_tenant: dict[str, int] = {}  # in flight per tenant
        self.dead_until = _PAST
        self.fail_cohorts = 0.0
        self.last_reply: Reply | None = None
        self.subqueues: dict[SubQueue, None] = {}  # ordered: deferrals come out alike
        self.delivered = 0
        self.failed = 0

    def free(self, now: float) -> int:
        """How many more deliveries may start to the destination now."""
        return self.limit - self.inflight

    def is_dead(self, now: float) -> bool:
        """Whether the status cache holds the destination dead at ``now``."""
        return self.dead_until > now

    @property
    def dead_reply(self) -> Reply:
        """What its deferred mail is told: that it is dead, and its last failure.

        The last failure alone would read as a fresh attempt's answer; the
        mail was deferred without a connection, because the destination is
        marked dead (issue 17).
        """
        last = self.last_reply
        if last is None:
            return DEAD_REPLY
        return Reply(last.code, last.enhanced,
                     f"destination {self.name} is dead, not tried; its last error was: "
                     f"{last.describe()}")

    def set_window(self, window: float) -> None:
        """Set slow start's window; the limit is the smaller of it and the cap."""
        self.window = window
        self.limit = min(int(window), self.cap)

    def set_cap(self, cap: int) -> None:
        """Set the policy's limit; the limit is the smaller of it and the window."""
        self.cap = cap
        self.limit = min(int(self.window), cap)

    def __repr__(self) -> str:
        return f"Destination({self.name})"


class Destinations:
    """Every destination that has a sub-queue, a delivery in flight or a dead mark."""

    __slots__ = ("by_name", "settings")

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.by_name: dict[str, Destination] = {}

    def get(self, name: str) -> Destination:
        """The destination called ``name``, made with the initial window if new."""
        dest = self.by_name.get(name)
        if dest is None:
            s = self.settings
            dest = Destination(name, float(s.initial_destination_concurrency),
                               s.default_destination_concurrency_limit)
            self.by_name[name] = dest
        return dest

    def forget(self, dest: Destination, now: float) -> None:
        """Forget a destination nothing refers to (unless it is marked dead)."""
        if dest.subqueues or dest.inflight or dest.dead_until > now:
            return
        if self.by_name.get(dest.name) is dest:
            del self.by_name[dest.name]

    def limit_from(self, dest: Destination, ip: str, limit: int) -> None:
        """Note that a sub-queue sends to ``dest`` from ``ip`` under ``limit``.

        ``limit`` is what destination counters allow (0: none sets one); the
        most any of them allows counts.
        """
        known = dest.ip_limits.get(ip)
        if known is not None and limit <= known:
            return
        dest.ip_limits[ip] = limit
        default = self.settings.default_destination_concurrency_limit
        if any(dest.ip_limits.values()):
            dest.set_cap(sum(v or default for v in dest.ip_limits.values()))
        else:
            dest.set_cap(default)

    def policy_changed(self) -> None:
        """A reload: the policy's limits are learnt again from the sub-queues."""
        default = self.settings.default_destination_concurrency_limit
        for dest in self.by_name.values():
            dest.ip_limits.clear()
            dest.set_cap(default)

    @staticmethod
    def started(dest: Destination, tenant: str) -> None:
        """A delivery to ``dest`` for ``tenant`` started: count it in flight."""
        dest.inflight += 1
        dest.by_tenant[tenant] = dest.by_tenant.get(tenant, 0) + 1

    def finished(self, dest: Destination, tenant: str, connection_failed: bool,
                 reply: Reply | None, now: float) -> bool:
        """A delivery to ``dest`` ended; True if that made it dead just now.

        ``reply`` is the temporary failure it got, if any (kept to tell the
        mail deferred while it is dead).
        """
        dest.inflight -= 1
        n = dest.by_tenant[tenant] - 1
        if n:
            dest.by_tenant[tenant] = n
        else:
            del dest.by_tenant[tenant]
        if connection_failed:
            dest.failed += 1
            if reply is not None:
                dest.last_reply = reply
            window = min(dest.window, float(dest.cap))
            dest.fail_cohorts += 1.0 / window
            dest.set_window(max(1.0, window - 1.0 / window))
            limit = self.settings.destination_concurrency_failed_cohort_limit
            if dest.fail_cohorts >= limit and dest.dead_until <= now:
                dest.dead_until = now + self.settings.dead_destination_ttl_s
                return True
            return False
        dest.delivered += 1
        dest.fail_cohorts = 0.0
        dest.last_reply = None
        if dest.dead_until > now:
            self.revive(dest, now)  # a delivery got through: it is not dead after all
        if dest.window < dest.cap:
            dest.set_window(min(float(dest.cap), dest.window + 1.0 / dest.window))
        return False

    def revive(self, dest: Destination, now: float) -> None:
        """A dead destination's entry expired: the next delivery probes it."""
        dest.dead_until = _PAST
        dest.fail_cohorts = 0.0
        dest.set_window(float(self.settings.initial_destination_concurrency))
        self.forget(dest, now)

    def __iter__(self) -> Iterator[Destination]:
        return iter(self.by_name.values())

    def __len__(self) -> int:
        return len(self.by_name)
