"""What a client may send the REST API: request bodies, and the rules their fields keep.

SUMMARY
    Pydantic models, one per request body (ActionRequest, SuspensionRequest,
    ConditionRequest, ...), and the patterns of ids, durations and rates;
    FastAPI renders them into the OpenAPI document, so the document is the
    code.

DESCRIPTION
    Requests forbid unknown keys (a typo is an error, never ignored) and
    bound every string, list and number, so nothing a client sends can
    make the server do unbounded work.

STRATEGIES
    The document promises nothing the server refuses, and the server takes
    nothing the document refuses: every rule of a request's shape is in
    its schema -- a selector that names entries unless "all" is true, a
    ttl from 1 s to 366 days (a pattern that spells exactly those
    numbers), ttl or expires_at but not both, suspension values without
    patterns, a rate whose interval is more than 0 -- and the server
    checks the same (pydantic, or the operation, with the same answer).
    What a schema cannot say depends on the state (the running policy,
    the server's clock) and is refused with 409.  Numbers follow JSON:
    1.0 is a whole number.  An optional field is left out, never null,
    where null could read as a value.  The schemathesis test
    (tests/integration/test_api_schema.py) holds the server to this.

SEE ALSO
    sluice.api.models (the responses), sluice.api.routes, docs/api.md
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator
from pydantic.config import JsonDict
from pydantic.json_schema import SkipJsonSchema

from sluice.model import QueueState
from sluice.store import Action

__all__ = [
    "ANY_ID_PATTERN",
    "EXACT_HOST_PATTERN",
    "EXACT_VALUE_PATTERN",
    "ID_PATTERN",
    "MAX_SELECTOR_IDS",
    "QID_PATTERN",
    "RATE_PATTERN",
    "SPID_PATTERN",
    "TTL_PATTERN",
    "ActionRequest",
    "ChangeRequest",
    "ConditionRequest",
    "EntryAction",
    "FieldValues",
    "Priority",
    "RollbackRequest",
    "SelectorModel",
    "SuspensionFields",
    "SuspensionRequest",
    "at_most",
]

#: Ids of conditions and suspensions (as the policy file allows).
ID_PATTERN = r"^[A-Za-z0-9_.:@=,#+-]{1,128}$"

#: A queue id (SPID-N); a SPID alone (every recipient of the message); either.
QID_PATTERN = r"^\s*[0-9A-Fa-f]{8,32}-[0-9]{1,6}\s*$"
SPID_PATTERN = r"^\s*[0-9A-Fa-f]{8,32}\s*$"
ANY_ID_PATTERN = r"^\s*[0-9A-Fa-f]{8,32}(-[0-9]{1,6})?\s*$"


def at_most(n: int) -> str:
    """A regular expression for the whole numbers 1..n written without leading zeros."""
    digits = str(n)
    k = len(digits)
    alts = [f"[1-9][0-9]{{0,{k - 2}}}"] if k > 1 else []
    for i, ch in enumerate(digits):
        low, top = (1 if i == 0 else 0), int(ch) - 1
        if top >= low:
            rest = k - i - 1
            alts.append(digits[:i] + f"[{low}-{top}]" + (f"[0-9]{{{rest}}}" if rest else ""))
    alts.append(digits)
    return "(" + "|".join(alts) + ")"


#: How long a suspension or condition lasts: a whole number of seconds (the
#: "s" optional), minutes, hours or days, from 1 s up to 366 days -- exactly
#: what the server accepts, so the document promises no ttl it would refuse.
TTL_PATTERN = (f"^({at_most(366 * 86400)}s?|{at_most(366 * 1440)}m|{at_most(366 * 24)}h"
               f"|{at_most(366)}d)$")

#: The most queue ids one selector may name (each is a term of the store's query).
MAX_SELECTOR_IDS = 200

#: A rate: X (per second) or X/Y (X per Y seconds, Y more than 0).
RATE_PATTERN = r"^[0-9]+(/(0*[1-9][0-9]*(\.[0-9]+)?|0+\.[0-9]*[1-9][0-9]*))?$"

#: A value a suspension matches exactly: no "*" and not a /regex/ (the
#: scheduler's Pattern.is_pattern), which only conditions take.
EXACT_VALUE_PATTERN = r"^([^*/][^*]*|/|/[^*]*[^*/i]|/[^*]*[^*/]i)$"

#: The same for a host field (recipientdomain, remotemx, remoteip, localip),
#: which also has no white space (sluice.scheduler.policy_parse refuses
#: what Python's str.isspace() calls space: the control range and NEL are
#: named here because JSON Schema's \s does not count them).
_NO_SPACE = r"\s\x00-\x20\x7f-\xa0"
EXACT_HOST_PATTERN = EXACT_VALUE_PATTERN.replace("[^*", "[^*" + _NO_SPACE)

def _whole(value: Any) -> Any:
    # JSON has one number type: 1.0 is an integer to JSON Schema, so it is one here.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


_Text = Annotated[str, Field(max_length=320)]
_Reason = Annotated[str, Field(min_length=1, max_length=500,
                               description="Why: kept in the audit history")]
_State = Annotated[QueueState, Field(strict=False)]  # FastAPI hands over the JSON string
_Whole = BeforeValidator(_whole)
Priority = Annotated[int, Field(ge=0, le=1), _Whole]  # 0 normal, 1 high; 1.0 is 1
_Count = Annotated[int, Field(ge=0, le=1_000_000), _Whole]
# Optional, but never null in the document: leave the field out instead.
_Value = Annotated[str, Field(min_length=1, max_length=253)] | SkipJsonSchema[None]
_Exact = Annotated[str, Field(min_length=1, max_length=253,
                              pattern=EXACT_VALUE_PATTERN)] | SkipJsonSchema[None]
_ExactHost = Annotated[str, Field(min_length=1, max_length=253,
                                  pattern=EXACT_HOST_PATTERN)] | SkipJsonSchema[None]


class _Request(BaseModel):
    # Strict: 0 is not false, "1" is not 1 -- a body means what its types say.
    model_config = ConfigDict(extra="forbid", strict=True)



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


def _given(name: str) -> JsonDict:
    return {"required": [name], "properties": {name: {"type": "string"}}}


#: A selector that names entries: at least one criterion given (a null is none).
_NON_EMPTY_SELECTOR: JsonDict = {"anyOf": [
    {"required": ["qids"], "properties": {"qids": {"minItems": 1}}},
    {"required": ["states"], "properties": {"states": {"minItems": 1}}},
    *[_given(name)
      for name in ("domain", "sender", "recipient", "tenantid", "jobid", "transportid")],
]}


class ActionRequest(_Request):
    """An action on the entries a selector matches.

    ``priority`` goes with action 'priority', and only with it; a selector
    that names no entries needs "all": true.
    """
    # 'priority' goes with action 'priority', and only with it; a selector
    # that names no entries needs "all": true.
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={
        "if": {"properties": {"action": {"const": "priority"}}, "required": ["action"]},
        "then": {"required": ["priority"], "properties": {"priority": {"type": "integer"}}},
        "else": {"properties": {"priority": {"type": "null"}}},
        "anyOf": [
            {"required": ["all"], "properties": {"all": {"const": True}}},
            {"required": ["selector"], "properties": {"selector": _NON_EMPTY_SELECTOR}},
        ],
    })

    action: Annotated[Action, Field(strict=False)]  # FastAPI hands over the JSON string
    selector: SelectorModel = Field(default_factory=SelectorModel)
    all: bool = Field(default=False, description="allow an empty selector (the whole queue)")
    dry_run: bool = Field(default=False, description="only count what would change")
    priority: Priority | None = Field(default=None,
                                       description="for action 'priority': 0 normal, 1 high")
    reason: str = Field(default="", max_length=500)


class EntryAction(_Request):
    """An action on one entry: a dry run, or the reason kept in the audit history."""
    dry_run: bool = False
    reason: str = Field(default="", max_length=500)



class _Values(_Request):
    """Field values; a field left out is none, a null is refused.

    The document shows no null, so the server takes none.
    """

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"minProperties": 1})

    @model_validator(mode="before")
    @classmethod
    def _no_nulls(cls, data: Any) -> Any:
        if isinstance(data, dict):
            nulls = sorted(str(k) for k, v in data.items() if v is None)
            if nulls:
                raise ValueError(f"leave out a field instead of null: {', '.join(nulls)}")
        return data


class FieldValues(_Values):
    """Values a condition matches: exact, a wildcard or a /regex/ (one field at least)."""

    tenantid: _Value = None
    jobid: _Value = None
    transportid: _Value = None
    localip: _Value = None
    grouping: _Value = None
    remoteip: _Value = None
    remotemx: _Value = None
    recipientdomain: _Value = None



class SuspensionFields(_Values):
    """The values a suspension matches exactly (one field at least; no patterns)."""

    tenantid: _Exact = None
    jobid: _Exact = None
    transportid: _Exact = None
    localip: _ExactHost = None
    grouping: _Exact = None
    remoteip: _ExactHost = None
    remotemx: _ExactHost = None
    recipientdomain: _ExactHost = None


#: 'ttl' or 'expires_at', not both.
_ONE_EXPIRY: JsonDict = {"not": {"required": ["ttl", "expires_at"],
                       "properties": {"ttl": {"type": "string"},
                                      "expires_at": {"type": "number"}}}}


class _Expiry(_Request):
    ttl: str | None = Field(default=None, max_length=16, pattern=TTL_PATTERN,
                            description="how long it lasts, 1 s to 366 days: '90s' (or 90), "
                                        "'30m', '2h', '1d'")
    expires_at: float | None = Field(
        default=None, allow_inf_nan=False,
        description="when it ends (POSIX seconds); a time outside the coming 366 days by "
                    "the server's clock is refused with 409")


class SuspensionRequest(_Expiry):
    """A suspension to add: its fields, expiry, id, tag and reason."""
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra=_ONE_EXPIRY)

    fields: SuspensionFields
    id: str | None = Field(default=None, pattern=ID_PATTERN)
    tag: str = Field(default="", max_length=128)
    reason: _Reason



class ConditionRequest(_Expiry):
    """A condition to add to a counter of the running policy."""
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True,
                              json_schema_extra=_ONE_EXPIRY)

    counter: str = Field(min_length=1, max_length=256, description="the counter's id")
    match: FieldValues = Field(alias="if", description="the values to match")
    concurrency: _Count | None = None
    rate: _Count | Annotated[str, Field(max_length=32, pattern=RATE_PATTERN)] | None = Field(
        default=None, description="X per second, or 'X/Y': X per Y seconds")
    connectinterval: float | None = Field(default=None, ge=0, le=86400, allow_inf_nan=False)
    position: Annotated[int, Field(ge=0, le=10_000), _Whole] = Field(
        default=0, description="where among the counter's conditions (0: first)")
    id: str | None = Field(default=None, pattern=ID_PATTERN)
    tag: str = Field(default="", max_length=128)
    reason: _Reason



class ChangeRequest(_Request):
    """Why a change is made, for the audit history."""
    reason: _Reason



class RollbackRequest(_Request):
    """Why a change is rolled back, and whether to roll a reload back anyway."""
    reason: _Reason
    force: bool = Field(default=False, description="roll a policy reload back even if the "
                                                   "policy changed since")


