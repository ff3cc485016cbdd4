"""The suspensions' routes: list, add, lift.

SEE ALSO
    sluice.api.policy_ops (what they do), docs/api.md
"""

# No "from __future__ import annotations": FastAPI reads these annotations.
from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi import Path as PathParam

from sluice.api.control import Control
from sluice.api.models import AuditRef, SuspensionList, SuspensionResult
from sluice.api.requests import SuspensionRequest
from sluice.api.routes.common import COMMON, E400, E404, E409, E503, Auth, Limit, Reason

__all__ = ["router"]


def router(control: Control, auth: Auth) -> APIRouter:
    """The suspensions' routes: list, add and remove."""
    ops = control.policy_ops
    api = APIRouter(prefix="/api/v1", dependencies=[Depends(auth)], responses=COMMON,
                    tags=["policy"])
    Who = Annotated[str, Depends(auth)]

    @api.get("/suspensions", response_model=SuspensionList)
    async def suspensions(limit: Limit = 100) -> SuspensionList:
        """Suspensions by hand, and counters over their thresholds (automatic)."""
        return control.views.suspensions(limit)

    @api.post("/suspensions", response_model=SuspensionResult, status_code=201,
              responses={**E400, **E409, **E503})
    async def add_suspension(body: SuspensionRequest, who: Who) -> SuspensionResult:
        """Suspend pickup of mail that matches every given field.

        Halon: a suspension with the same fields only gets the new expiry, tag
        and reason.
        """
        return await ops.add_suspension(
            who, body.fields.model_dump(exclude_none=True), ttl=body.ttl,
            expires_at=body.expires_at, sid=body.id, tag=body.tag, reason=body.reason)

    @api.delete("/suspensions/{suspension_id}", response_model=AuditRef,
                responses={**E404, **E409, **E503})
    async def remove_suspension(suspension_id: Annotated[str, PathParam(max_length=512)],
                                reason: Reason, who: Who) -> AuditRef:
        """Lift a suspension made by hand."""
        return AuditRef(audit_id=await ops.remove_suspension(who, suspension_id, reason))

    return api
