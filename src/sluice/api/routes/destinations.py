"""The destination table: every destination's queue, state and last hour of outcomes.

SEE ALSO
    sluice.api.console (what it joins), docs/api.md, docs/operations.md
"""

# No "from __future__ import annotations": FastAPI reads these annotations.
from typing import Annotated

from fastapi import APIRouter, Depends, Query

from sluice.api.console import SortKey
from sluice.api.console_models import DestinationState, DestinationTable
from sluice.api.control import Control
from sluice.api.routes.common import COMMON, Auth, Limit

__all__ = ["router"]


def router(control: Control, auth: Auth) -> APIRouter:
    """The web page's destinations route."""
    ops = control.console
    api = APIRouter(prefix="/api/v1", dependencies=[Depends(auth)], responses=COMMON,
                    tags=["scheduler"])

    @api.get("/destinations", response_model=DestinationTable)
    async def destinations(
        q: Annotated[str | None, Query(max_length=253,
                                       description="part of the destination's name")] = None,
        state: DestinationState | None = None,
        sort: SortKey = "state",
        desc: Annotated[bool, Query(description="largest (or, for state, calmest) "
                                                "first")] = False,
        limit: Limit = 200,
    ) -> DestinationTable:
        """Every destination the scheduler or the last hour knows.

        Queued, in flight, delivered/deferred/bounced in 5 minutes and an hour,
        the last reply, its state.
        """
        return ops.destinations(q, state, sort, desc, limit)

    return api
