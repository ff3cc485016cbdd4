"""Sharing a batch between tenants by weight: deficit round robin in its smooth form (pure).

SUMMARY
    fair_pick({tenant: candidates}, weights, limit) -> list

DESCRIPTION
    A refill of the active queue shares its batch between the tenants that
    have mail waiting, by weight, whatever keeps the queue: every store
    flavour (sluice.store._refill) and the policy simulator's store
    (sluice.scheduler.simulated_store) call this one function.  It imports
    nothing but the standard library's heapq, so the scheduler's pure core
    may use it.

STRATEGIES
    The next entry goes to the tenant whose ``(taken + 1) / weight`` is
    least (the order of weighted fair queueing for entries of one size).
    Every tenant with candidates then gets at least its weighted share of
    any prefix of the batch less one (the D'Hondt lower bound).

SEE ALSO
    sluice.store._refill, sluice.scheduler.tenants, docs/scheduler.md
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from typing import Protocol, TypeVar

__all__ = ["Weights", "fair_pick"]

T = TypeVar("T")


class Weights(Protocol):
    """What fair_pick needs of a tenant's weight (TenantWeights; the scheduler's Shares)."""

    def weight(self, tenant: str) -> float:
        """The tenant's weight: its own, or the default."""
        ...


def fair_pick(candidates: Mapping[str, Sequence[T]], weights: Weights, limit: int
              ) -> list[T]:
    """Up to ``limit`` of the candidates, shared between tenants by weight.

    ``candidates``: each tenant's entries, in the order it wants them taken
    (priority first, then oldest).  The tenants take turns by deficit
    round robin in its smooth form: the next entry goes to the tenant that
    is furthest behind its weighted share, i.e. whose ``(taken + 1) /
    weight`` is least (ties: the order of ``candidates``).  A tenant whose
    candidates run out leaves, and the others share its turns.  Every
    prefix of the result is fair in the same way, so a caller may take the
    first ``k`` of it.
    """
    heap: list[tuple[float, int, int]] = []  # (next finish, turn order, taken so far)
    names = list(candidates)
    for order, tenant in enumerate(names):
        if candidates[tenant]:
            heap.append((1.0 / weights.weight(tenant), order, 0))
    heapq.heapify(heap)
    out: list[T] = []
    while heap and len(out) < limit:
        _, order, taken = heapq.heappop(heap)
        tenant = names[order]
        line = candidates[tenant]
        out.append(line[taken])
        taken += 1
        if taken < len(line):
            heapq.heappush(heap, ((taken + 1) / weights.weight(tenant), order, taken))
    return out
