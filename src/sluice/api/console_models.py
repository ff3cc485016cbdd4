"""What the operator console's own endpoints answer: headers, bodies, destinations, charts.

SUMMARY
    MessageHeaders, MessageBody      one message's header fields, its whole text
    DestinationRow, DestinationTable the destination table
    Charts                           the last hour per second, the queue's size,
                                     the top deferral reasons

DESCRIPTION
    Kept apart from sluice.api.models (the queue, scheduler and policy
    answers) so each file stays one idea; the same conventions hold:
    ``*_at`` POSIX seconds, ``*_s`` seconds, no untyped dicts.

SEE ALSO
    sluice.api.console, sluice.api.routes.messages, .destinations, .charts
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

__all__ = [
    "ChartPoint",
    "Charts",
    "DestinationRow",
    "DestinationState",
    "DestinationTable",
    "HeaderField",
    "MessageBody",
    "MessageHeaders",
    "QueuePoint",
    "ReasonCount",
]

DestinationState = Literal["normal", "slow start", "dead", "suspended", "back-off"]


class HeaderField(BaseModel):
    """One header field of a message."""
    name: str
    value: str = Field(description="as in the message, unfolded; encoded words left as they are")


class MessageHeaders(BaseModel):
    """The header section of a message (never its body)."""

    spid: str
    headers: list[HeaderField]
    truncated: bool = Field(description="the header section is longer than the API reads")
    body_allowed: bool = Field(description="whether the caller's token may read the body "
                                           "(api.body_tokens)")


class MessageBody(BaseModel):
    """The whole message as queued (headers and body), as text."""

    spid: str
    text: str = Field(description="decoded as UTF-8, undecodable bytes replaced")
    bytes: int = Field(description="bytes read")
    truncated: bool


class DestinationRow(BaseModel):
    """One destination: the scheduler's view joined with the last hour's outcomes."""

    destination: str
    state: DestinationState
    until_at: float | None = Field(description="when a dead, suspended or backed-off state "
                                               "ends, if known")
    queued: int = Field(description="recipients waiting in the active queue")
    inflight: int
    window: float | None = Field(description="slow-start window (None: not in the scheduler)")
    limit: int | None
    delivered_5m: int
    deferred_5m: int
    bounced_5m: int
    delivered_1h: int
    deferred_1h: int
    bounced_1h: int
    last_reply: str
    last_host: str
    last_at: float | None
    held_by: list[str]


class DestinationTable(BaseModel):
    """The destinations table: the rows shown, and how many passed the filter."""
    at: float
    total: int = Field(description="destinations that pass the filter, before the limit")
    items: list[DestinationRow]


class ChartPoint(BaseModel):
    """Recipients per second over one step."""
    at: float = Field(description="start of the step")
    accepted: float
    delivered: float
    deferred: float
    bounced: float


class QueuePoint(BaseModel):
    """The queue's size at one moment."""
    at: float
    recipients: int
    by_state: dict[str, int]


class ReasonCount(BaseModel):
    """A deferral reason and how often it was given."""
    reason: str = Field(description="the reply with queue ids, numbers and addresses masked")
    count: int


class Charts(BaseModel):
    """The last hour of this node, kept in memory since the API started."""

    at: float
    step_s: int
    window_s: int
    rates: list[ChartPoint] = Field(description="recipients per second, averaged over each step")
    queue: list[QueuePoint] = Field(description="the queue's size, one sample per 10 s")
    reasons: list[ReasonCount] = Field(description="the commonest deferral reasons of the "
                                                   "window")
