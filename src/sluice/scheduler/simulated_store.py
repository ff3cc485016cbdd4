"""The policy simulator's store: new and deferred mail per tenant, refilled as the real ones.

SUMMARY
    store = SimStore(scenario)
    store.new_mail(flow) -> deque      the line a flow's new messages join
    store.defer(flow, at, seq, msg)    due again at ``at``
    store.claim(limit, now, quota_deferred) -> messages for the active queue
    store.due_at() -> the earliest due time of deferred mail, or None

DESCRIPTION
    sluice.scheduler.simulation keeps its queued messages here, not in a
    real store: new mail in arrival order and deferred mail by due time,
    each per tenant ("" for all when the scenario's tenants are not fair).

STRATEGIES
    The real refill, not a look-alike.  A refill takes at least
    ``quota_deferred`` percent of its batch from due deferred mail when both
    sides have work (Mailismus), new mail for the rest, then more deferred
    mail if new mail runs out (Postfix); and each side is shared between
    tenants by weight with the function every store flavour uses
    (sluice.fairshare.fair_pick), so that a simulation with a small
    ``maxmemoryqueue`` shows what a tenant's backlog does to another's mail.

SEE ALSO
    sluice.scheduler.simulation, sluice.fairshare, sluice.store._refill
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from itertools import islice
from typing import Generic, TypeVar

from sluice.fairshare import fair_pick
from sluice.scheduler.scenario import Scenario

__all__ = ["SimStore"]

M = TypeVar("M")


class SimStore(Generic[M]):
    """Queued messages per tenant; see the module doc."""

    def __init__(self, scenario: Scenario) -> None:
        self.shares = scenario.settings.shares
        self.keys = [f.tenant if self.shares.fair else "" for f in scenario.flows]
        self.incoming: dict[str, deque[M]] = {}
        self.deferred: dict[str, list[tuple[float, int, M]]] = {}

    def new_mail(self, flow: int) -> deque[M]:
        """The line new messages of ``flow`` join (append them in arrival order)."""
        return self.incoming.setdefault(self.keys[flow], deque())

    def defer(self, flow: int, at: float, seq: int, msg: M) -> None:
        """``msg`` (of ``flow``) is due again at ``at``; ``seq`` orders equal times."""
        heapq.heappush(self.deferred.setdefault(self.keys[flow], []), (at, seq, msg))

    def due_at(self) -> float | None:
        """When the earliest deferred message is due (None: none deferred)."""
        return min((h[0][0] for h in self.deferred.values() if h), default=None)

    def claim(self, limit: int, now: float, quota: int) -> list[M]:
        """Up to ``limit`` messages for the active queue (see STRATEGIES)."""
        share = math.ceil(limit * quota / 100) if quota else 0
        out = self._take_deferred(share, now)
        out += self._take_incoming(limit - len(out))
        out += self._take_deferred(limit - len(out), now)
        return out

    def _take_incoming(self, k: int) -> list[M]:
        if k <= 0:
            return []
        lines = {t: list(islice(q, k)) for t, q in self.incoming.items() if q}
        picked = fair_pick(lines, self.shares, k)
        chosen = {id(m) for m in picked}
        for t, line in lines.items():  # each tenant's picks are the front of its line
            q = self.incoming[t]
            for _ in range(sum(1 for m in line if id(m) in chosen)):
                q.popleft()
        return picked

    def _take_deferred(self, k: int, now: float) -> list[M]:
        if k <= 0:
            return []
        lines: dict[str, list[tuple[float, int, M]]] = {}
        for t, heap in self.deferred.items():
            line: list[tuple[float, int, M]] = []
            while heap and heap[0][0] <= now and len(line) < k:
                line.append(heapq.heappop(heap))
            if line:
                lines[t] = line
        picked = fair_pick(lines, self.shares, k)
        taken = {id(item) for item in picked}
        for t, line in lines.items():  # what was not picked goes back
            for item in line:
                if id(item) not in taken:
                    heapq.heappush(self.deferred[t], item)
        return [item[2] for item in picked]
