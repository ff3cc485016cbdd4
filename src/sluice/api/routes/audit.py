"""The audit history's routes: pages of records, one record, a rollback.

SEE ALSO
    sluice.api.audit (the history), sluice.api.rollback, docs/api.md
"""

# No "from __future__ import annotations": FastAPI reads these annotations.
from typing import Annotated

from fastapi import APIRouter, Depends, Query
from fastapi import Path as PathParam

from sluice.api.audit import AuditRecord
from sluice.api.control import Control
from sluice.api.errors import ApiError
from sluice.api.models import AuditPage, AuditRecordModel, RollbackResult
from sluice.api.requests import RollbackRequest
from sluice.api.routes.common import COMMON, E400, E404, E409, E503, Auth

__all__ = ["router"]


def router(control: Control, auth: Auth) -> APIRouter:
    """The audit history's routes."""
    history = control.audit
    api = APIRouter(prefix="/api/v1", dependencies=[Depends(auth)], responses=COMMON,
                    tags=["audit"])
    Who = Annotated[str, Depends(auth)]

    def model(rec: AuditRecord) -> AuditRecordModel:
        return AuditRecordModel.model_validate({
            **rec.to_data(), "reversible": history.reversible_now(rec, control.clock()),
            "rolled_back_by": history.rolled_back_by(rec.id),
            "ended_by": history.ended_by(rec.id)})

    @api.get("/audit", response_model=AuditPage)
    async def audit_list(limit: Annotated[int, Query(ge=1, le=1000)] = 50,
                         before: Annotated[int | None, Query(ge=1)] = None) -> AuditPage:
        """Changes to the queue and the policy (API, command line, reloads), newest first."""
        records, nxt = history.page(limit, before)
        return AuditPage(records=[model(r) for r in records], next=nxt)

    @api.get("/audit/{record_id}", response_model=AuditRecordModel, responses=E404)
    async def audit_get(record_id: Annotated[int, PathParam(ge=1)]) -> AuditRecordModel:
        """One change."""
        rec = history.get(record_id)
        if rec is None:
            raise ApiError(404, "not found", f"no audit record {record_id}")
        return model(rec)

    @api.post("/audit/{record_id}/rollback", response_model=RollbackResult,
              responses={**E400, **E404, **E409, **E503})
    async def rollback(record_id: Annotated[int, PathParam(ge=1)], body: RollbackRequest,
                       who: Who) -> RollbackResult:
        """Undo one change.

        A suspension or condition added is removed (or the one it replaced
        restored), one removed comes back, a reload restores the policy before.
        """
        audit_id = await control.rollbacks.rollback(who, record_id, body.reason, body.force)
        return RollbackResult(rolled_back=record_id, audit_id=audit_id)

    return api
