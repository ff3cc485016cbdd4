"""What the delivery agent is asked and what it answers: requests, results, counters.

SUMMARY
    DeliveryRequest(route, entries, content, localip, smtputf8, started, settle)
    request.envelope() -> Envelope
    DeliveryResult(outcomes, localip, remotemx, remoteip, port, ...)
    result.by_qid, result.attempt_results()
    AgentStats(open, idle, connections_opened, ...)

DESCRIPTION
    A DeliveryRequest is one message for one next hop: recipient entries
    of a single SPID, an opener for its spooled content, the source IP,
    and the two callbacks of "Durable before reuse" (sluice.delivery.agent):
    ``started`` once the server said 354, ``settle`` once the replies are
    in.  A malformed request (no entries, entries of two messages, a
    source IP that is not one) raises ValueError when it is made.

    A DeliveryResult is what one attempt did: an outcome per entry and the
    host that answered, in the shapes the scheduler (by_qid) and the queue
    (attempt_results) take.  AgentStats are the agent's connection counters.

STRATEGY
    Plain frozen dataclasses with no I/O: the runtime, the planner and the
    tests make and read them without an agent.

SEE ALSO
    sluice.delivery.agent (which takes and returns these), sluice.queue,
    sluice.scheduler.events
"""

from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import IO

from sluice.delivery.client import Envelope
from sluice.delivery.router import NextHop
from sluice.model import Outcome, QueueEntry
from sluice.queue import AttemptResult

__all__ = ["AgentStats", "DeliveryRequest", "DeliveryResult"]


@dataclass(frozen=True, slots=True)
class DeliveryRequest:
    """One message for one next hop: ``entries`` are its recipients there.

    ``content`` opens the spooled message (e.g. functools.partial(
    store.open_content, spid)); it is called once per attempt and the
    stream is closed after.  ``localip``: the source IP ("" = the
    system's choice).  ``smtputf8``: the message was received with
    SMTPUTF8 and needs it onwards.  ``started`` and ``settle``: see
    sluice.delivery.agent, STRATEGIES, "Durable before reuse".
    """

    route: NextHop
    entries: tuple[QueueEntry, ...]
    content: Callable[[], IO[bytes]]
    localip: str = ""
    smtputf8: bool = False
    #: Awaited once the server said 354, before the message goes out: the
    #: attempt is known to be in flight (the mark log's line, or the store's
    #: "delivering" mark: sluice.marks).
    started: Callable[[], Awaitable[None]] | None = None
    #: Awaited with the result once the peer's replies are in, before the
    #: session takes another message: it makes the outcomes durable.
    settle: Callable[[DeliveryResult], Awaitable[None]] | None = None

    def __init__(self, route: NextHop, entries: tuple[QueueEntry, ...],
                 content: Callable[[], IO[bytes]], localip: str = "", smtputf8: bool = False,
                 started: Callable[[], Awaitable[None]] | None = None,
                 settle: Callable[[DeliveryResult], Awaitable[None]] | None = None) -> None:
        object.__setattr__(self, "route", route)
        object.__setattr__(self, "entries", entries)
        object.__setattr__(self, "content", content)
        object.__setattr__(self, "localip", localip)
        object.__setattr__(self, "smtputf8", smtputf8)
        object.__setattr__(self, "started", started)
        object.__setattr__(self, "settle", settle)
        self.__post_init__()

    def __post_init__(self) -> None:
        if not self.entries:
            raise ValueError("a delivery request needs at least one entry")
        spid = self.entries[0].spid
        if any(e.spid != spid for e in self.entries):
            raise ValueError("all entries of a delivery request must be of one message")
        if self.localip:
            ipaddress.ip_address(self.localip)  # ValueError for a malformed source IP

    @property
    def spid(self) -> str:
        """The SPID of the message, shared by every entry."""
        return self.entries[0].spid

    def envelope(self) -> Envelope:
        """The SMTP envelope: the message's sender and every entry's recipient."""
        first = self.entries[0]
        return Envelope(first.sender, tuple(e.recipient for e in self.entries),
                        first.size, self.smtputf8)


@dataclass(frozen=True, slots=True)
class DeliveryResult:
    """What one attempt did: an outcome per entry, and how it went.

    ``connection_failed``: no usable session could be had with any host
    (what slow start and the dead-destination cache count).
    ``new_connection``: a connection was opened for this attempt.
    ``remotemx``/``remoteip``/``port``: the host that answered, or the
    last one tried.
    """

    outcomes: tuple[tuple[QueueEntry, Outcome], ...]
    localip: str
    remotemx: str
    remoteip: str
    port: int
    duration_s: float
    new_connection: bool
    connection_failed: bool
    tls: bool = False

    def __init__(self, outcomes: tuple[tuple[QueueEntry, Outcome], ...], localip: str,
                 remotemx: str, remoteip: str, port: int, duration_s: float, new_connection: bool,
                 connection_failed: bool, tls: bool = False) -> None:
        object.__setattr__(self, "outcomes", outcomes)
        object.__setattr__(self, "localip", localip)
        object.__setattr__(self, "remotemx", remotemx)
        object.__setattr__(self, "remoteip", remoteip)
        object.__setattr__(self, "port", port)
        object.__setattr__(self, "duration_s", duration_s)
        object.__setattr__(self, "new_connection", new_connection)
        object.__setattr__(self, "connection_failed", connection_failed)
        object.__setattr__(self, "tls", tls)

    @property
    def by_qid(self) -> tuple[tuple[str, Outcome], ...]:
        """(qid, outcome) pairs, as the scheduler's DeliveryFinished takes them."""
        return tuple((e.qid, o) for e, o in self.outcomes)

    def attempt_results(self) -> list[AttemptResult]:
        """The outcomes as sluice.queue.Queue.record() takes them."""
        return [AttemptResult(e, o, attempted=True, localip=self.localip,
                              remotemx=self.remotemx, remoteip=self.remoteip,
                              duration_s=self.duration_s)
                for e, o in self.outcomes]


@dataclass(frozen=True, slots=True)
class AgentStats:
    """Counters since the agent started; ``open`` and ``idle`` are current."""

    open: int
    idle: int
    connections_opened: int
    connections_reused: int
    connect_failures: int
    transactions: int

    def __init__(self, open: int, idle: int, connections_opened: int, connections_reused: int,
                 connect_failures: int, transactions: int) -> None:
        object.__setattr__(self, "open", open)
        object.__setattr__(self, "idle", idle)
        object.__setattr__(self, "connections_opened", connections_opened)
        object.__setattr__(self, "connections_reused", connections_reused)
        object.__setattr__(self, "connect_failures", connect_failures)
        object.__setattr__(self, "transactions", transactions)
