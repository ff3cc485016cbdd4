"""The shapes the REST API speaks: request bodies and responses.

SUMMARY
    Pydantic models, one per request body and response; FastAPI renders
    them into the OpenAPI document, so the document is the code.

DESCRIPTION
    Requests forbid unknown keys (a typo is an error, never ignored) and
    bound every string, list and number, so nothing a client sends can
    make the server do unbounded work.  Responses mirror the plain data
    the queue core and scheduler hand out (QueueEntry, Explanation, the
    scheduler's views); times are POSIX seconds (``*_at``), durations
    seconds (``*_s``), as everywhere in Sluice.

SEE ALSO
    sluice.api.app (the routes), docs/api.md
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import SkipJsonSchema

from sluice.model import QueueState
from sluice.store import Action

__all__ = [
    "ID_PATTERN",
    "MAX_SELECTOR_IDS",
    "ActionRequest",
    "ActionResult",
    "AuditPage",
    "AuditRecordModel",
    "AuditRef",
    "ChangeRequest",
    "ConditionRequest",
    "ConditionResult",
    "CounterModel",
    "CounterPage",
    "Counts",
    "DestinationModel",
    "DestinationPage",
    "EntryAction",
    "EntryModel",
    "EntryPage",
    "ErrorBody",
    "ExplanationModel",
    "FieldValues",
    "Health",
    "HistoryEvent",
    "MessageModel",
    "PolicyModel",
    "Problem",
    "ReloadResult",
    "RollbackRequest",
    "RollbackResult",
    "SchedulerStats",
    "SelectorModel",
    "ShapeModel",
    "SubQueueModel",
    "SubQueuePage",
    "SuspensionList",
    "SuspensionModel",
    "SuspensionRequest",
    "SuspensionResult",
    "Throughput",
    "WhyResponse",
]

#: Ids of conditions and suspensions (as the policy file allows).
ID_PATTERN = r"^[A-Za-z0-9_.:@=,#+-]{1,128}$"

#: A queue id (SPID-N); a SPID alone (every recipient of the message); either.
QID_PATTERN = r"^\s*[0-9A-Fa-f]{8,32}-[0-9]{1,6}\s*$"
SPID_PATTERN = r"^\s*[0-9A-Fa-f]{8,32}\s*$"
ANY_ID_PATTERN = r"^\s*[0-9A-Fa-f]{8,32}(-[0-9]{1,6})?\s*$"

#: Durations as the configuration spells them: 90, 90s, 30m, 1h30m, 2d.
DURATION_PATTERN = r"^\s*([0-9]+(\.[0-9]+)?\s*[smhdSMHD]?\s*)+$"

#: A rate: X (per second) or X/Y (X per Y seconds).
#: The most queue ids one selector may name (each is a term of the store's query).
MAX_SELECTOR_IDS = 200

RATE_PATTERN = r"^\s*[0-9]+\s*(/\s*[0-9]+(\.[0-9]+)?\s*)?$"

_Text = Annotated[str, Field(max_length=320)]
_Reason = Annotated[str, Field(min_length=1, max_length=500,
                               description="Why: kept in the audit history")]
_State = Annotated[QueueState, Field(strict=False)]  # FastAPI hands over the JSON string
_Priority = Annotated[int, Field(strict=True, ge=0, le=1)]
_Count = Annotated[int, Field(ge=0, le=1_000_000)]
# Optional, but never null in the document: leave the field out instead.
_Value = Annotated[str, Field(min_length=1, max_length=253)] | SkipJsonSchema[None]


class _Request(BaseModel):
    # Strict: 0 is not false, "1" is not 1 -- a body means what its types say.
    model_config = ConfigDict(extra="forbid", strict=True)


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


class SelectorModel(_Request):
    """Which entries: every given criterion must match (AND)."""

    qids: list[Annotated[str, Field(max_length=64, pattern=ANY_ID_PATTERN)]] = Field(
        default_factory=list, max_length=MAX_SELECTOR_IDS,
        description="queue ids (SPID-N) or SPIDs (all recipients of the message)")
    states: list[_State] = Field(default_factory=list, max_length=6)
    domain: _Text | None = None
    sender: _Text | None = Field(default=None, description="'' selects the null sender")
    recipient: _Text | None = None
    tenantid: _Text | None = None
    jobid: _Text | None = None
    transportid: _Text | None = None


class ActionRequest(_Request):
    # 'priority' goes with action 'priority', and only with it.
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={
        "if": {"properties": {"action": {"const": "priority"}}, "required": ["action"]},
        "then": {"required": ["priority"], "properties": {"priority": {"type": "integer"}}},
        "else": {"properties": {"priority": {"type": "null"}}},
    })

    action: Annotated[Action, Field(strict=False)]  # FastAPI hands over the JSON string
    selector: SelectorModel = Field(default_factory=SelectorModel)
    all: bool = Field(default=False, description="allow an empty selector (the whole queue)")
    dry_run: bool = Field(default=False, description="only count what would change")
    priority: _Priority | None = Field(default=None,
                                       description="for action 'priority': 0 normal, 1 high")
    reason: str = Field(default="", max_length=500)


class EntryAction(_Request):
    dry_run: bool = False
    priority: _Priority | None = None
    reason: str = Field(default="", max_length=500)


class ActionResult(BaseModel):
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
    qid: str
    state: str
    reasons: list[ReasonModel]
    expected_at: float | None
    ahead: int
    source: str = Field(description="'memory' (the running scheduler) or 'store'")
    lines: list[str] = Field(description="the same, as sentences")


class WhyResponse(BaseModel):
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
    route: RouteModel
    priority: int
    jobs: int
    entries: int
    parked: bool
    held_by: list[str]


class SubQueuePage(BaseModel):
    total: int
    items: list[SubQueueModel]


class CounterModel(BaseModel):
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
    total: int
    items: list[CounterModel]


class DestinationModel(BaseModel):
    destination: str
    window: float
    limit: int
    inflight: int
    dead: bool
    dead_until_at: float | None
    failed_cohorts: float
    queued_jobs: int


class DestinationPage(BaseModel):
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
    """Recipients accepted, delivered, deferred and bounced by this node
    (from the accounting log), since the API started."""

    at: float
    totals: ThroughputPoint
    per_s_10s: Rates
    per_s_60s: Rates
    points: list[ThroughputPoint] = Field(description="cumulative totals, one per 5 s, "
                                                      "for the last 5 minutes")


# -- policy, suspensions, audit ------------------------------------------------------------


class FieldValues(_Request):
    """Values of the fields a counter, condition or suspension names (one at least)."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"minProperties": 1})

    tenantid: _Value = None
    jobid: _Value = None
    transportid: _Value = None
    localip: _Value = None
    grouping: _Value = None
    remoteip: _Value = None
    remotemx: _Value = None
    recipientdomain: _Value = None


