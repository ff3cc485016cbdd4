"""What the runtime tells the scheduler (events) and what it is told (commands).

SUMMARY
    Route, DeliveryJob; events MailArrived, EntriesClaimed, JobsQueued,
    DeliveryFinished, EntriesModified, PolicyReloaded, ConditionAdded,
    ConditionRemoved, SuspensionAdded, SuspensionRemoved, ClockTicked;
    commands Refill, StartDelivery, DeferJob.

DESCRIPTION
    Events are things that happened, in the past tense; commands are what
    the runtime must do next, in the imperative.  All are frozen, slotted
    dataclasses; none carries a clock reading except where the time is the
    subject (expiries).  The time of an event is the ``now`` passed with it
    to Scheduler.handle().

    A *delivery job* is one SMTP (or LMTP) transaction: the recipients of
    one message that share the recipient domain and the route.  The
    runtime builds jobs after routing (pre-delivery hook, DNS or the
    transport map) and the scheduler decides when each starts, and from
    which of its source IPs.

SEE ALSO
    sluice.scheduler.scheduler, docs/scheduler.md
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from sluice.model import Outcome, Reply
from sluice.scheduler.policy import Condition, Policy, Rate, Suspension

__all__ = [
    "AcquireGrants",
    "ClockTicked",
    "ClusterModeChanged",
    "Command",
    "ConditionAdded",
    "ConditionRemoved",
    "DeferJob",
    "DeliveryFinished",
    "DeliveryJob",
    "EntriesClaimed",
    "EntriesModified",
    "Event",
    "Grant",
    "GrantRequest",
    "GrantsChanged",
    "JobsQueued",
    "MailArrived",
    "PolicyReloaded",
    "Refill",
    "ReturnGrants",
    "Route",
    "StartDelivery",
    "SuspensionAdded",
    "SuspensionRemoved",
    "Transport",
]


class Transport(StrEnum):
    """The protocol a route delivers with."""
    SMTP = "smtp"
    LMTP = "lmtp"


@dataclass(frozen=True, slots=True)
class Route:
    """Everything a policy can name about a delivery, and where it goes.

    ``localip`` is the pool of source IPs the delivery may use (empty: the
    system's default address, counted as the value "").  ``destination``
    is the next-hop key for slow start and the destination status cache
    (defaults to the recipient domain).  Many jobs share one Route; the
    scheduler keys its sub-queues on it.
    """

    recipientdomain: str
    tenantid: str = ""
    jobid: str = ""
    transportid: str = ""
    localip: tuple[str, ...] = ()
    grouping: str = ""
    remoteip: str = ""
    remotemx: str = ""
    destination: str = ""
    transport: Transport = Transport.SMTP
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __hash__(self) -> int:
        # Routes key the sub-queues; hash once, not on every lookup.
        return self._hash

    def __post_init__(self) -> None:
        domain = self.recipientdomain.lower().rstrip(".")
        if domain != self.recipientdomain:
            object.__setattr__(self, "recipientdomain", domain)
        mx = self.remotemx.lower().rstrip(".")
        if mx != self.remotemx:
            object.__setattr__(self, "remotemx", mx)
        if not self.destination:
            object.__setattr__(self, "destination", domain)
        if len(set(self.localip)) != len(self.localip):
            raise ValueError(f"duplicate source IP in {self.localip}")
        object.__setattr__(self, "_hash", hash((
            self.recipientdomain, self.tenantid, self.jobid, self.transportid, self.localip,
            self.grouping, self.remoteip, self.remotemx, self.destination, self.transport)))

    def value(self, name: str, localip: str) -> str:
        """The value of policy field ``name`` when sent from ``localip``."""
        if name == "localip":
            return localip
        value: str = getattr(self, name)
        return value


@dataclass(frozen=True, slots=True)
class DeliveryJob:
    """One transaction's worth of recipients (``qids``) of message ``spid``.

    ``ref`` is the runtime's unique name for the job.  ``arrival_at`` is
    when the message arrived (for waiting-time figures and explanations).
    """

    ref: str
    spid: str
    qids: tuple[str, ...]
    route: Route
    priority: int = 0
    arrival_at: float = 0.0

    def __post_init__(self) -> None:
        if not self.qids:
            raise ValueError(f"job {self.ref} has no recipients")
        if self.priority not in (0, 1):
            raise ValueError(f"priority must be 0 or 1, not {self.priority}")


# --------------------------------------------------------------------------
# Events


@dataclass(frozen=True, slots=True)
class MailArrived:
    """New mail was queued in the store (incoming has work): refill soon."""

    count: int = 1


@dataclass(frozen=True, slots=True)
class EntriesClaimed:
    """The store answered a Refill: ``count`` entries are now being routed.

    ``exhausted``: the store had fewer than asked for.  ``next_due_at``:
    the earliest deferred entry's retry time (Store.due_at()), if known,
    so the scheduler wakes for it instead of polling.
    """

    count: int
    exhausted: bool = False
    next_due_at: float | None = None


@dataclass(frozen=True, slots=True)
class JobsQueued:
    """Routing is done for some claimed entries.

    ``jobs`` are ready for pickup; ``unrouted`` entries left the
    scheduler's care without a job (DNS failed, the pre-delivery hook held
    or bounced them; the runtime has recorded their outcome).
    """

    jobs: tuple[DeliveryJob, ...]
    unrouted: int = 0


@dataclass(frozen=True, slots=True)
class DeliveryFinished:
    """A StartDelivery is over.

    ``outcomes``: (qid, outcome) per recipient.  ``connection_failed``: no
    usable session (connect refused or timed out, greeting or HELO
    refused, 421 at the door); this is what slow start and the
    destination status cache count.  ``new_connection``: the delivery
    opened a connection rather than reusing one.  ``localip``: the source
    IP used (must be the one StartDelivery named; "" = not reported).
    """

    ref: str
    outcomes: tuple[tuple[str, Outcome], ...] = ()
    connection_failed: bool = False
    new_connection: bool = True
    localip: str = ""


@dataclass(frozen=True, slots=True)
class EntriesModified:
    """An operator changed these entries in the store: forget them.

    Hold, release, retry now, priority, delete; the store re-offers them.
    """

    qids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class PolicyReloaded:
    """The policy file was read again; it replaces the counters and the file's suspensions.

    Suspensions added at run time stay.
    """

    policy: Policy


@dataclass(frozen=True, slots=True)
class ConditionAdded:
    """A condition for counter ``counter_id``, inserted at ``position``.

    0 is evaluated first, so a run-time override wins.
    """

    counter_id: str
    condition: Condition
    position: int = 0


@dataclass(frozen=True, slots=True)
class ConditionRemoved:
    """An operator removed condition ``condition_id`` from counter ``counter_id``."""
    counter_id: str
    condition_id: str


@dataclass(frozen=True, slots=True)
class SuspensionAdded:
    """A suspension by hand.

    One with the same fields only gets the new expiry, tag and reason (as
    Halon does).
    """

    suspension: Suspension


@dataclass(frozen=True, slots=True)
class SuspensionRemoved:
    """An operator lifted the suspension ``suspension_id``."""
    suspension_id: str


@dataclass(frozen=True, slots=True)
class ClockTicked:
    """Nothing happened but time passed (the runtime woke at next_wakeup())."""


@dataclass(frozen=True, slots=True)
class Grant:
    """What a cluster's shared limits granted this node for one counter entry.

    ``slots``: concurrency leases this node holds now (in all).  ``slot_ats``:
    the pickups granted by a rate or an interval, each at its time (not
    before it, and not after it by more than ``use_within_s``).
    ``retry_at``: when asking again may give more than was granted (None:
    when somebody's lease or slot frees, which the runtime hears).
    ``share``: the most this node should hold now that others want some too
    (None: no cap); leases above it go back as its deliveries end.
    """

    key: str
    slots: int = 0
    slot_ats: tuple[float, ...] = ()
    use_within_s: float = 0.0
    retry_at: float | None = None
    share: int | None = None


@dataclass(frozen=True, slots=True)
class GrantsChanged:
    """The runtime heard back from the cluster's shared limits."""

    grants: tuple[Grant, ...]


@dataclass(frozen=True, slots=True)
class ClusterModeChanged:
    """The shared limits are reachable (``shared``) or not.

    When not, each node keeps its part of every cluster limit by itself:
    ``nodes`` live nodes, this one ``rank`` among them (0-based).  For
    ``transition_s`` after falling back (the leases' time to live) a node
    also keeps no more than the leases it held, which the others may still
    count.

    ``others_shared``: fallen back while other live nodes still say they
    share through Redis (a partition, or a reply that came too late here).
    Their pickups are not known here, so the node keeps to the leases it
    held while they live (the transition) and then starts no new delivery
    under a cluster concurrency, and no rate-limited pickup at all, until
    the others fall back too or Redis answers again.  Sent again while
    fallen back, the event only updates ``nodes``, ``rank`` and
    ``others_shared``.
    """

    shared: bool
    nodes: int = 1
    rank: int = 0
    transition_s: float = 0.0
    others_shared: bool = False


Event = (
    MailArrived
    | EntriesClaimed
    | JobsQueued
    | DeliveryFinished
    | EntriesModified
    | PolicyReloaded
    | ConditionAdded
    | ConditionRemoved
    | SuspensionAdded
    | SuspensionRemoved
    | ClockTicked
    | GrantsChanged
    | ClusterModeChanged
)


# --------------------------------------------------------------------------
# Commands


@dataclass(frozen=True, slots=True)
class Refill:
    """Claim up to ``limit`` entries, route them, and answer with EntriesClaimed, then JobsQueued.

    The claim is Store.claim(limit, now, quota_deferred).
    """

    limit: int
    quota_deferred: int


@dataclass(frozen=True, slots=True)
class StartDelivery:
    """Deliver ``qids`` of ``job`` now, from source IP ``localip``; answer with DeliveryFinished.

    ``qids`` may be fewer than the job's when an operator took some away
    meanwhile.
    """

    job: DeliveryJob
    localip: str
    qids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class DeferJob:
    """Defer ``qids`` of ``job`` without a connection attempt.

    A temporary failure with ``reply`` (the destination is marked dead until
    ``dead_until_at``); the runtime applies the retry rules.
    """

    job: DeliveryJob
    qids: tuple[str, ...]
    reply: Reply
    dead_until_at: float


@dataclass(frozen=True, slots=True)
class GrantRequest:
    """Ask the cluster for capacity of one counter entry.

    Concurrency leases up to ``slots`` in all, and ``pickups`` more pickups
    under its rate and interval (the thresholds come along: every node may
    not know them yet).  ``in_use``: leases its deliveries in flight use,
    which the store keeps whatever else it decides.
    """

    key: str
    concurrency: int | None
    rate: Rate | None
    interval_s: float | None
    slots: int
    pickups: int
    in_use: int = 0


@dataclass(frozen=True, slots=True)
class AcquireGrants:
    """Ask the cluster's shared limits for these; answer with GrantsChanged."""

    requests: tuple[GrantRequest, ...]


@dataclass(frozen=True, slots=True)
class ReturnGrants:
    """Give back concurrency leases this node holds but does not use: (key, how many)."""

    returns: tuple[tuple[str, int], ...]


Command = Refill | StartDelivery | DeferJob | AcquireGrants | ReturnGrants
