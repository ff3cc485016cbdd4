"""What the REST API answers: one pydantic model per response.

SUMMARY
    The typed results of every operation (EntryPage, ActionResult,
    SchedulerStats, SuspensionResult, AuditRecordModel, ...) and the error
    body; FastAPI renders them into the OpenAPI document, so the document
    is the code.  Request bodies are in sluice.api.requests.

DESCRIPTION
    Responses mirror the plain data the queue core and scheduler hand out
    (QueueEntry, Explanation, the scheduler's views); times are POSIX
    seconds (``*_at``), durations seconds (``*_s``), as everywhere in
    Sluice.  The operations (sluice.api.control and its parts) build these
    models; no operation answers with an untyped dict.

SEE ALSO
    sluice.api.requests, sluice.api.routes, docs/api.md
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from sluice.model import QueueState
from sluice.store import Action

__all__ = [
    "ActionResult",
    "AuditPage",
    "AuditRecordModel",
    "AuditRef",
    "ConditionResult",
    "CounterModel",
    "CounterPage",
    "Counts",
    "DestinationModel",
    "DestinationPage",
    "EntryModel",
    "EntryPage",
    "ErrorBody",
    "ExplanationModel",
    "Health",
    "HistoryEvent",
    "MessageModel",
    "PolicyModel",
    "Problem",
    "ReloadResult",
    "RollbackResult",
    "SchedulerStats",
    "ShapeModel",
    "SubQueueModel",
    "SubQueuePage",
    "SuspensionList",
    "SuspensionModel",
    "SuspensionResult",
    "Throughput",
    "WhyResponse",
]

# -- errors -------------------------------------------------------------------------


class Problem(BaseModel):
    """One thing wrong with a request: where (a key path) and what."""

    path: str
    message: str


class ErrorBody(BaseModel):
    """Every error: a short ``error`` and, where it helps, the details."""

    error: str = Field(description="what went wrong, in a few words")
    detail: str | list[Problem] | None = Field(
        default=None, description="a sentence, or the problems with their key paths")


class Health(BaseModel):
    """Whether the server runs, and which node answers."""
    status: str = Field(description="'ok' while the server runs")
    node: str


# -- the queue ----------------------------------------------------------------------------


class ReplyModel(BaseModel):
    code: int
    enhanced: str
    text: str


class EntryModel(BaseModel):
    """One recipient entry of the queue (the same fields as ``qlist --json``)."""

    qid: str
    spid: str
    state: QueueState
    sender: str
    recipient: str
    domain: str
    arrival_at: float
    next_attempt_at: float
    attempts: int
    priority: int
    tenantid: str
    jobid: str
    transportid: str
    localip: list[str]
    last_reply: ReplyModel | None
    size: int
    dsn: bool = Field(description="true for delivery status notifications (NDRs)")
    smtputf8: bool = Field(description="the message was received with SMTPUTF8 (RFC 6531)")


class EntryPage(BaseModel):
    """One page of queue entries, and the cursor for the next."""
    entries: list[EntryModel]
    next: str | None = Field(description="pass as 'after' for the next page; null at the end")


class StateCounts(BaseModel):
    hold: int
    incoming: int
    deferred: int
    active: int
    delivering: int
    bounce: int


class Counts(BaseModel):
    """The queue's totals: messages, recipients, and recipients by state."""
    messages: int
    recipients: int
    by_state: StateCounts


class ShapeRow(BaseModel):
    domain: str
    total: int
    buckets: list[int]


class ShapeModel(BaseModel):
    """Postfix's qshape: recipients per domain by age in minutes."""

    buckets_min: list[int] = Field(description="upper edges of the age buckets, in minutes")
    header: list[str]
    total: ShapeRow
    rows: list[ShapeRow]
    domains: int = Field(description="domains in the queue (rows may show fewer: 'top')")


class ActionResult(BaseModel):
    """What a queue action changed (or, in a dry run, would change)."""
    action: Action
    dry_run: bool
    count: int = Field(description="entries changed (or, in a dry run, that would change)")
    qids: list[str] = Field(description="the changed entries (at most 1000)")
    qids_truncated: bool
    audit_id: int | None


