"""The queue's routes: entries, counts, qshape, one entry or message, why, actions.

SEE ALSO
    sluice.api.queue_ops (what they do), docs/api.md
"""

# No "from __future__ import annotations": FastAPI reads these annotations.
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query
from fastapi import Path as PathParam

from sluice.api.control import Control
from sluice.api.models import (
    ActionResult,
    Counts,
    EntryModel,
    EntryPage,
    MessageModel,
    ShapeModel,
    WhyResponse,
)
from sluice.api.requests import ANY_ID_PATTERN, ActionRequest, EntryAction
from sluice.api.routes.common import (
    COMMON,
    E400,
    E404,
    E503,
    AnyIdPath,
    Auth,
    QidPath,
    selector_query,
)
from sluice.model import Selector
from sluice.store import Action

__all__ = ["router"]

#: The actions on one entry that take no value (priority has its own path).
EntryActionName = Literal["hold", "release", "retry", "delete", "bounce"]


def router(control: Control, auth: Auth) -> APIRouter:
    """The queue's routes: entries, counts, shape, actions, messages and why."""
    ops = control.queue_ops
    api = APIRouter(prefix="/api/v1", dependencies=[Depends(auth)], responses=COMMON,
                    tags=["queue"])
    Who = Annotated[str, Depends(auth)]
    Sel = Annotated[Selector, Depends(selector_query)]

    @api.get("/queue/entries", response_model=EntryPage, responses=E503)
    async def list_entries(
        selector: Sel,
        after: Annotated[str | None, Query(max_length=64, pattern=ANY_ID_PATTERN,
                                           description="the 'next' of the previous page")
                         ] = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ) -> EntryPage:
        """Entries in queue-id (arrival) order, a page at a time."""
        return await ops.entries(selector, after, limit)

    @api.get("/queue/counts", response_model=Counts, responses=E503)
    async def queue_counts(selector: Sel) -> Counts:
        """Messages and recipients, by state."""
        return await ops.counts(selector)

    @api.get("/queue/shape", response_model=ShapeModel, responses=E503)
    async def queue_shape(selector: Sel,
                          top: Annotated[int, Query(ge=0, le=100_000,
                                                    description="0: every domain")] = 0
                          ) -> ShapeModel:
        """Recipients per domain by age (Postfix's qshape)."""
        return await ops.shape(selector, top)

    @api.post("/queue/actions", response_model=ActionResult, responses={**E400, **E503})
    async def queue_action(body: ActionRequest, who: Who) -> ActionResult:
        """Hold, release, retry, bounce, delete or set the priority of selected entries.

        Or count them: dry_run.
        """
        sel = body.selector
        selector = Control.selector(sel.qids, sel.states, domain=sel.domain,
                                    sender=sel.sender, recipient=sel.recipient,
                                    tenantid=sel.tenantid, jobid=sel.jobid,
                                    transportid=sel.transportid)
        return await ops.act(who, body.action, selector, all_=body.all, dry_run=body.dry_run,
                             priority=body.priority, reason=body.reason)

    @api.get("/queue/entries/{qid}", response_model=EntryModel, responses={**E404, **E503})
    async def get_entry(qid: QidPath) -> EntryModel:
        """One recipient entry."""
        return await ops.entry(qid)

    @api.post("/queue/entries/{qid}/priority/{value}", response_model=ActionResult,
              responses={**E400, **E404, **E503})
    async def entry_priority(qid: QidPath,
                             value: Annotated[int, PathParam(ge=0, le=1,
                                                             description="0 normal, 1 high")],
                             who: Who,
                             body: EntryAction | None = None) -> ActionResult:
        """Set the priority of one entry: 0 normal, 1 high."""
        body = body or EntryAction()
        await ops.entry(qid)
        return await ops.act(who, Action.PRIORITY, Control.selector((qid,)), all_=False,
                             dry_run=body.dry_run, priority=value, reason=body.reason)

    # The parameter is not called "action": ActionResult has a field of that
    # name whose values include "priority", which this path does not take.
    @api.post("/queue/entries/{qid}/actions/{action_name}", response_model=ActionResult,
              responses={**E400, **E404, **E503})
    async def entry_action(qid: QidPath, action_name: EntryActionName, who: Who,
                           body: EntryAction | None = None) -> ActionResult:
        """Hold, release, retry, delete or bounce one entry."""
        body = body or EntryAction()
        await ops.entry(qid)
        return await ops.act(who, Action(action_name), Control.selector((qid,)), all_=False,
                             dry_run=body.dry_run, priority=None, reason=body.reason)

    @api.get("/queue/entries/{qid}/why", response_model=WhyResponse,
             responses={**E404, **E503})
    async def why(qid: AnyIdPath) -> WhyResponse:
        """Why an entry waits, and when it is expected to go."""
        return await ops.why(qid)

    @api.get("/messages/{spid}", response_model=MessageModel, responses={**E404, **E503})
    async def message(spid: AnyIdPath) -> MessageModel:
        """One message: its recipients still queued and its whole history."""
        return await ops.message(spid)

    return api
