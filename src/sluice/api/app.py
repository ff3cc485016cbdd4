"""The HTTP surface: routes, authentication, errors, the web page, /metrics.

SUMMARY
    build_app(control, tokens) -> FastAPI application

DESCRIPTION
    Everything under /api/v1 needs a bearer token except
    /api/v1/health; /metrics needs one too (Prometheus sends it with
    ``authorization: {credentials: ...}``).  The web page (/ and /static)
    is public: it holds no data and asks for a token before it shows any.

    The OpenAPI document is generated from the routes and their models
    (sluice.api.models) and served at /api/v1/openapi.json (with a token).
    Errors are always ``{"error": ..., "detail": ...}``:

    400  a request that makes no sense (an empty selector for a change)
    401  no token or a wrong one (with WWW-Authenticate)
    404  no such entry, message, suspension, condition or audit record
    405  a method the path does not have
    409  the state forbids it (an id taken, already rolled back)
    413  a body larger than MAX_BODY
    422  a request that breaks the rules (shape, values, policy syntax)
    503  the store or the queue manager cannot do it now

STRATEGIES
    Nothing a client sends reaches the queue unchecked: bodies forbid
    unknown keys and bound every value (sluice.api.models), meaning is
    checked in sluice.api.control, bodies are capped before they are read
    whole.  An unexpected exception is logged and answered with a bare
    500; it never takes the server down.

SEE ALSO
    sluice.api.control, sluice.api.server, docs/api.md
"""

# No "from __future__ import annotations" here: FastAPI reads the annotations
# of the route functions, which name dependencies local to build_app().
import logging
import re
from importlib import resources
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Query, Request, Security
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sluice.api.auth import Tokens
from sluice.api.control import ApiError, Control
from sluice.api.inject import inject_router
from sluice.api.models import (
    ANY_ID_PATTERN,
    MAX_SELECTOR_IDS,
    QID_PATTERN,
    ActionRequest,
    ActionResult,
    AuditPage,
    AuditRecordModel,
    AuditRef,
    ChangeRequest,
    ClusterReport,
    ConditionRequest,
    ConditionResult,
    CounterPage,
    Counts,
    DestinationPage,
    EntryAction,
    EntryModel,
    EntryPage,
    ErrorBody,
    Health,
    MessageModel,
    PolicyModel,
    ReloadResult,
    RollbackRequest,
    RollbackResult,
    SchedulerStats,
    ShapeModel,
    SubQueuePage,
    SuspensionList,
    SuspensionRequest,
    SuspensionResult,
    Throughput,
    WhyResponse,
)
from sluice.model import QueueState, Selector
from sluice.shaping.api import shaping_router
from sluice.store import Action

__all__ = ["MAX_BODY", "build_app"]

log = logging.getLogger("sluice.api")

#: The largest request body accepted.
MAX_BODY = 1 << 20

VERSION = "1"

STATIC = Path(str(resources.files("sluice.api").joinpath("static")))


def _error(status: int, text: str) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": ErrorBody, "description": text}}


E400 = _error(400, "The body is not JSON, or the request makes no sense (an empty "
                   "selector for a change)")