class HistoryEvent(BaseModel):
    """One line of the accounting log (docs/accounting.md)."""

    time: str
    event: str
    node: str | None = None
    qid: str
    spid: str
    sender: str | None = None
    recipient: str | None = None
    domain: str | None = None
    tenantid: str | None = None
    jobid: str | None = None
    transportid: str | None = None
    localip: str | None = None
    remotemx: str | None = None
    remoteip: str | None = None
    attempt: int | None = None
    code: int | None = None
    enhanced: str | None = None
    response: str | None = None
    queue_age_s: float | None = None
    size: int | None = None
    duration_s: float | None = None
    is_report: bool | None = None


class MessageModel(BaseModel):
    """One message: the recipients still queued, and its history from the accounting log."""
    spid: str
    arrival_at: float | None
    recipients: list[EntryModel] = Field(description="entries still in the queue")
    history: list[HistoryEvent] = Field(description="every accounting line of the message, "
                                                    "oldest first")
    history_files: int
    history_bytes: int = Field(description="accounting-log bytes scanned")
    history_truncated: bool = Field(description="the scan stopped at api.history_max_bytes")


class ReasonModel(BaseModel):
    kind: str
    text: str
    localip: str | None
    counter: str | None
    key: dict[str, str]
    threshold: str
    current: str
    suspension: str | None
    until_at: float | None


class ExplanationModel(BaseModel):
    """Why a recipient waits, and when it is expected to go."""
    qid: str
    state: str
    reasons: list[ReasonModel]
    expected_at: float | None
    ahead: int
    source: str = Field(description="'memory' (the running scheduler) or 'store'")
    lines: list[str] = Field(description="the same, as sentences")


class WhyResponse(BaseModel):
    """An explanation for each recipient asked about."""
    explanations: list[ExplanationModel]


# -- the scheduler ---------------------------------------------------------------------------


class RouteModel(BaseModel):
    recipientdomain: str
    tenantid: str
    jobid: str
    transportid: str
    localip: list[str]
    grouping: str
    remoteip: str
    remotemx: str
    destination: str
    transport: str


class SubQueueModel(BaseModel):
    """One sub-queue of the scheduler: its route, what it holds, and what holds it."""
    route: RouteModel
    priority: int
    jobs: int
    entries: int
    parked: bool
    held_by: list[str]


class SubQueuePage(BaseModel):
    """The largest sub-queues, and how many there are."""
    total: int
    items: list[SubQueueModel]


class CounterModel(BaseModel):
    """One counter entry of the pickup policy against its thresholds."""
    counter: str
    key: dict[str, str]
    inflight: int
    concurrency: int | None
    rate: str | None
    rate_used: int
    connectinterval_s: float | None
    next_connect_at: float | None
    exceeded: bool
    waiting_subqueues: int
    condition: str | None


class CounterPage(BaseModel):
    """The busiest counter entries, and how many there are."""
    total: int
    items: list[CounterModel]


class DestinationModel(BaseModel):
    """One destination's slow start and status cache."""
    destination: str
    window: float
    limit: int
    inflight: int
    dead: bool
    dead_until_at: float | None
    failed_cohorts: float
    queued_jobs: int


class DestinationPage(BaseModel):
    """The destinations with the most work (dead ones first), and how many there are."""
    total: int
    items: list[DestinationModel]


class ManagerStatsModel(BaseModel):
    claimed: int
    deliveries: int
    delivered: int
    deferred: int
    bounced: int
    unrouted: int
    started_at: float


class ConnectionStats(BaseModel):
    open: int
    idle: int
    connections_opened: int
    connections_reused: int
    connect_failures: int
    transactions: int


class ActiveQueueStats(BaseModel):
    memory_used: int
    maxmemoryqueue: int
    claim_pending: int
    routing: int
    queued_entries: int
    queued_jobs: int
    inflight_entries: int
    inflight_jobs: int
    max_deliveries: int
    subqueues: int
    parked_subqueues: int
    counter_entries: int
    destinations: int
    pickups: int


