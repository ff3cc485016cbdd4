"""The policy's routes: the running policy, reloads, conditions added and removed.

SEE ALSO
    sluice.api.policy_ops (what they do), docs/api.md
"""

# No "from __future__ import annotations": FastAPI reads these annotations.
from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi import Path as PathParam

from sluice.api.control import Control
from sluice.api.errors import ApiError
from sluice.api.models import AuditRef, ConditionResult, PolicyModel, ReloadResult
from sluice.api.requests import ChangeRequest, ConditionRequest
from sluice.api.routes.common import COMMON, E400, E404, E409, E503, Auth, Reason

__all__ = ["router"]


def router(control: Control, auth: Auth) -> APIRouter:
    """The pickup policy's routes: show, reload, add and remove conditions."""
    ops = control.policy_ops
    api = APIRouter(prefix="/api/v1", dependencies=[Depends(auth)], responses=COMMON,
                    tags=["policy"])
    Who = Annotated[str, Depends(auth)]

    @api.get("/policy", response_model=PolicyModel)
    async def policy() -> PolicyModel:
        """The running pickup policy, with conditions added at run time."""
        return control.views.policy()

    @api.post("/policy/reload", response_model=ReloadResult,
              responses={**E400, **E409, **E503})
    async def reload(body: ChangeRequest, who: Who) -> ReloadResult:
        """Read scheduler.policy again.

        A broken file is refused (409) and the running policy kept.
        """
        return await ops.reload(who, body.reason)

    @api.post("/policy/conditions", response_model=ConditionResult, status_code=201,
              responses={**E400, **E404, **E409, **E503})
    async def add_condition(body: ConditionRequest, who: Who) -> ConditionResult:
        """Add a condition to a counter (first match wins: 'position' matters)."""
        thresholds = {k: v for k, v in (("concurrency", body.concurrency),
                                        ("rate", body.rate),
                                        ("connectinterval", body.connectinterval))
                      if v is not None}
        match = body.match.model_dump(exclude_none=True)
        if not match:
            raise ApiError(422, "invalid condition",
                           [{"path": "if", "message": "a condition needs at least one field "
                                                      "to match"}])
        return await ops.add_condition(
            who, body.counter, match, thresholds, position=body.position, ttl=body.ttl,
            expires_at=body.expires_at, cid=body.id, tag=body.tag, reason=body.reason)

    @api.delete("/policy/counters/{counter_id}/conditions/{condition_id}",
                response_model=AuditRef, responses={**E404, **E409, **E503})
    async def remove_condition(counter_id: Annotated[str, PathParam(max_length=256)],
                               condition_id: Annotated[str, PathParam(max_length=128)],
                               reason: Reason, who: Who) -> AuditRef:
        """Remove a condition (one with an id) from a counter."""
        return AuditRef(audit_id=await ops.remove_condition(who, counter_id, condition_id,
                                                            reason))

    return api
