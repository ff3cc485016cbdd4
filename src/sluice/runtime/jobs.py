"""The queue manager's jobs in memory: from routing to the end of delivery.

SUMMARY
    jobs = Jobs(); ref = jobs.new_ref(); jobs.add(Job(job, hop, entries))
    jobs[ref] / jobs.get(ref) / jobs.pop(ref); jobs.intern(route)
    known, held = jobs.forget(qids)          (an operator changed them)
    entries = jobs.clear()                   (stopping: claims to give back)

STRATEGY
    One table, keyed by the job's reference, of what the scheduler knows
    only by reference and qid: the DeliveryJob it was told about, the next
    hop the delivery agent needs and the claimed entries themselves.  The
    refill adds, a delivery or a deferral removes, an operator's change
    takes out the entries it touched (not those of a job already started:
    their result meets the store's expect rule), and at the stop whatever
    is left is handed back.  It also remembers the qids being routed
    (claimed, not yet in a job), so that a change that arrives meanwhile
    is applied when routing ends.

    Equal routes are interned to one object, since the scheduler keys its
    sub-queues on them; the cache is cleared when it passes ROUTE_CACHE.

SEE ALSO
    sluice.runtime.manager, sluice.runtime.refill, sluice.runtime.deliveries
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from sluice.delivery.router import NextHop
from sluice.model import QueueEntry
from sluice.scheduler import DeliveryJob, Route

__all__ = ["ROUTE_CACHE", "Job", "Jobs"]

#: Routes kept interned before the cache starts again.
ROUTE_CACHE = 100_000


@dataclass(slots=True)
class Job:
    """A job the scheduler was told of, with its next hop and claimed entries."""

    job: DeliveryJob
    hop: NextHop
    entries: dict[str, QueueEntry]
    started: bool = False


class Jobs:
    """The jobs held between routing and the end of their delivery, by reference."""

    def __init__(self) -> None:
        self._jobs: dict[str, Job] = {}
        self._ref = itertools.count(1)
        self._route_cache: dict[Route, Route] = {}
        #: qids claimed and being routed, and those of them an operator changed meanwhile.
        self.routing: set[str] = set()
        self.modified_while_routing: set[str] = set()

    def new_ref(self) -> str:
        """A reference no other job of this run has."""
        return f"j{next(self._ref)}"

    def add(self, job: Job) -> None:
        """Hold ``job`` under its reference."""
        self._jobs[job.job.ref] = job

    def __getitem__(self, ref: str) -> Job:
        """The job ``ref``; KeyError if it is no longer held."""
        return self._jobs[ref]

    def __delitem__(self, ref: str) -> None:
        """Stop holding the job ``ref``; KeyError if it is no longer held."""
        del self._jobs[ref]

    def discard(self, ref: str) -> None:
        """Stop holding the job ``ref`` if it is still held."""
        self._jobs.pop(ref, None)

    def get(self, ref: str) -> Job | None:
        """The job ``ref``, if it is still held."""
        return self._jobs.get(ref)

    def pop(self, ref: str) -> Job | None:
        """Stop holding the job ``ref``; return it, if it was held."""
        return self._jobs.pop(ref, None)

    def intern(self, route: Route) -> Route:
        """Equal routes as one object: the scheduler keys its sub-queues on them."""
        known = self._route_cache.get(route)
        if known is None:
            if len(self._route_cache) > ROUTE_CACHE:
                self._route_cache.clear()
            self._route_cache[route] = route
            known = route
        return known

    def forget(self, qids: set[str]) -> tuple[list[str], list[QueueEntry]]:
        """Take the entries of ``qids`` out of the jobs not yet started.

        Returns the qids taken (for the scheduler) and their entries (whose
        claims go back).  Those being routed are remembered for the refill.
        """
        held: list[QueueEntry] = []
        known: list[str] = []
        for info in list(self._jobs.values()):
            if info.started:
                continue  # an attempt in flight: its result meets the store's expect rule
            hit = [q for q in info.entries if q in qids]
            if not hit:
                continue
            known.extend(hit)
            held.extend(info.entries.pop(q) for q in hit)
            if not info.entries:
                self._jobs.pop(info.job.ref, None)
        self.modified_while_routing.update(q for q in qids if q in self.routing)
        return known, held

    def clear(self) -> list[QueueEntry]:
        """Forget every job; return the entries they still held."""
        leftovers = [e for info in self._jobs.values() for e in info.entries.values()]
        self._jobs.clear()
        return leftovers
