"""Shaping over HTTP: the actions in force, lifting one, reloading the rules.

    GET  /api/v1/shaping                      rules loaded, actions in force
    POST /api/v1/shaping/reload               read the rules file again (422 if broken)
    POST /api/v1/shaping/actions/lift?key=K   end an automatic action now

A router of its own, included by sluice.api.app with the same bearer-token
dependency as the rest of /api/v1; it talks to the queue manager's Shaper
directly (its changes are scheduler events, posted like an operator's).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from fastapi import APIRouter, params

from sluice.api.control import ApiError
from sluice.shaping.rulefile import ShapingError
from sluice.shaping.runtime import Shaper, fired_data

__all__ = ["shaping_router", "status_data"]


def status_data(shaper: Shaper) -> dict[str, Any]:
    """What `sluice shaping status` shows: rules, file, firings, actions in force."""
    return {
        "rules": [r.name for r in shaper.engine.rules],
        "file": shaper.path, "defaults": shaper.defaults, "loads": shaper.loads,
        "firings": dict(sorted(shaper.engine.firings.items())),
        "backoff_groups": shaper.engine.backing_off(),
        "active": [{**fired_data(f), "id": shaper.id_of(f)} for f in shaper.active()],
    }


def shaping_router(shaper: Callable[[], Shaper], dependencies: Sequence[params.Depends],
                   responses: dict[int | str, dict[str, Any]],
                   not_found: dict[int | str, dict[str, Any]]) -> APIRouter:
    """``responses``: the errors every /api/v1 operation documents (401, 413, 422)."""
    router = APIRouter(prefix="/api/v1/shaping", tags=["shaping"],
                       dependencies=list(dependencies), responses=responses)

    @router.get("")
    async def status() -> dict[str, Any]:
        """Shaping rules loaded and the automatic actions in force."""
        return status_data(shaper())

    @router.post("/reload")
    async def reload() -> dict[str, Any]:
        """Read delivery.shaping again; a broken file is refused and the rules kept."""
        try:
            shaper().reload(who="api", raise_errors=True)
        except ShapingError as exc:
            raise ApiError(422, "invalid shaping rules",
                           [{"path": p, "message": m} for p, m in exc.problems]) from None
        return status_data(shaper())

    @router.post("/actions/lift", responses=not_found)
    async def lift(key: str) -> dict[str, Any]:
        """End the automatic action ``key`` now (the web page's lift button)."""
        if not shaper().lift(key, who="api"):
            raise ApiError(404, "not found", f"no automatic action {key!r}")
        return status_data(shaper())

    return router
