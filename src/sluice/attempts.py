"""What one delivery attempt did for one entry: AttemptResult.

DESCRIPTION
    The delivery side makes one per entry and attempt (sluice.runtime.
    deliveries, sluice.delivery.plan); the queue records it
    (sluice.queue.Queue.record) and the success journal keeps the
    successes until the store has them (sluice.journal).  A module of its
    own, compiled with the others (sluice._native), so that the queue's
    module stays one idea; sluice.queue exports it too.
"""

from __future__ import annotations

from dataclasses import dataclass

from sluice.model import Outcome, QueueEntry

__all__ = ["AttemptResult"]


@dataclass(frozen=True, slots=True)
class AttemptResult:
    """What one delivery attempt did for one entry.

    ``attempted`` is False when no connection was tried (a dead destination,
    a pre-delivery hook's defer): the entry is deferred, and its attempt
    count still grows so that its retry schedule advances.
    """

    entry: QueueEntry
    outcome: Outcome
    attempted: bool = True
    localip: str | None = None
    remotemx: str | None = None
    remoteip: str | None = None
    duration_s: float | None = None
    #: When the reply came, for an outcome recorded later than that (a
    #: success logged first, or replayed from the journal after a restart);
    #: None: now.
    at: float | None = None
    #: Its accounting line is written already (Queue.log_successes).
    logged: bool = False

    def __init__(self, entry: QueueEntry, outcome: Outcome, attempted: bool = True,
                 localip: str | None = None, remotemx: str | None = None,
                 remoteip: str | None = None, duration_s: float | None = None,
                 at: float | None = None, logged: bool = False) -> None:
        object.__setattr__(self, "entry", entry)
        object.__setattr__(self, "outcome", outcome)
        object.__setattr__(self, "attempted", attempted)
        object.__setattr__(self, "localip", localip)
        object.__setattr__(self, "remotemx", remotemx)
        object.__setattr__(self, "remoteip", remoteip)
        object.__setattr__(self, "duration_s", duration_s)
        object.__setattr__(self, "at", at)
        object.__setattr__(self, "logged", logged)

    def logged_at(self, at: float) -> AttemptResult:
        """This result, its accounting line written with the time ``at``.

        (dataclasses.replace, written out: one a success.)
        """
        return AttemptResult(self.entry, self.outcome, self.attempted, self.localip,
                             self.remotemx, self.remoteip, self.duration_s, at, True)

    def at_or(self, now: float) -> float:
        """When this outcome came: ``at``, or ``now`` for one recorded as it came."""
        return now if self.at is None else self.at