class SuspensionModel(BaseModel):
    id: str
    fields: dict[str, str]
    automatic: bool = Field(description="false: added by hand; true: a counter over threshold")
    expires_at: float | None
    tag: str
    reason: str
    waiting_subqueues: int


class SuspensionList(BaseModel):
    manual: list[SuspensionModel]
    automatic: list[SuspensionModel]
    automatic_total: int


class _Expiry(_Request):
    ttl: str | None = Field(default=None, max_length=32, pattern=DURATION_PATTERN,
                            description="how long it lasts: '30m', '2h', '1d' or seconds")
    expires_at: float | None = Field(default=None, allow_inf_nan=False,
                                     description="when it ends (POSIX seconds)")


class SuspensionRequest(_Expiry):
    fields: FieldValues
    id: str | None = Field(default=None, pattern=ID_PATTERN)
    tag: str = Field(default="", max_length=128)
    reason: _Reason


class SuspensionResult(BaseModel):
    suspension: SuspensionModel | None
    audit_id: int


class ConditionRequest(_Expiry):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    counter: str = Field(min_length=1, max_length=256, description="the counter's id")
    match: FieldValues = Field(alias="if", description="the values to match")
    concurrency: int | None = Field(default=None, ge=0, le=1_000_000)
    rate: _Count | Annotated[str, Field(max_length=32, pattern=RATE_PATTERN)] | None = Field(
        default=None, description="X per second, or 'X/Y': X per Y seconds")
    connectinterval: float | None = Field(default=None, ge=0, le=86400, allow_inf_nan=False)
    position: int = Field(default=0, ge=0, le=10_000,
                          description="where among the counter's conditions (0: first)")
    id: str | None = Field(default=None, pattern=ID_PATTERN)
    tag: str = Field(default="", max_length=128)
    reason: _Reason


class ConditionResult(BaseModel):
    counter: str
    condition: dict[str, Any]
    position: int
    audit_id: int


class ChangeRequest(_Request):
    reason: _Reason


class ReloadResult(BaseModel):
    source: str
    counters: int
    suspensions: int
    audit_id: int


class PolicyModel(BaseModel):
    source: str = Field(description="where the running policy came from")
    path: str | None = Field(description="scheduler.policy: the file a reload reads")
    suspensions_file: str | None = Field(description="scheduler.suspensions: where "
                                                     "suspensions added here are kept")
    policy: dict[str, Any] = Field(description="counters and the file's suspensions, in "
                                               "Halon's spelling, with run-time conditions")


class AuditRecordModel(BaseModel):
    id: int
    at: float
    who: str
    action: str
    target: str
    reason: str
    before: Any
    after: Any
    reversible: bool
    rollback_of: int | None
    rolled_back_by: int | None


class AuditPage(BaseModel):
    records: list[AuditRecordModel] = Field(description="newest first")
    next: int | None = Field(description="pass as 'before' for older records")


class RollbackRequest(_Request):
    reason: _Reason
    force: bool = Field(default=False, description="roll a policy reload back even if the "
                                                   "policy changed since")


class AuditRef(BaseModel):
    audit_id: int = Field(description="the audit record of the change")


class RollbackResult(BaseModel):
    rolled_back: int
    audit_id: int


class ClusterReport(BaseModel):
    """GET /api/v1/cluster (sluice.cluster.report): plain data, as `sluice cluster
    status --json` prints it."""

    node: str
    redis: dict[str, Any] | None
    postgres: dict[str, Any] | None
    nodes: dict[str, dict[str, Any]]
    leases: dict[str, dict[str, int]]
    this: dict[str, Any] | None = None
