"""POST /api/v1/inject: the HTTP injection API's route and models.

SUMMARY
    app.include_router(inject_router(control, principal, responses=COMMON))

DESCRIPTION
    A batch of messages, each a complete RFC 5322 message (``content`` a
    string) or a template (``content`` an object: from, subject, text and
    HTML parts, headers) with substitutions per recipient; envelope
    sender, recipients, tenant, job and priority; an idempotency key per
    recipient, or one for the request in the Idempotency-Key header.
    The shape follows KumoMTA's injection API, batched.

    The answer is per recipient: ``queued`` with its queue id, or
    ``refused`` with an SMTP code and reason (4xx: try again, 5xx: do
    not).  A 200 means what a 250 means: every recipient answered
    ``queued`` is on stable storage.  429 (the queue is over
    ``api.inject.max_queue``) and 503 (the store is slow or failing)
    come with Retry-After, and nothing of the request was queued.

    The work is done by sluice.api.injector; this module only declares.

SEE ALSO
    sluice.api.injector, sluice.idempotency, docs/api.md
"""

# No "from __future__ import annotations": FastAPI reads the route's annotations.
from collections.abc import Callable, Coroutine
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Header, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.config import JsonDict

from sluice.api.control import Control
from sluice.api.models import ErrorBody
from sluice.api.requests import Priority

__all__ = [
    "InjectMessage",
    "InjectRecipient",
    "InjectRequest",
    "InjectResult",
    "MessageResult",
    "RecipientResult",
    "TemplateContent",
    "inject_router",
]

#: Messages in one request (recipients are bounded by api.inject.max_recipients).
MAX_MESSAGES = 1000

#: An idempotency key: printable ASCII, as HTTP's Idempotency-Key header.
KEY_PATTERN = r"^[\x21-\x7e]{0,200}$"

#: The Idempotency-Key header: the same characters, at least one.
REQUEST_KEY_PATTERN = r"^[\x21-\x7e]{1,200}$"

REQUEST_KEY_HELP = (
    "A key for the whole request (HTTP's Idempotency-Key). Every recipient without an "
    "idempotency_key of its own gets the key '<this> <message index>.<recipient index>': "
    "sending the same request again with the same header (per token, within "
    "api.inject.idempotency_window) is answered with the first queue ids, "
    "duplicate: true, and queues nothing. A recipient's own idempotency_key wins.")

_Address = Annotated[str, Field(min_length=3, max_length=320)]
_Field = Annotated[str, Field(min_length=1, max_length=100, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]
_Value = Annotated[str, Field(max_length=10_000)] | int | float | bool | None
# patternProperties alone would let the schema allow keys the server refuses.
_Substitutions = Annotated[dict[_Field, _Value],
                           Field(max_length=200,
                                 json_schema_extra={"additionalProperties": False})]
_Header = Annotated[str, Field(min_length=1, max_length=76, pattern=r"^[!-9;-~]+$")]
_Tag = Annotated[str, Field(max_length=128, pattern=r"^[A-Za-z0-9_.:@=,#+-]*$")]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


#: At least one of the bodies, not empty (the schema's word for _a_body).
_A_BODY: JsonDict = {"anyOf": [{"required": [name], "properties": {name: {"minLength": 1}}}
                     for name in ("text_body", "html_body")]}


class TemplateContent(_Request):
    """A message built from templates.

    Jinja2, sandboxed; a missing substitution refuses the recipient rather
    than leave a gap.
    """

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True,
                              json_schema_extra=_A_BODY)

    from_: str = Field(alias="from", min_length=3, max_length=998,
                       description="the From header, e.g. 'Shop <news@shop.example>'")
    subject: str = Field(max_length=998)
    text_body: str = Field(default="", max_length=1_000_000, description="'': no text part")
    html_body: str = Field(default="", max_length=1_000_000, description="'': no HTML part")
    headers: Annotated[dict[_Header, Annotated[str, Field(max_length=998)]],
                       Field(max_length=50, json_schema_extra={"additionalProperties": False})
                       ] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _a_body(self) -> "TemplateContent":
        if not self.text_body and not self.html_body:
            raise ValueError("a template needs text_body, html_body or both")
        return self


class InjectRecipient(_Request):
    """One recipient of an injected message, with its own substitutions."""
    email: _Address
    name: Annotated[str, Field(max_length=200)] = ""
    substitutions: _Substitutions = Field(default_factory=dict)
    idempotency_key: Annotated[str, Field(pattern=KEY_PATTERN)] = Field(
        default="", description="'': none. The same key (per token, within api.inject."
                                  "idempotency_window) is answered with the first queue id "
                                  "and queued once")


class InjectMessage(_Request):
    """One message to inject: its sender, its content or template, and its recipients."""
    envelope_sender: _Address
    content: Annotated[str, Field(min_length=1, max_length=1_000_000)] | TemplateContent = Field(
        description="a complete RFC 5322 message, or a template")
    recipients: Annotated[list[InjectRecipient], Field(min_length=1, max_length=10_000)]
    substitutions: _Substitutions = Field(default_factory=dict,
                                          description="for every recipient; theirs win")
    tenant: _Tag = ""
    job: _Tag = ""
    priority: Priority = 0


class InjectRequest(_Request):
    """A batch of messages to queue."""
    messages: Annotated[list[InjectMessage], Field(min_length=1, max_length=MAX_MESSAGES)]


class RecipientResult(BaseModel):
    """What became of one recipient: queued with its queue id, or refused with why."""
    email: str
    status: Literal["queued", "refused"]
    queue_id: str | None = Field(default=None, description="SPID-N, when queued")
    code: int | None = Field(default=None, description="when refused: 4xx try again, 5xx not")
    enhanced: str | None = None
    reason: str | None = None
    duplicate: bool = Field(default=False, description="answered from the idempotency index: "
                                                       "queued by an earlier request")


class MessageResult(BaseModel):
    """What became of each recipient of one message, in request order."""
    recipients: list[RecipientResult]


class InjectResult(BaseModel):
    """What became of a batch: the counts, and the result per message."""
    queued: int
    refused: int
    duplicates: int
    messages: list[MessageResult]


_BUSY = {"model": ErrorBody, "description": "Busy: try again after Retry-After seconds",
         "headers": {"Retry-After": {"schema": {"type": "integer"},
                                     "description": "seconds to wait"}}}


def inject_router(control: Control, principal: Callable[..., Coroutine[Any, Any, str]],
                  responses: dict[int | str, dict[str, Any]] | None = None) -> APIRouter:
    """The route, authenticated by ``principal`` (the API's token check)."""
    from sluice.api.injector import Injector

    injector = Injector(control)
    router = APIRouter(prefix="/api/v1", responses=responses or {})

    @router.post("/inject", response_model=InjectResult, tags=["inject"],
                 responses={400: {"model": ErrorBody, "description": "The body is not JSON"},
                            429: _BUSY, 503: _BUSY})
    async def inject(body: InjectRequest, request: Request,
                     who: Annotated[str, Depends(principal)],
                     idempotency_key: Annotated[str | None, Header(
                         alias="Idempotency-Key", pattern=REQUEST_KEY_PATTERN,
                         description=REQUEST_KEY_HELP)] = None) -> dict[str, Any]:
        """Queue a batch of messages; the answer is per recipient.

        200 means every recipient answered 'queued' is on stable storage.
        """
        client = request.client.host if request.client is not None else "unknown"
        return await injector.inject(body, who, client, request_key=idempotency_key)

    return router