class SchedulerStats(BaseModel):
    """The node's scheduler, queue manager and connections in numbers."""
    node: str
    now: float
    uptime_s: float
    active_queue: ActiveQueueStats
    manager: ManagerStatsModel
    connections: ConnectionStats


class Rates(BaseModel):
    accepted: float
    delivered: float
    deferred: float
    bounced: float


class ThroughputPoint(BaseModel):
    at: float
    accepted: int
    delivered: int
    deferred: int
    bounced: int


class Throughput(BaseModel):
    """Recipients accepted, delivered, deferred and bounced by this node since the API started.

    Counted from the accounting log.
    """

    at: float
    totals: ThroughputPoint
    per_s_10s: Rates
    per_s_60s: Rates
    points: list[ThroughputPoint] = Field(description="cumulative totals, one per 5 s, "
                                                      "for the last 5 minutes")


# -- policy, suspensions, audit ------------------------------------------------------------


class SuspensionModel(BaseModel):
    """One suspension in force."""
    id: str
    fields: dict[str, str]
    automatic: bool = Field(description="false: added by hand; true: a counter over threshold")
    expires_at: float | None
    tag: str
    reason: str
    waiting_subqueues: int


class SuspensionList(BaseModel):
    """Suspensions in force: by hand, and counter entries over a threshold."""
    manual: list[SuspensionModel]
    automatic: list[SuspensionModel]
    automatic_total: int


class SuspensionResult(BaseModel):
    """The suspension as added, and the audit record of the change."""
    suspension: SuspensionModel | None
    audit_id: int


class ConditionResult(BaseModel):
    """The condition as added, where it went, and the audit record of the change."""
    counter: str
    condition: dict[str, Any]
    position: int
    audit_id: int


class ReloadResult(BaseModel):
    """The policy as reloaded, in numbers, and the audit record of the change."""
    source: str
    counters: int
    suspensions: int
    audit_id: int


class PolicyModel(BaseModel):
    """The running pickup policy and the files it comes from."""
    source: str = Field(description="where the running policy came from")
    path: str | None = Field(description="scheduler.policy: the file a reload reads")
    suspensions_file: str | None = Field(description="scheduler.suspensions: where "
                                                     "suspensions added here are kept")
    policy: dict[str, Any] = Field(description="counters and the file's suspensions, in "
                                               "Halon's spelling, with run-time conditions")


class AuditRecordModel(BaseModel):
    """One change in the audit history."""
    id: int
    at: float
    who: str
    action: str
    target: str
    reason: str
    before: Any
    after: Any
    reversible: bool = Field(description="whether a rollback could apply now: false for "
                                         "queue actions, and for a change a reload or restart "
                                         "ended or that expired")
    rollback_of: int | None
    rolled_back_by: int | None
    ends: list[int] = Field(description="earlier changes this one ended (a reload or a "
                                        "restart: the run-time conditions)")
    ended_by: int | None = Field(description="the reload or restart that ended this change")


class AuditPage(BaseModel):
    """One page of the audit history, and the cursor for older records."""
    records: list[AuditRecordModel] = Field(description="newest first")
    next: int | None = Field(description="pass as 'before' for older records")


class AuditRef(BaseModel):
    """The audit record of a change."""
    audit_id: int = Field(description="the audit record of the change")


class RollbackResult(BaseModel):
    """The record rolled back, and the audit record of the rollback."""
    rolled_back: int
    audit_id: int


class ClusterReport(BaseModel):
    """GET /api/v1/cluster (sluice.cluster.report): plain data.

    As `sluice cluster status --json` prints it.
    """

    node: str
    redis: dict[str, Any] | None
    postgres: dict[str, Any] | None
    nodes: dict[str, dict[str, Any]]
    leases: dict[str, dict[str, int]]
    this: dict[str, Any] | None = None
