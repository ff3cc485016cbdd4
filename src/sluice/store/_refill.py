"""Refill arithmetic shared by every store flavour (pure).

SUMMARY
    split_quota(limit, n_incoming, n_deferred, quota_deferred) -> (deferred, incoming)
    interleave(incoming, deferred) -> list

DESCRIPTION
    A refill of the active queue takes new mail and due deferred mail in
    turn (Postfix qmgr), with at least ``quota_deferred`` percent of the
    batch from deferred mail when both have work (Mailismus).  Every
    flavour selects its candidates its own way and then asks these two
    functions how many to take from each side and in which order, so that
    the order of a refill is the same whatever keeps the queue.

SEE ALSO
    sluice.store.Store.claim, seeds/000 section 4.3.2, seeds/003.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeVar

__all__ = ["interleave", "split_quota"]

T = TypeVar("T")


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
