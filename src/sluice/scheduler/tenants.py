"""Tenants: weighted shares of every contended limit, by deficit round robin.

SUMMARY
    shares = Shares({"acme": 3.0}, default_weight=1.0, min_shares={"small": 0.2})
    line = FairQueue(shares)       a line of sub-queues, fair between tenants
    line.push(sq) / line.push_front(sq) / line.discard(sq)
    sq = line.pop(prefer)          whose turn it is

DESCRIPTION
    Sub-queues belong to a tenant (the Route's ``tenantid``; "" is a tenant
    too).  Wherever sub-queues wait for one thing -- the ring of ready
    sub-queues (the queue manager's max_deliveries), the line of a full
    destination, of a counter entry over its threshold, of a suspension --
    they wait in a FairQueue: FIFO within a tenant, deficit round robin
    between tenants, so that a tenant with a thousand sub-queues gets no
    more turns than one with a single sub-queue of the same weight.

STRATEGIES
    Deficit round robin (Shreedhar and Varghese).  Tenants with waiters
    take turns in a circle; each turn adds the tenant's quantum (its
    weight, scaled so that the smallest weight is 1) to its deficit, and
    it is served while its deficit is at least 1, one pickup each.  Over a
    round every waiting tenant gets its weight's worth of pickups, within
    one.  A tenant whose turn comes with nothing waiting leaves the circle
    and loses its deficit, so that an idle tenant saves up no credit.

    Minimum shares.  A tenant may be promised ``min_share`` of a limit
    (a fraction of the destination's window, or of max_deliveries).  While
    it has mail waiting for that limit and holds less than its share, a
    freed slot goes to it first (``prefer``); when it has none waiting,
    its share is lent to the others: slots are never kept idle for it.

INVARIANTS
    A sub-queue is at most once in a FairQueue; a tenant with a sub-queue
    in it is in the circle; every quantum is >= 1.

SEE ALSO
    sluice.scheduler.lines (the ring and the lines), docs/scheduler.md,
    issue "Tenants get their share"
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sluice.scheduler.subqueues import SubQueue

__all__ = ["FairQueue", "Shares"]


@dataclass(frozen=True, slots=True)
class Shares:
    """Tenants' weights (a default for those not named) and minimum shares."""

    weights: Mapping[str, float] = field(default_factory=dict)
    default_weight: float = 1.0
    min_shares: Mapping[str, float] = field(default_factory=dict)  # fractions, 0..1
    fair: bool = True  # False: every sub-queue alike, whatever its tenant (plain round robin)
    _smallest: float = field(default=1.0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        every = [*self.weights.values(), self.default_weight]
        if any(not math.isfinite(w) or w <= 0 for w in every):
            raise ValueError("tenant weights must be positive")
        if any(not 0 <= s <= 1 for s in self.min_shares.values()):
            raise ValueError("a min_share is a fraction between 0 and 1")
        if sum(self.min_shares.values()) > 1:
            raise ValueError("the min_shares of all tenants add up to more than 100 %")
        object.__setattr__(self, "_smallest", min(every))

    def weight(self, tenant: str) -> float:
        """The tenant's weight: its own, or the default."""
        return self.weights.get(tenant, self.default_weight)

    def quantum(self, tenant: str) -> float:
        """The tenant's weight relative to the smallest weight (>= 1)."""
        return self.weights.get(tenant, self.default_weight) / self._smallest

    def reserved(self, tenant: str, limit: int) -> int:
        """Slots of a limit of ``limit`` promised to ``tenant`` (0: none)."""
        share = self.min_shares.get(tenant)
        return math.ceil(share * limit) if share else 0

    @property
    def any_min_share(self) -> bool:
        """Whether tenants share fairly and some tenant has a minimum share."""
        return self.fair and bool(self.min_shares)

    def key(self, tenant: str) -> str:
        """The tenant as lines tell them apart ("" for all when not fair)."""
        return tenant if self.fair else ""


class FairQueue:
    """Sub-queues waiting for one thing: FIFO per tenant, DRR between tenants."""

    __slots__ = ("by_tenant", "deficit", "n", "shares")

    def __init__(self, shares: Shares) -> None:
        self.shares = shares
        # The circle of tenants, in turn order, each with its line.  A tenant
        # whose line ran empty stays until its turn comes round (its one
        # sub-queue may be back in a moment, after its pickup), and leaves
        # then, with its deficit, if nothing of it waits.
        self.by_tenant: OrderedDict[str, OrderedDict[SubQueue, None]] = OrderedDict()
        self.deficit: dict[str, float] = {}
        self.n = 0

    def _line(self, tenant: str) -> OrderedDict[SubQueue, None]:
        line = self.by_tenant.get(tenant)
        if line is None:
            line = self.by_tenant[tenant] = OrderedDict()
        return line

    def push(self, sq: SubQueue) -> None:
        """At the back of its tenant's line."""
        self._line(self.shares.key(sq.tenant))[sq] = None
        self.n += 1

    def push_front(self, sq: SubQueue) -> None:
        """Put ``sq`` back where it was woken from.

        First of its tenant, its tenant's turn next, and the pickup it was
        charged for given back.
        """
        tenant = self.shares.key(sq.tenant)
        line = self._line(tenant)
        line[sq] = None
        line.move_to_end(sq, last=False)
        self.by_tenant.move_to_end(tenant, last=False)
        self.deficit[tenant] = self.deficit.get(tenant, 0.0) + 1.0
        self.n += 1

    def discard(self, sq: SubQueue) -> None:
        """Take ``sq`` out of the queue, if it is there."""
        line = self.by_tenant.get(self.shares.key(sq.tenant))
        if line is not None and sq in line:
            del line[sq]
            self.n -= 1

    def pop(self, prefer: Callable[[str], bool] | None = None) -> SubQueue | None:
        """The next sub-queue, by deficit round robin.

        A waiting sub-queue of a tenant ``prefer`` names goes first.
        """
        if not self.n:
            return None
        by_tenant = self.by_tenant
        if prefer is not None:
            for tenant, line in by_tenant.items():
                if line and prefer(tenant):
                    return self._take(tenant, line, self.deficit.get(tenant, 0.0))
        while True:
            tenant, line = next(iter(by_tenant.items()))
            if not line:  # its turn came and nothing of it waits: it leaves
                del by_tenant[tenant]
                self.deficit.pop(tenant, None)
                continue
            deficit = self.deficit.get(tenant, 0.0)
            if deficit < 1.0:
                deficit += self.shares.quantum(tenant)  # its turn begins (quantum >= 1)
            return self._take(tenant, line, deficit)

    def _take(self, tenant: str, line: OrderedDict[SubQueue, None], deficit: float) -> SubQueue:
        sq, _ = line.popitem(last=False)
        self.n -= 1
        deficit = max(0.0, deficit - 1.0)
        self.deficit[tenant] = deficit
        if deficit < 1.0:
            self.by_tenant.move_to_end(tenant)  # its turn is over
        return sq

    def tenants(self) -> list[str]:
        """The tenants with sub-queues waiting, in turn order."""
        return [t for t, line in self.by_tenant.items() if line]

    def __len__(self) -> int:
        return self.n

    def __bool__(self) -> bool:
        return self.n > 0

    def __contains__(self, sq: SubQueue) -> bool:
        line = self.by_tenant.get(self.shares.key(sq.tenant))
        return line is not None and sq in line

    def __iter__(self) -> Iterator[SubQueue]:
        """Every waiter, tenant by tenant in turn order, oldest first."""
        for line in list(self.by_tenant.values()):
            yield from list(line)
