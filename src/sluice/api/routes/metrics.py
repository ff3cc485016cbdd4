"""Health (no token) and the Prometheus metrics.

SEE ALSO
    sluice.api.metrics, sluice.api.views.Views.snapshot, docs/api.md
"""

# No "from __future__ import annotations": FastAPI reads these annotations.
from fastapi import APIRouter, Depends
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from sluice.api.control import Control
from sluice.api.models import Health
from sluice.api.routes.common import COMMON, Auth

__all__ = ["health_router", "router"]


def health_router(control: Control) -> APIRouter:
    """GET /api/v1/health, which needs no token."""
    public = APIRouter(prefix="/api/v1", tags=["health"])

    @public.get("/health", response_model=Health)
    async def health() -> Health:
        """Whether the server runs (no token needed)."""
        return Health(status="ok", node=control.config.node.id)

    return public


def router(control: Control, auth: Auth) -> APIRouter:
    """GET /metrics: the Prometheus text format, with a token."""
    metrics = APIRouter(dependencies=[Depends(auth)], responses=COMMON)

    @metrics.get("/metrics", tags=["metrics"], response_class=Response,
                 responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {
                     "type": "string"}}}, "description": "Prometheus text format"}})
    async def prometheus() -> Response:
        """Metrics in the Prometheus text format (docs/api.md lists them)."""
        await control.views.snapshot()
        return Response(control.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return metrics
