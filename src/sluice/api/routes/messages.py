"""A message's content: its header fields, and its whole text for tokens allowed to read it.

Finding messages is GET /queue/entries and one message's recipients and
history GET /messages/{spid} (sluice.api.routes.queue); these two add
what the console's message page shows beside them.

SEE ALSO
    sluice.api.console (what they do), docs/api.md, docs/operations.md
"""

# No "from __future__ import annotations": FastAPI reads these annotations.
from typing import Annotated, Any

from fastapi import APIRouter, Depends

from sluice.api.console_models import MessageBody, MessageHeaders
from sluice.api.control import Control
from sluice.api.models import ErrorBody
from sluice.api.routes.common import COMMON, E404, E503, AnyIdPath, Auth

__all__ = ["router"]

E403: dict[int | str, dict[str, Any]] = {
    403: {"model": ErrorBody, "description": "The token may not read message bodies "
                                             "(api.body_tokens)"}}


def router(control: Control, auth: Auth) -> APIRouter:
    """The routes that read a queued message's headers and body."""
    ops = control.console
    api = APIRouter(prefix="/api/v1", dependencies=[Depends(auth)], responses=COMMON,
                    tags=["queue"])
    Who = Annotated[str, Depends(auth)]

    @api.get("/messages/{spid}/headers", response_model=MessageHeaders,
             responses={**E404, **E503})
    async def message_headers(spid: AnyIdPath, who: Who) -> MessageHeaders:
        """The header fields of a queued message (not its body)."""
        return await ops.headers(spid, who)

    @api.get("/messages/{spid}/body", response_model=MessageBody,
             responses={**E403, **E404, **E503})
    async def message_body(spid: AnyIdPath, who: Who) -> MessageBody:
        """The whole text of a queued message: only for tokens in api.body_tokens."""
        return await ops.body(spid, who)

    return api
