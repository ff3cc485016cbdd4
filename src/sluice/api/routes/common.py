"""What the routers share: the bearer-token check, selectors, path types, error responses.

SUMMARY
    auth = Auth(tokens); Who = Annotated[str, Depends(auth)]
    selector_query (a dependency: a Selector from query parameters)
    E400, E404, E409, E503, COMMON (documented error responses)

SEE ALSO
    sluice.api.routes, sluice.api.auth
"""

# No "from __future__ import annotations": FastAPI reads these annotations.
from typing import Annotated, Any

from fastapi import Path as PathParam
from fastapi import Query, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from sluice.api.auth import Tokens
from sluice.api.control import Control
from sluice.api.errors import ApiError
from sluice.api.models import ErrorBody
from sluice.api.requests import ANY_ID_PATTERN, MAX_SELECTOR_IDS, QID_PATTERN
from sluice.model import QueueState, Selector

__all__ = ["COMMON", "E400", "E404", "E409", "E503", "AnyIdPath", "Auth", "Limit", "QidPath",
           "Reason", "selector_query"]


def _error(status: int, text: str) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": ErrorBody, "description": text}}


E400 = _error(400, "The body is not JSON, or the request makes no sense (an empty "
                   "selector for a change)")
E404 = _error(404, "Not found")
E409 = _error(409, "The current state forbids it: the running policy, the server's clock, "
                   "a change since")
E503 = _error(503, "The store or the queue manager cannot do it now")
COMMON: dict[int | str, dict[str, Any]] = {
    **_error(401, "No valid bearer token"),
    **_error(413, "The request body is too large"),
    **_error(422, "The request breaks the rules; 'detail' lists each problem by key path"),
}

_bearer = HTTPBearer(auto_error=False, scheme_name="token",
                     description="A token from the api.tokens setting")


class Auth:
    """A dependency: the name of the caller's token, or 401."""

    def __init__(self, tokens: Tokens) -> None:
        self.tokens = tokens

    async def __call__(self, request: Request,
                       _: Annotated[HTTPAuthorizationCredentials | None,
                                    Security(_bearer)]) -> str:
        """The name of the token in the Authorization header; a 401 with a challenge if none."""
        header = request.headers.get("authorization")
        who = self.tokens.who(header)
        if who is None:
            challenge = 'Bearer realm="sluice"' + (', error="invalid_token"'
                                                   if header is not None else "")
            raise ApiError(401, "unauthorized",
                           "a valid token is required: Authorization: Bearer <token>",
                           headers={"WWW-Authenticate": challenge})
        return who


def selector_query(
    qid: Annotated[list[Annotated[str, Query(max_length=64, pattern=ANY_ID_PATTERN)]],
                   Query(max_length=MAX_SELECTOR_IDS,
                         description="queue id or SPID (repeatable)")
                   ] = [],  # noqa: B006 - FastAPI copies defaults per request
    state: Annotated[list[QueueState], Query(max_length=6)] = [],  # noqa: B006
    domain: Annotated[str | None, Query(max_length=320)] = None,
    sender: Annotated[str | None, Query(max_length=320,
                                        description="'' selects the null sender")] = None,
    recipient: Annotated[str | None, Query(max_length=320)] = None,
    tenantid: Annotated[str | None, Query(max_length=320)] = None,
    jobid: Annotated[str | None, Query(max_length=320)] = None,
    transportid: Annotated[str | None, Query(max_length=320)] = None,
) -> Selector:
    """A selector from the query parameters of a listing."""
    return Control.selector(qid, state, domain=domain, sender=sender, recipient=recipient,
                            tenantid=tenantid, jobid=jobid, transportid=transportid)


QidPath = Annotated[str, PathParam(max_length=64, pattern=QID_PATTERN,
                                   description="a queue id: SPID-N")]
AnyIdPath = Annotated[str, PathParam(max_length=64, pattern=ANY_ID_PATTERN,
                                     description="a queue id (SPID-N) or a SPID")]
Limit = Annotated[int, Query(ge=1, le=10_000)]
Reason = Annotated[str, Query(min_length=1, max_length=500,
                              description="why: kept in the audit history")]