E404 = _error(404, "Not found")
E409 = _error(409, "The current state forbids it")
E503 = _error(503, "The store or the queue manager cannot do it now")
COMMON: dict[int | str, dict[str, Any]] = {
    **_error(401, "No valid bearer token"),
    **_error(413, "The request body is too large"),
    **_error(422, "The request breaks the rules; 'detail' lists each problem by key path"),
}


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
    bearer = HTTPBearer(auto_error=False, scheme_name="token",
                        description="A token from the api.tokens setting")

    async def principal(request: Request,
                        _: Annotated[HTTPAuthorizationCredentials | None,
                                     Security(bearer)]) -> str:
        who = tokens.who(request.headers.get("authorization"))
        if who is None:
            given = request.headers.get("authorization") is not None
            challenge = 'Bearer realm="sluice"' + (', error="invalid_token"' if given else "")
            raise ApiError(401, "unauthorized",
                           "a valid token is required: Authorization: Bearer <token>",
                           headers={"WWW-Authenticate": challenge})
        return who

    Who = Annotated[str, Depends(principal)]

    # -- errors ---------------------------------------------------------------------

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse({"error": exc.error, "detail": exc.detail},
                            status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = [{"path": _loc(e.get("loc", ())), "message": str(e.get("msg", ""))}
                    for e in exc.errors()]
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

    # -- public ---------------------------------------------------------------------------

    public = APIRouter(prefix="/api/v1", tags=["health"])

    @public.get("/health", response_model=Health)
    async def health() -> dict[str, Any]:
        """Whether the server runs (no token needed)."""
        return {"status": "ok", "node": control.config.node.id}

    # -- the queue --------------------------------------------------------------------------

    api = APIRouter(prefix="/api/v1", dependencies=[Depends(principal)], responses=COMMON)

    def selector_query(
        qid: Annotated[list[Annotated[str, Query(max_length=64, pattern=ANY_ID_PATTERN)]],
                       Query(max_length=MAX_SELECTOR_IDS,
                             description="queue id or SPID (repeatable)")
                       ] = [],  # noqa: B006 - FastAPI copies defaults per request
        state: Annotated[list[QueueState], Query(max_length=6)] = [],  # noqa: B006
        domain: Annotated[str | None, Query(max_length=320)] = None,
        sender: Annotated[str | None, Query(max_length=320,
                                            description="'' selects the null sender")] = None,
        recipient: Annotated[str | None, Query(max_length=320)] = None,
        tenantid: Annotated[str | None, Query(max_length=320)] = None,
        jobid: Annotated[str | None, Query(max_length=320)] = None,
        transportid: Annotated[str | None, Query(max_length=320)] = None,
    ) -> Selector:
        return Control.selector(qid, state, domain=domain, sender=sender,
                                recipient=recipient, tenantid=tenantid, jobid=jobid,
                                transportid=transportid)

    Sel = Annotated[Selector, Depends(selector_query)]
    QidPath = Annotated[str, PathParam(max_length=64, pattern=QID_PATTERN,
                                       description="a queue id: SPID-N")]
    AnyIdPath = Annotated[str, PathParam(max_length=64, pattern=ANY_ID_PATTERN,
                                         description="a queue id (SPID-N) or a SPID")]

    @api.get("/queue/entries", response_model=EntryPage, tags=["queue"], responses=E503)
    async def list_entries(
        selector: Sel,
        after: Annotated[str | None, Query(max_length=64, pattern=ANY_ID_PATTERN,
                                           description="the 'next' of the previous page")
                         ] = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ) -> dict[str, Any]:
        """Entries in queue-id (arrival) order, a page at a time."""
        return await control.entries(selector, after, limit)

    @api.get("/queue/counts", response_model=Counts, tags=["queue"], responses=E503)
    async def queue_counts(selector: Sel) -> dict[str, Any]:
        """Messages and recipients, by state."""
        return await control.counts(selector)

    @api.get("/queue/shape", response_model=ShapeModel, tags=["queue"], responses=E503)
    async def queue_shape(selector: Sel,
                          top: Annotated[int, Query(ge=0, le=100_000,
                                                    description="0: every domain")] = 0
                          ) -> dict[str, Any]:
        """Recipients per domain by age (Postfix's qshape)."""
        return await control.shape(selector, top)

    @api.post("/queue/actions", response_model=ActionResult, tags=["queue"],
              responses={**E400, **E503})
    async def queue_action(body: ActionRequest, who: Who) -> dict[str, Any]:
        """Hold, release, retry, bounce, delete or set the priority of selected entries
        (or count them: dry_run)."""
        sel = body.selector
        selector = Control.selector(sel.qids, sel.states, domain=sel.domain,
                                    sender=sel.sender, recipient=sel.recipient,
                                    tenantid=sel.tenantid, jobid=sel.jobid,
                                    transportid=sel.transportid)
        return await control.act(who, body.action, selector, all_=body.all,
                                 dry_run=body.dry_run, priority=body.priority,
                                 reason=body.reason)

    @api.get("/queue/entries/{qid}", response_model=EntryModel, tags=["queue"],
             responses={**E404, **E503})
    async def get_entry(qid: QidPath) -> dict[str, Any]:
        """One recipient entry."""
        return await control.entry(qid)

    @api.post("/queue/entries/{qid}/actions/{action}", response_model=ActionResult,
              tags=["queue"], responses={**E400, **E404, **E503})
    async def entry_action(qid: QidPath, action: Action, who: Who,
                           body: EntryAction | None = None) -> dict[str, Any]:
        """An action on one entry."""
        body = body or EntryAction()
        await control.entry(qid)
        return await control.act(who, action, Control.selector((qid,)), all_=False,
                                 dry_run=body.dry_run, priority=body.priority,
                                 reason=body.reason)

    @api.get("/queue/entries/{qid}/why", response_model=WhyResponse, tags=["queue"],
             responses={**E404, **E503})
    async def why(qid: AnyIdPath) -> dict[str, Any]:
        """Why an entry waits, and when it is expected to go."""
        return await control.why(qid)

    @api.get("/messages/{spid}", response_model=MessageModel, tags=["queue"],
             responses={**E404, **E503})
    async def message(spid: AnyIdPath) -> dict[str, Any]:
        """One message: its recipients still queued and its whole history."""
        return await control.message(spid)

    # -- the scheduler ---------------------------------------------------------------------

    Limit = Annotated[int, Query(ge=1, le=10_000)]

    @api.get("/scheduler/stats", response_model=SchedulerStats, tags=["scheduler"])
    async def scheduler_stats() -> dict[str, Any]:
        """The active queue, the queue manager and the delivery connections in numbers."""
        return control.stats()

    @api.get("/scheduler/subqueues", response_model=SubQueuePage, tags=["scheduler"])
    async def subqueues(limit: Limit = 50) -> dict[str, Any]:
        """The largest sub-queues and what holds them."""
        return control.subqueues(limit)

    @api.get("/scheduler/counters", response_model=CounterPage, tags=["scheduler"])
    async def counters(limit: Limit = 50, exceeded: bool = False) -> dict[str, Any]:
        """Counter entries against their thresholds, those over them first."""
        return control.counters(limit, exceeded)

    @api.get("/scheduler/destinations", response_model=DestinationPage, tags=["scheduler"])
    async def destinations(limit: Limit = 50) -> dict[str, Any]:
        """Slow-start windows and dead destinations."""
        return control.destinations(limit)

    @api.get("/throughput", response_model=Throughput, tags=["scheduler"])
    async def throughput() -> dict[str, Any]:
        """Recipients accepted, delivered, deferred and bounced: totals and rates."""
        return control.throughput()

    @api.get("/cluster", response_model=ClusterReport, tags=["scheduler"])
    async def cluster() -> dict[str, Any]:
        """The cluster as this node sees it (docs/cluster.md): every node's heartbeat
        age, limits (shared or fallen back) and claims in flight, the shared counters
        in use, and whether Redis and PostgreSQL answer."""
        from sluice.cluster.report import cluster_report

        return await cluster_report(control.config, control.manager.cluster)

    # -- policy and suspensions ------------------------------------------------------------

    @api.get("/policy", response_model=PolicyModel, tags=["policy"])
    async def policy() -> dict[str, Any]:
        """The running pickup policy, with conditions added at run time."""
        return control.policy()

    @api.post("/policy/reload", response_model=ReloadResult, tags=["policy"],
              responses={**E400, **E503})
    async def reload(body: ChangeRequest, who: Who) -> dict[str, Any]:
        """Read scheduler.policy again; a broken file is refused (422) and the running
        policy kept."""
        return await control.reload(who, body.reason)

    @api.post("/policy/conditions", response_model=ConditionResult, tags=["policy"],
              status_code=201, responses={**E400, **E404, **E503})
    async def add_condition(body: ConditionRequest, who: Who) -> dict[str, Any]:
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
        return await control.add_condition(
            who, body.counter, match, thresholds, position=body.position, ttl=body.ttl,
            expires_at=body.expires_at, cid=body.id, tag=body.tag, reason=body.reason)

    Reason = Annotated[str, Query(min_length=1, max_length=500,
                                  description="why: kept in the audit history")]

    @api.delete("/policy/counters/{counter_id}/conditions/{condition_id}",
                response_model=AuditRef, tags=["policy"],
                responses={**E404, **E503})
    async def remove_condition(counter_id: Annotated[str, PathParam(max_length=256)],
                               condition_id: Annotated[str, PathParam(max_length=128)],
                               reason: Reason, who: Who) -> dict[str, Any]:
        """Remove a condition (one with an id) from a counter."""
        return {"audit_id": await control.remove_condition(who, counter_id, condition_id,
                                                           reason)}

    @api.get("/suspensions", response_model=SuspensionList, tags=["policy"])
    async def suspensions(limit: Limit = 100) -> dict[str, Any]:
        """Suspensions by hand, and counters over their thresholds (automatic)."""
        return control.suspensions(limit)

    @api.post("/suspensions", response_model=SuspensionResult, tags=["policy"],
              status_code=201, responses={**E400, **E409, **E503})
    async def add_suspension(body: SuspensionRequest, who: Who) -> dict[str, Any]:
        """Suspend pickup of mail that matches every given field (Halon: a suspension
        with the same fields only gets the new expiry, tag and reason)."""
        view, audit_id = await control.add_suspension(
            who, body.fields.model_dump(exclude_none=True), ttl=body.ttl,
            expires_at=body.expires_at, sid=body.id, tag=body.tag, reason=body.reason)
        return {"suspension": view, "audit_id": audit_id}

    @api.delete("/suspensions/{suspension_id}", response_model=AuditRef,
                tags=["policy"], responses={**E404, **E409, **E503})
    async def remove_suspension(suspension_id: Annotated[str, PathParam(max_length=512)],
                                reason: Reason, who: Who) -> dict[str, Any]:
        """Lift a suspension made by hand."""
        return {"audit_id": await control.remove_suspension(who, suspension_id, reason)}

    # -- audit ---------------------------------------------------------------------------------

    @api.get("/audit", response_model=AuditPage, tags=["audit"])
    async def audit_list(limit: Annotated[int, Query(ge=1, le=1000)] = 50,
                         before: Annotated[int | None, Query(ge=1)] = None
                         ) -> dict[str, Any]:
        """Changes made through the API, newest first."""
        records, nxt = control.audit.page(limit, before)
        return {"records": [{**r.to_data(), "rolled_back_by": control.audit.rolled_back_by(r.id)}
                            for r in records], "next": nxt}

    @api.get("/audit/{record_id}", response_model=AuditRecordModel, tags=["audit"],
             responses=E404)
    async def audit_get(record_id: Annotated[int, PathParam(ge=1)]) -> dict[str, Any]:
        """One change."""
        rec = control.audit.get(record_id)
        if rec is None:
            raise ApiError(404, "not found", f"no audit record {record_id}")
        return {**rec.to_data(), "rolled_back_by": control.audit.rolled_back_by(rec.id)}

    @api.post("/audit/{record_id}/rollback", response_model=RollbackResult, tags=["audit"],
              responses={**E400, **E404, **E409, **E503})
    async def rollback(record_id: Annotated[int, PathParam(ge=1)], body: RollbackRequest,
                       who: Who) -> dict[str, Any]:
        """Undo one change: a suspension or condition added is removed (or the one it
        replaced restored), one removed comes back, a reload restores the policy before."""
        audit_id = await control.rollback(who, record_id, body.reason, body.force)
        return {"rolled_back": record_id, "audit_id": audit_id}

    # -- documents -----------------------------------------------------------------------------

    @api.get("/openapi.json", include_in_schema=False)
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    metrics = APIRouter(dependencies=[Depends(principal)], responses=COMMON)

    @metrics.get("/metrics", tags=["metrics"], response_class=Response,
                 responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {
                     "type": "string"}}}, "description": "Prometheus text format"}})
    async def prometheus() -> Response:
        """Metrics in the Prometheus text format (docs/api.md lists them)."""
        await control.snapshot()
        return Response(control.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(Guard)
    app.include_router(public)
    app.include_router(api)
    app.include_router(inject_router(control, principal, COMMON))
    app.include_router(metrics)
    # shaping: its own router (sluice.shaping.api), same token as /api/v1.
    app.include_router(shaping_router(lambda: control.manager.shaper, [Depends(principal)],
                                      COMMON, E404))

    # -- the web page ----------------------------------------------------------------------------

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app
