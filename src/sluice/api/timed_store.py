"""A Store that times the calls that commit, for sluice_store_write_seconds.

SUMMARY
    queue.store = TimedStore(store, metrics)

STRATEGY
    Wrap the queue's store and time each call that commits (submit, claim,
    apply, modify, claim_bounces, recover) as its caller sees it, waiting
    for the group commit included; a call that raises counts in
    sluice_store_write_errors_total{op}.  Everything else passes through
    untimed, and attributes the Store protocol does not name (a spool, a
    path) stay reachable.

LIMITATIONS
    Only this process's calls: the receiving processes' own submissions
    are not timed.

SEE ALSO
    sluice.api.metrics (Metrics.timed), sluice.store.Store
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator, Sequence
from typing import IO, TYPE_CHECKING, Any, TypeVar

from sluice.model import Accepted, QueueEntry, QueueState, Reply, Selector, Submission
from sluice.spool import Content
from sluice.store import Action, Change, Counts, Store, Transition

if TYPE_CHECKING:
    from sluice.api.metrics import Metrics

__all__ = ["STORE_OPS", "TimedStore"]

#: The operations TimedStore times (the ``op`` label).
STORE_OPS = ("submit", "claim", "claim_bounces", "apply", "modify", "recover")


T = TypeVar("T")


class TimedStore:
    """A Store that times the calls that commit, and passes everything through."""

    def __init__(self, store: Store, metrics: Metrics) -> None:
        self.inner = store
        self.metrics = metrics
        self.flavour = store.flavour
        self.shared_access = store.shared_access

    def __getattr__(self, name: str) -> Any:
        # Flavour-specific extras (a spool, a path) stay reachable.
        return getattr(self.inner, name)

    def submit(self, submission: Submission, content: Content, now: float) -> Accepted:
        """Queue a message (timed as submit)."""
        return self.metrics.timed("submit", self.inner.submit, submission, content, now)

    def submit_future(self, submission: Submission, content: Content, now: float
                      ) -> concurrent.futures.Future[Accepted]:
        """Queue a message without waiting (timed when the future completes)."""
        return self._timed_future("submit", time.perf_counter(),
                                  self.inner.submit_future(submission, content, now))

    def apply_future(self, transitions: Sequence[Transition], *, durable: bool = True,
                     flush_soon: bool = False) -> concurrent.futures.Future[set[str]]:
        """Apply transitions without waiting (timed as apply when the future completes)."""
        return self._timed_future("apply", time.perf_counter(), self.inner.apply_future(
            transitions, durable=durable, flush_soon=flush_soon))

    def _timed_future(self, op: str, start: float, fut: concurrent.futures.Future[T]
                      ) -> concurrent.futures.Future[T]:
        def done(f: concurrent.futures.Future[T]) -> None:
            if f.cancelled() or f.exception() is not None:
                self.metrics.store_errors.labels(op).inc()
            else:
                self.metrics.store_seconds.labels(op).observe(time.perf_counter() - start)

        fut.add_done_callback(done)
        return fut

    def claim(self, limit: int, now: float, quota_deferred: int) -> list[QueueEntry]:
        """Claim due entries (timed as claim)."""
        return self.metrics.timed("claim", self.inner.claim, limit, now, quota_deferred)

    def apply(self, transitions: Sequence[Transition], *, wait: bool = True,
              durable: bool = True) -> set[str]:
        """Apply transitions (timed as apply when the caller waits)."""
        if not wait:
            return self.inner.apply(transitions, wait=False, durable=durable)
        return self.metrics.timed("apply", self.inner.apply, transitions, wait=True,
                                  durable=durable)

    def claim_bounces(self, limit: int, now: float, lease_s: float) -> list[QueueEntry]:
        """Claim bounces to write NDRs for (timed as claim_bounces)."""
        return self.metrics.timed("claim_bounces", self.inner.claim_bounces, limit, now,
                                  lease_s)

    def recover(self, now: float) -> int:
        """Recover after a crash (timed as recover)."""
        return self.metrics.timed("recover", self.inner.recover, now)

    def expired(self, cutoff_at: float, reports_cutoff_at: float,
                limit: int = 10000) -> list[QueueEntry]:
        """Entries past their lifetime (not timed)."""
        return self.inner.expired(cutoff_at, reports_cutoff_at, limit)

    def due_at(self) -> float | None:
        """When the next entry is due (not timed)."""
        return self.inner.due_at()

    def oldest(self) -> dict[QueueState, float]:
        """The arrival of the oldest entry per state (not timed)."""
        return self.inner.oldest()

    def modify(self, selector: Selector, action: Action, now: float,
               priority: int | None = None, reply: Reply | None = None) -> list[QueueEntry]:
        """Change selected entries (timed as modify)."""
        return self.metrics.timed("modify", self.inner.modify, selector, action, now,
                                  priority=priority, reply=reply)

    def changes_since(self, seq: int) -> tuple[int, list[Change]]:
        """The change feed after ``seq`` (not timed)."""
        return self.inner.changes_since(seq)

    def get(self, qid: str) -> QueueEntry | None:
        """One entry by queue id (not timed)."""
        return self.inner.get(qid)

    def entries(self, selector: Selector, *, after: str | None = None,
                limit: int | None = None) -> Iterator[QueueEntry]:
        """Entries matching the selector, a page at a time (not timed)."""
        return self.inner.entries(selector, after=after, limit=limit)

    def count(self, selector: Selector | None = None) -> Counts:
        """Counts by state (not timed)."""
        return self.inner.count(selector)

    def shape(self, selector: Selector, now: float,
              edges_s: Sequence[float]) -> dict[str, list[int]]:
        """Recipients per domain by age (not timed)."""
        return self.inner.shape(selector, now, edges_s)

    def open_content(self, spid: str) -> IO[bytes]:
        """A message's content (not timed)."""
        return self.inner.open_content(spid)

    def close(self) -> None:
        """Close the inner store."""
        self.inner.close()
