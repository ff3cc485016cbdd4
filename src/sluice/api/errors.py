"""The API's expected refusals: one exception, and the problems it lists.

SUMMARY
    raise ApiError(status, error, detail)
    problems(policy_error, strip=..., prefix=...) -> [{"path", "message"}]

DESCRIPTION
    Operations raise ApiError for every refusal they expect; the HTTP
    layer (sluice.api.app) answers it as ``{"error": ..., "detail": ...}``
    with its status.  The statuses keep one rule, so that the OpenAPI
    document can promise what the server accepts:

    400  the body is not JSON, or a change names no entries
    404  no such entry, message, counter, condition, suspension or record
    409  the state forbids it: the running policy (a condition that does
         not fit its counter, a broken policy file to reload), the clock
         (an expiry outside the coming 366 days), what happened since (a
         change already rolled back or ended)
    422  the request breaks a rule the OpenAPI document states
    503  the store or the queue manager cannot do it now

SEE ALSO
    sluice.api.app, docs/api.md
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sluice.scheduler import PolicyError

__all__ = ["ApiError", "problems"]


class ApiError(Exception):
    """An expected refusal: an HTTP status, a short error and the details."""

    def __init__(self, status: int, error: str, detail: Any = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(f"{status} {error}: {detail}")
        self.status = status
        self.error = error
        self.detail = detail
        self.headers = dict(headers or {})


def problems(exc: PolicyError, strip: str = "", prefix: str = "") -> list[dict[str, str]]:
    """A PolicyError's problems with their key paths, as the API lists them."""
    out = []
    for path, message in exc.problems:
        if strip and path.startswith(strip):
            path = prefix + path[len(strip):]
        out.append({"path": path or prefix or "body", "message": message})
    return out
