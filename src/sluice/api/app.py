"""The HTTP surface: the application, its error handling, the body guard.

SUMMARY
    build_app(control, tokens) -> FastAPI application

DESCRIPTION
    Everything under /api/v1 needs a bearer token except
    /api/v1/health; /metrics needs one too (Prometheus sends it with
    ``authorization: {credentials: ...}``).  The web page (/ and /static)
    is public: it holds no data and asks for a token before it shows any.
    The routes are in sluice.api.routes, one module per resource.

    The OpenAPI document is generated from the routes and their models
    (sluice.api.models) and served at /api/v1/openapi.json (with a token).
    Errors are always ``{"error": ..., "detail": ...}`` with the statuses
    sluice.api.errors lists; a body that is not JSON is a 400.

STRATEGIES
    Nothing a client sends reaches the queue unchecked: bodies forbid
    unknown keys and bound every value (sluice.api.models), meaning is
    checked by the operations (sluice.api.control), bodies are capped
    before they are read whole.  The document promises no request the
    server refuses: what a schema can say (a non-empty selector, a ttl
    from 1 s to 366 days, whole numbers) it says, and what only the state
    decides is a 409.  An unexpected exception is logged and answered
    with a bare 500; it never takes the server down.

SEE ALSO
    sluice.api.routes, sluice.api.control, sluice.api.server, docs/api.md
"""

# No "from __future__ import annotations": FastAPI reads route annotations.
import logging
import re
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sluice.api.auth import Tokens
from sluice.api.control import Control
from sluice.api.errors import ApiError
from sluice.api.inject import inject_router
from sluice.api.routes import (
    audit,
    charts,
    destinations,
    messages,
    metrics,
    page,
    policy,
    queue,
    scheduler,
    suspensions,
)
from sluice.api.routes.common import COMMON, E404, Auth
from sluice.shaping.api import shaping_router

__all__ = ["MAX_BODY", "build_app"]

log = logging.getLogger("sluice.api")

#: The largest request body accepted.
MAX_BODY = 1 << 20

VERSION = "1"

#: Pydantic's error types for a body that does not parse as JSON.
_NOT_JSON = {"json_invalid", "json_type"}


def _not_json(error: Any) -> bool:
    """Whether a validation error says the body is not JSON.

    That is, it did not parse, it was not sent as JSON (FastAPI hands over
    the raw bytes), or it is empty.
    """
    if tuple(error.get("loc", ()))[:1] != ("body",):
        return False
    if error.get("type") in _NOT_JSON:
        return True
    if tuple(error.get("loc", ())) != ("body",):
        return False
    return isinstance(error.get("input"), bytes | bytearray) or (
        error.get("type") == "missing" and error.get("input") is None)


def _loc(parts: tuple[Any, ...] | list[Any]) -> str:
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _methods(app: FastAPI, path: str) -> list[str]:
    """The methods the OpenAPI document gives ``path`` (for Allow)."""
    methods: set[str] = set()
    for template, ops in app.openapi()["paths"].items():
        parts = re.split(r"(\{[^}]+\})", template)
        pattern = "".join("[^/]+" if p.startswith("{") else re.escape(p) for p in parts)
        if re.fullmatch(pattern, path):
            methods |= {m.upper() for m in ops}
    return sorted(methods)


class Guard:
    """ASGI middleware: caps request bodies and adds protective headers."""

    def __init__(self, app: ASGIApp, max_body: int = MAX_BODY) -> None:
        self.app = app
        self.max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope.get("path", "")
        started = False

        async def send_guarded(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = list(message.get("headers", []))
                headers += [(b"x-content-type-options", b"nosniff"),
                            (b"x-frame-options", b"DENY"),
                            (b"referrer-policy", b"no-referrer")]
                if path.startswith("/api/") or path == "/metrics":
                    headers.append((b"cache-control", b"no-store"))
                else:
                    headers.append((b"content-security-policy",
                                    b"default-src 'self'; img-src 'self' data:; "
                                    b"frame-ancestors 'none'; base-uri 'none'; form-action 'self'"))
                message = {**message, "headers": headers}
            await send(message)

        async def too_large() -> None:
            body = b'{"error":"too large","detail":"the request body exceeds ' + \
                str(self.max_body).encode() + b' bytes"}'
            await send_guarded({"type": "http.response.start", "status": 413,
                                "headers": [(b"content-type", b"application/json"),
                                            (b"content-length", str(len(body)).encode())]})
            await send_guarded({"type": "http.response.body", "body": body})

        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > self.max_body:
                    await too_large()
                    return
        received = 0

        async def receive_limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body:
                    raise _TooLarge
            return message

        try:
            await self.app(scope, receive_limited, send_guarded)
        except _TooLarge:
            if not started:
                await too_large()


class _TooLarge(Exception):
    pass


def _errors(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse({"error": exc.error, "detail": exc.detail},
                            status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if any(_not_json(e) for e in errors):
            return JSONResponse({"error": "invalid JSON", "detail": "the body is not a JSON "
                                 "document sent as application/json"}, status_code=400)
        problems = [{"path": _loc(e.get("loc", ())), "message": str(e.get("msg", ""))}
                    for e in errors]
        return JSONResponse({"error": "invalid request", "detail": problems},
                            status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = dict(getattr(exc, "headers", None) or {})
        detail = None
        if exc.status_code == 405:
            # Starlette names the methods of the first route with this path only.
            headers["Allow"] = ", ".join(_methods(app, request.url.path))
            text = "method not allowed"
        elif exc.status_code == 404:
            text = "not found"
        elif exc.status_code == 400 and isinstance(exc.__cause__, _TooLarge):
            # FastAPI turns any failure while reading the body into a 400.
            return JSONResponse({"error": "too large", "detail": "the request body exceeds "
                                 f"{MAX_BODY} bytes"}, status_code=413)
        elif exc.status_code == 400:
            text, detail = "invalid JSON", "the body is not a JSON document"
        else:
            text = str(exc.detail)
        return JSONResponse({"error": text, "detail": detail}, status_code=exc.status_code,
                            headers=headers)

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception) -> JSONResponse:
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return JSONResponse({"error": "internal error", "detail": None}, status_code=500)


def build_app(control: Control, tokens: Tokens) -> FastAPI:
    """The application for one running server."""
    app = FastAPI(
        title="Sluice",
        version=VERSION,
        summary="The queue, the pickup policy and its audit history of a Sluice node",
        description=(
            "Every operation needs `Authorization: Bearer <token>` (a token from "
            "`api.tokens`) except `GET /api/v1/health`. Errors are JSON: "
            "`{\"error\": ..., \"detail\": ...}`. Times are POSIX seconds (`*_at`), "
            "durations seconds (`*_s`). See docs/api.md."),
        openapi_url=None, docs_url=None, redoc_url=None,
        generate_unique_id_function=lambda route: route.name,
    )
    auth = Auth(tokens)
    _errors(app)
    app.add_middleware(Guard)
    app.include_router(metrics.health_router(control))
    for module in (queue, messages, scheduler, destinations, charts, policy, suspensions,
                   audit):
        app.include_router(module.router(control, auth))

    @app.get("/api/v1/openapi.json", include_in_schema=False, dependencies=[Depends(auth)])
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    app.include_router(inject_router(control, auth, COMMON))
    # shaping: its own router (sluice.shaping.api), same token as /api/v1.
    app.include_router(shaping_router(lambda: control.manager.shaper, [Depends(auth)],
                                      COMMON, E404))
    app.include_router(metrics.router(control, auth))
    page.add_page(app)
    return app
