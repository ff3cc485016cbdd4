"""Refill arithmetic shared by every store flavour (pure).

SUMMARY
    split_quota(limit, n_incoming, n_deferred, quota_deferred) -> (deferred, incoming)
    interleave(incoming, deferred) -> list
    fair_pick({tenant: candidates}, TenantWeights(...), limit) -> list
    first_reads(limit, tenants, weights) -> {tenant: how many to read first}
    TenantMemo().get(spid, read) -> the tenant of a message, read once

DESCRIPTION
    A refill of the active queue takes new mail and due deferred mail in
    turn (Postfix qmgr), with at least ``quota_deferred`` percent of the
    batch from deferred mail when both have work (Mailismus).  Every
    flavour selects its candidates its own way and then asks these two
    functions how many to take from each side and in which order, so that
    the order of a refill is the same whatever keeps the queue.

    Tenants get their share of a refill as of every other limit (issue
    "Tenants get their share"): each side's candidates come per tenant,
    each tenant's oldest first and at most ``limit`` of them, and
    fair_pick (sluice.fairshare, pure, which the simulator's store uses
    too) shares the side between the tenants that have candidates,
    by weight, before split_quota and interleave join the two sides.  One
    tenant's backlog thus never keeps another's mail in the store while
    the active queue fills.

STRATEGIES
    Deficit round robin in its smooth form (the order of weighted fair
    queueing for entries of one size): the next entry goes to the tenant
    whose ``(taken + 1) / weight`` is least.  The circle with whole quanta
    that the scheduler's FairQueue uses would end a batch mid-round and
    leave a heavy tenant late in the circle short by up to its quantum;
    here every tenant with candidates gets at least its weighted share of
    any prefix of the batch less one (the D'Hondt lower bound).

SEE ALSO
    sluice.store.Store.claim, sluice.scheduler.tenants, docs/scheduler.md,
    seeds/000 section 4.3.2, seeds/003.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from sluice.fairshare import fair_pick

if TYPE_CHECKING:
    from sluice.config.sections import TenantsConfig

__all__ = ["EQUAL", "Candidate", "TenantMemo", "TenantWeights", "fair_pick", "first_reads",
           "firsts_by_group", "interleave", "split_quota"]

T = TypeVar("T")

#: A refill's candidate: its order (a sort key) and the file or row it names.
Candidate = tuple[tuple[Any, ...], str]


def split_quota(limit: int, n_incoming: int, n_deferred: int, quota_deferred: int
                ) -> tuple[int, int]:
    """How many to take from (deferred, incoming) for a refill of ``limit``.

    Mailismus's quota_deferred: at least that percentage of the batch comes
    from deferred when both have work; whatever one side cannot fill, the
    other may.  New mail gets the rest (Postfix: new mail first, delayed
    mail in idle capacity).
    """
    if limit <= 0:
        return 0, 0
    floor_d = math.ceil(limit * quota_deferred / 100) if quota_deferred > 0 else 0
    take_d = min(n_deferred, floor_d)
    take_i = min(n_incoming, limit - take_d)
    take_d = min(n_deferred, limit - take_i)
    return take_d, take_i


def interleave(incoming: Sequence[T], deferred: Sequence[T]) -> list[T]:
    """One from incoming, one from deferred, in turn (Postfix qmgr)."""
    out: list[T] = []
    for i in range(max(len(incoming), len(deferred))):
        if i < len(incoming):
            out.append(incoming[i])
        if i < len(deferred):
            out.append(deferred[i])
    return out


@dataclass(frozen=True, slots=True)
class TenantWeights:
    """Tenants' weights for a refill (a default for those not named).

    ``fair=False``: every entry alike, whatever its tenant (oldest first).
    """

    weights: Mapping[str, float] = field(default_factory=dict)
    default: float = 1.0
    fair: bool = True

    def __post_init__(self) -> None:
        if any(not math.isfinite(w) or w <= 0 for w in [*self.weights.values(), self.default]):
            raise ValueError("tenant weights must be positive")

    @classmethod
    def of(cls, tenants: TenantsConfig) -> TenantWeights:
        """The weights the scheduler's ``tenants`` section gives."""
        return cls(tenants.weights, tenants.default_weight, tenants.fair)

    def weight(self, tenant: str) -> float:
        """The tenant's weight: its own, or the default."""
        return self.weights.get(tenant, self.default)

    def key(self, tenant: str) -> str:
        """The tenant as a refill tells them apart ("" for all when not fair)."""
        return tenant if self.fair else ""


class TenantMemo:
    """The tenant of each message a refill met, read once and remembered.

    A flavour whose refill cannot read the tenant beside the entry (fs:
    in the control file; kv: in the message's metadata) reads it once per
    message; past ``kept`` messages the memo starts over.
    """

    __slots__ = ("_of", "kept")

    def __init__(self, kept: int = 1_000_000) -> None:
        self._of: dict[str, str] = {}
        self.kept = kept

    def get(self, spid: str, read: Callable[[], str | None]) -> str:
        """The tenant of message ``spid``; ``read()`` finds it the first time.

        ``read()`` gives None for a message it could not read (gone since it
        was listed): "" this time, and nothing remembered.
        """
        tenant = self._of.get(spid)
        if tenant is None:
            tenant = read()
            if tenant is None:
                return ""
            if len(self._of) >= self.kept:
                self._of.clear()
            self._of[spid] = tenant
        return tenant


def firsts_by_group(items: Iterable[Candidate], k: int, group: Callable[[Candidate], str]
                    ) -> list[Candidate]:
    """The ``k`` smallest items of each group, all of them in order.

    One pass holding at most ``2 k`` items a group: a refill shared by
    tenants needs each tenant's first ``k`` candidates, not all of them
    in a list.
    """
    lines: dict[str, list[Candidate]] = {}
    for item in items:
        line = lines.setdefault(group(item), [])
        line.append(item)
        if len(line) >= 2 * k:
            line.sort()
            del line[k:]
    out = [item for line in lines.values() for item in sorted(line)[:k]]
    out.sort()
    return out


#: Every tenant alike: the weights of a store nobody told otherwise.
EQUAL = TenantWeights()


def first_reads(limit: int, tenants: Sequence[str], weights: TenantWeights) -> dict[str, int]:
    """How many candidates of each tenant a refill of ``limit`` reads first.

    Each tenant's weighted share of the batch, plus one: fair_pick over
    lists cut there still gives every tenant its share within one, without
    reading ``limit`` rows of each of many tenants.  If all together give
    fewer than ``limit`` (some tenants have less than their share), the
    caller reads up to ``limit`` of each of the others.
    """
    total = sum(weights.weight(t) for t in tenants)
    return {t: min(limit, math.ceil(limit * weights.weight(t) / total) + 1) for t in tenants}
