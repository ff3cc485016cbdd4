"""The charts' data: the last hour per second, the queue's size, the top deferral reasons.

SEE ALSO
    sluice.api.activity (the rings), sluice.api.console, docs/api.md
"""

# No "from __future__ import annotations": FastAPI reads these annotations.
from typing import Annotated

from fastapi import APIRouter, Depends, Query

from sluice.api.console_models import Charts
from sluice.api.control import Control
from sluice.api.routes.common import COMMON, Auth

__all__ = ["router"]


def router(control: Control, auth: Auth) -> APIRouter:
    """The web page's charts route."""
    ops = control.console
    api = APIRouter(prefix="/api/v1", dependencies=[Depends(auth)], responses=COMMON,
                    tags=["scheduler"])

    @api.get("/charts", response_model=Charts)
    async def charts(
        window_s: Annotated[int, Query(ge=60, le=3600, multiple_of=60)] = 3600,
        step_s: Annotated[int, Query(ge=1, le=60, description="seconds per point; the "
                                     "first point starts at a multiple of it")] = 10,
        top: Annotated[int, Query(ge=0, le=100)] = 10,
    ) -> Charts:
        """Recipients per second, the queue's size and the commonest deferral reasons.

        Recipients accepted, delivered, deferred and bounced per second, the
        queue's size (a sample per 10 s) and the commonest deferral reasons,
        over the window.
        """
        return ops.charts(window_s, step_s, top)

    return api
