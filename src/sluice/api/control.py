"""What the API does to the queue and the scheduler, with its audit history.

SUMMARY
    control = Control(config, queue, manager, audit, metrics)
    reads:    await control.entries(...), counts, shape, message, why,
              stats(), subqueues(), counters(), destinations(), suspensions()
    changes:  await control.act(...), add_suspension, remove_suspension,
              add_condition, remove_condition, reload, rollback

DESCRIPTION
    The HTTP layer (sluice.api.app) validates shapes; this module checks
    meaning, does the work and records it.  Store calls block, so they run
    in a small thread pool of their own, never on the event loop that
    the queue manager shares.  Scheduler views and events are used on
    the loop only: the scheduler is not thread-safe.

    Queue actions go to sluice.queue.Queue.act (which writes the
    accounting log and the store's change feed); the queue manager is
    then told at once (QueueManager.apply_changes) instead of finding out
    at its next change-feed poll.  A bounce queues its NDRs at once.

    Policy changes are events posted to the queue manager (PolicyReloaded,
    ConditionAdded, ConditionRemoved, SuspensionAdded, SuspensionRemoved).
    Each is checked here first against the scheduler's own rules, so an
    event can never fail inside the manager's loop, then this module
    waits until the scheduler shows the change before it answers: the
    caller sees the state it asked for, and the audit record's ``after``
    is what the scheduler really holds.

STRATEGIES
    One change at a time.  Policy changes and rollbacks take one lock, so
    ``before`` and ``after`` of a record are never interleaved with
    another change made through the API.

    Undo by inverse.  A rollback applies the inverse change: an added
    suspension or condition is removed (or the one it replaced is put
    back), a removed one is added again where it was, a reload restores
    the policy that ran before.  It refuses (409) when the state moved on
    so that the inverse would be wrong -- the suspension already ended,
    the counter is gone, the policy was changed since (unless forced).

    Suspensions survive restarts.  With scheduler.suspensions set, every
    change rewrites that file (write, fsync, rename) with the manual
    suspensions in force, which the queue manager loads at start.

INVARIANTS
    Nothing a request carries reaches the scheduler unchecked; a selector
    that is empty changes nothing unless the caller says ``all``.

LIMITATIONS
    Conditions added at run time live in memory: a restart, or a reload
    of the policy file (by the API, SIGHUP or the file watcher), ends
    them -- the reload's audit record keeps them, and rolling it back
    brings them back.  Conditions of the policy file have no id unless
    the file gives one, and only conditions with an id can be removed
    here.

SEE ALSO
    sluice.api.audit, sluice.runtime.manager, sluice.scheduler, docs/api.md
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import ValidationError

from sluice.api.audit import AuditAction, AuditLog, AuditRecord
from sluice.api.history import message_history, spid_arrival_at
from sluice.api.metrics import Metrics, Snapshot
from sluice.api.models import HistoryEvent
from sluice.config import Config, parse_duration
from sluice.model import QueueEntry, QueueState, Selector, parse_qid
from sluice.policyfile import load_policy_file
from sluice.queue import QSHAPE_EDGES_MIN, Queue
from sluice.render import counts_json, entry_json, shape_table
from sluice.retry import RetryPolicy
from sluice.runtime.manager import QueueManager
from sluice.scheduler import (
    Condition,
    ConditionAdded,
    ConditionRemoved,
    Counter,
    Explanation,
    Policy,
    PolicyError,
    PolicyReloaded,
    Route,
    Scheduler,
    Suspension,
    SuspensionAdded,
    SuspensionRemoved,
    SuspensionView,
    explain_stored,
    parse_policy,
    parse_suspension,
)
from sluice.store import Action, StorageError, narrow

__all__ = ["ApiError", "Control"]

log = logging.getLogger("sluice.api")

T = TypeVar("T")

#: How long a change may take to show in the scheduler before we give up.
SETTLE_S = 5.0

#: The longest expiry a suspension or condition may be given.
MAX_TTL_S = 366 * 86400.0

#: Touched queue ids returned by an action (and kept in its audit record).
MAX_QIDS = 1000

#: Recipients of one message read for its view.
MAX_RECIPIENTS = 10_000

_AUDIT_OF_ACTION = {
    Action.HOLD: AuditAction.QUEUE_HOLD,
    Action.RELEASE: AuditAction.QUEUE_RELEASE,
    Action.RETRY: AuditAction.QUEUE_RETRY,
    Action.DELETE: AuditAction.QUEUE_DELETE,
    Action.PRIORITY: AuditAction.QUEUE_PRIORITY,
    Action.BOUNCE: AuditAction.QUEUE_BOUNCE,
}


class ApiError(Exception):
    """An expected refusal: an HTTP status, a short error and the details."""

    def __init__(self, status: int, error: str, detail: Any = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(f"{status} {error}: {detail}")
        self.status = status
        self.error = error
        self.detail = detail
        self.headers = dict(headers or {})


def _problems(exc: PolicyError, strip: str = "", prefix: str = "") -> list[dict[str, str]]:
    out = []
    for path, message in exc.problems:
        if strip and path.startswith(strip):
            path = prefix + path[len(strip):]
        out.append({"path": path or prefix or "body", "message": message})
    return out


def _canonical(data: Any) -> str:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)


def suspension_data(view: SuspensionView) -> dict[str, Any]:
    return {"id": view.id, "fields": dict(view.fields), "automatic": view.automatic,
            "expires_at": view.expires_at, "tag": view.tag, "reason": view.reason,
            "waiting_subqueues": view.waiting_subqueues}


def _suspension_of(data: Mapping[str, Any]) -> Suspension:
    return Suspension(tuple(sorted(dict(data["fields"]).items())), str(data["id"]),
                      data.get("expires_at"), str(data.get("tag", "")),
                      str(data.get("reason", "")))


def route_data(route: Route) -> dict[str, Any]:
    return {"recipientdomain": route.recipientdomain, "tenantid": route.tenantid,
            "jobid": route.jobid, "transportid": route.transportid,
            "localip": list(route.localip), "grouping": route.grouping,
            "remoteip": route.remoteip, "remotemx": route.remotemx,
            "destination": route.destination or route.recipientdomain,
            "transport": str(route.transport)}


def explanation_data(expl: Explanation, source: str, now: float) -> dict[str, Any]:
    return expl.data(source, now)


def write_atomically(path: str, text: str) -> None:
    """Replace ``path`` with ``text``: a crash leaves the old or the new file whole."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dfd = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


class Control:
    """The API's view of, and hands on, one running queue manager."""

    def __init__(self, config: Config, queue: Queue, manager: QueueManager, audit: AuditLog,
                 metrics: Metrics, *, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.queue = queue
        self.manager = manager
        self.audit = audit
        self.metrics = metrics
        self.clock = clock
        self.retry = RetryPolicy.from_config(config.queue)
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="sluice-api")
        self._lock = asyncio.Lock()
        #: Policies replaced by reloads of this run, by audit id (exact objects
        #: for rollbacks; after a restart the record's data is parsed instead).
        self._replaced: dict[int, Policy] = {}
        self._counts: tuple[float, Any] | None = None

    def close(self) -> None:
        self.pool.shutdown(wait=True)

    @property
    def scheduler(self) -> Scheduler:
        return self.manager.scheduler

    async def io(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        """Run a blocking call in the API's threads; storage trouble is a 503."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self.pool, functools.partial(fn, *args, **kw))
        except StorageError as exc:
            raise ApiError(503, "storage unavailable", str(exc)) from None

    def now(self) -> float:
        return max(self.clock(), self.scheduler.now)

    # -- selectors ---------------------------------------------------------------------

    @staticmethod
    def selector(qids: Iterable[str] = (), states: Iterable[QueueState] = (),
                 **fields: str | None) -> Selector:
        try:
            return Selector(qids=tuple(q.strip().upper() for q in qids),
                            states=tuple(states), **fields)
        except ValueError as exc:
            raise ApiError(422, "invalid selector", [{"path": "qids", "message": str(exc)}]
                           ) from None

    @staticmethod
    def qid(text: str, *, bare_ok: bool) -> tuple[str, int | None]:
        try:
            spid, idx = parse_qid(text)
        except ValueError as exc:
            raise ApiError(422, "invalid queue id", str(exc)) from None
        if idx is None and not bare_ok:
            raise ApiError(422, "invalid queue id", f"{text!r} is a SPID; give SPID-N")
        return spid, idx

    # -- queue reads -------------------------------------------------------------------

    async def entries(self, selector: Selector, after: str | None, limit: int
                      ) -> dict[str, Any]:
        if after is not None:
            self.qid(after, bare_ok=True)
            after = after.strip().upper()

        def work() -> list[QueueEntry]:
            return list(itertools.islice(
                self.queue.store.entries(selector, after=after, limit=limit + 1), limit + 1))

        items = await self.io(work)
        more = len(items) > limit
        items = items[:limit]
        return {"entries": [entry_json(e) for e in items],
                "next": items[-1].qid if more and items else None}

    async def counts(self, selector: Selector) -> dict[str, Any]:
        counts = await self.io(self.queue.store.count, None if selector.is_empty else selector)
        return counts_json(counts)

    async def shape(self, selector: Selector, top: int) -> dict[str, Any]:
        edges_s = [m * 60.0 for m in QSHAPE_EDGES_MIN]
        shape = await self.io(self.queue.store.shape, selector, self.clock(), edges_s)
        rows = shape_table(shape, top)

        def row(cells: list[str]) -> dict[str, Any]:
            return {"domain": cells[0], "total": int(cells[1]),
                    "buckets": [int(c) for c in cells[2:]]}

        return {"buckets_min": list(QSHAPE_EDGES_MIN), "header": rows[0][1:],
                "total": row(rows[1]), "rows": [row(r) for r in rows[2:]],
                "domains": len(shape)}

    async def entry(self, qid: str) -> dict[str, Any]:
        self.qid(qid, bare_ok=False)
        entry = await self.io(self.queue.store.get, qid.strip().upper())
        if entry is None:
            raise ApiError(404, "not found", f"no entry {qid} in the queue "
                                             "(delivered, deleted or never queued)")
        return entry_json(entry)

    async def message(self, text: str) -> dict[str, Any]:
        spid, _ = self.qid(text, bare_ok=True)
        entries = await self.io(lambda: list(self.queue.store.entries(
            Selector(qids=(spid,)), limit=MAX_RECIPIENTS)))
        arrival = spid_arrival_at(spid)
        if arrival is None and entries:
            arrival = min(e.arrival_at for e in entries)
        # An hour of slack: another process's clock may be a little behind.
        since = None if arrival is None else arrival - 3600.0
        history = await self.io(message_history, self.config.accounting.path, spid, since,
                                self.config.api.history_max_bytes)
        # A line edited by hand may not have the documented types: leave it out
        # rather than answer with something the OpenAPI document does not promise.
        events = []
        for event in history.events:
            try:
                events.append(HistoryEvent.model_validate(event).model_dump())
            except ValidationError:
                log.warning("accounting line of %s with unexpected values skipped", spid)
        if not entries and not events:
            raise ApiError(404, "not found", f"no message {spid} in the queue or in the "
                                             "accounting log")
        return {"spid": spid, "arrival_at": arrival,
                "recipients": [entry_json(e) for e in entries], "history": events,
                "history_files": history.files, "history_bytes": history.bytes_scanned,
                "history_truncated": history.truncated}

    async def why(self, text: str) -> dict[str, Any]:
        spid, idx = self.qid(text, bare_ok=True)
        if idx is None:
            entries = await self.io(lambda: list(self.queue.store.entries(
                Selector(qids=(spid,)), limit=MAX_RECIPIENTS)))
        else:
            entry = await self.io(self.queue.store.get, f"{spid}-{idx}")
            entries = [entry] if entry is not None else []
        if not entries:
            raise ApiError(404, "not found", f"no entry {text} in the queue "
                                             "(delivered, deleted or never queued)")
        now = self.now()
        out = []
        for entry in entries:
            memory = self.scheduler.explain(entry.qid, now)
            # A held entry is held, whatever the memory still says of it (issue 17).
            if memory.state != "unknown" and entry.state is not QueueState.HOLD:
                out.append(explanation_data(memory, "memory", now))
            else:
                out.append(explanation_data(explain_stored(entry, now, self.retry), "store",
                                            now))
        return {"explanations": out}

    # -- queue actions ------------------------------------------------------------------

    async def act(self, who: str, action: Action, selector: Selector, *, all_: bool,
                  dry_run: bool, priority: int | None, reason: str) -> dict[str, Any]:
        if selector.is_empty and not all_:
            raise ApiError(400, "empty selector", "give queue ids or a selector (domain, "
                           "sender, tenantid, ...), or all=true for the whole queue")
        if action is Action.PRIORITY and priority is None:
            raise ApiError(422, "invalid request",
                           [{"path": "priority", "message": "action 'priority' needs "
                                                           "'priority': 0 or 1"}])
        if action is not Action.PRIORITY and priority is not None:
            raise ApiError(422, "invalid request",
                           [{"path": "priority", "message": "'priority' goes only with "
                                                           "action 'priority'"}])
        if dry_run:
            return await self._dry_run(action, selector)
        touched = await self.io(self.queue.act, selector, action, priority=priority)
        qids = [e.qid for e in touched]
        if qids:
            self.manager.apply_changes(set(qids))
        if action is Action.BOUNCE and touched:
            queued = await self.io(self.queue.run_bounces)
            if queued:
                self.manager.notify_mail(queued)
        audit_id = None
        if touched:
            record = await self._record(
                who, _AUDIT_OF_ACTION[action], self._describe(selector), reason,
                None, {"count": len(qids), "qids": qids[:MAX_QIDS],
                       "selector": self._selector_data(selector, all_),
                       **({"priority": priority} if priority is not None else {})},
                reversible=False)
            audit_id = record.id
        return {"action": action, "dry_run": False, "count": len(qids),
                "qids": qids[:MAX_QIDS], "qids_truncated": len(qids) > MAX_QIDS,
                "audit_id": audit_id}

    async def _dry_run(self, action: Action, selector: Selector) -> dict[str, Any]:
        narrowed = narrow(selector, action)
        if narrowed is None:
            # None of the selected states is one this action applies to.
            return {"action": action, "dry_run": True, "count": 0, "qids": [],
                    "qids_truncated": False, "audit_id": None}

        def work() -> tuple[int, list[str]]:
            counts = self.queue.store.count(narrowed)
            qids = [e.qid for e in self.queue.store.entries(narrowed, limit=MAX_QIDS)]
            return counts.recipients, qids

        count, qids = await self.io(work)
        return {"action": action, "dry_run": True, "count": count, "qids": qids,
                "qids_truncated": count > len(qids), "audit_id": None}

    @staticmethod
    def _selector_data(selector: Selector, all_: bool) -> dict[str, Any]:
        data: dict[str, Any] = {k: v for k, v in (
            ("domain", selector.domain), ("sender", selector.sender),
            ("recipient", selector.recipient), ("tenantid", selector.tenantid),
            ("jobid", selector.jobid), ("transportid", selector.transportid)) if v is not None}
        if selector.qids:
            data["qids"] = list(selector.qids[:MAX_QIDS])
        if selector.states:
            data["states"] = [str(s) for s in selector.states]
        if all_:
            data["all"] = True
        return data

    @classmethod
    def _describe(cls, selector: Selector) -> str:
        data = cls._selector_data(selector, False)
        if not data:
            return "the whole queue"
        parts = []
        for key, value in data.items():
            if isinstance(value, list):
                shown = ",".join(value[:5]) + (",..." if len(value) > 5 else "")
                parts.append(f"{key}={shown}")
            else:
                parts.append(f"{key}={value}")
        return " ".join(parts)

    # -- scheduler views --------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        now = self.clock()
        return {"node": self.config.node.id, "now": now,
                "uptime_s": max(0.0, now - self.manager.stats.started_at),
                "active_queue": asdict(self.scheduler.stats()),
                "manager": asdict(self.manager.stats),
                "connections": asdict(self.manager.agent.stats)}

    def subqueues(self, limit: int) -> dict[str, Any]:
        views = self.scheduler.subqueues()
        top = sorted(views, key=lambda v: (-v.entries, -v.jobs))[:limit]
        return {"total": len(views),
                "items": [{"route": route_data(v.route), "priority": v.priority,
                           "jobs": v.jobs, "entries": v.entries, "parked": v.parked,
                           "held_by": list(v.held_by)} for v in top]}

    def counters(self, limit: int, exceeded: bool) -> dict[str, Any]:
        views = self.scheduler.counters(self.now())
        if exceeded:
            views = [v for v in views if v.exceeded]

        def load(v: Any) -> float:
            return v.inflight / v.concurrency if v.concurrency else 0.0

        top = sorted(views, key=lambda v: (not v.exceeded, -load(v), -v.inflight,
                                           -v.rate_used))[:limit]
        return {"total": len(views),
                "items": [{**asdict(v), "key": dict(v.key)} for v in top]}

    def destinations(self, limit: int) -> dict[str, Any]:
        views = self.scheduler.destinations(self.now())
        top = sorted(views, key=lambda v: (not v.dead, -v.queued_jobs, -v.inflight))[:limit]
        return {"total": len(views), "items": [asdict(v) for v in top]}

    def suspensions(self, limit: int = 100) -> dict[str, Any]:
        views = self.scheduler.suspensions(self.now())
        manual = [suspension_data(v) for v in views if not v.automatic]
        automatic = [v for v in views if v.automatic]
        automatic.sort(key=lambda v: -v.waiting_subqueues)
        return {"manual": manual,
                "automatic": [suspension_data(v) for v in automatic[:limit]],
                "automatic_total": len(automatic)}

    def throughput(self) -> dict[str, Any]:
        m = self.metrics
        samples = list(m.samples)
        names = ("accepted", "delivered", "deferred", "bounced")

        def point(s: tuple[float, int, int, int, int]) -> dict[str, Any]:
            return {"at": s[0], **dict(zip(names, s[1:], strict=True))}

        last = samples[-1] if samples else (self.clock(), *(m.totals[n] for n in names))
        tail = samples[(len(samples) - 1) % 5::5] if samples else []
        return {"at": last[0], "totals": point(last),  # type: ignore[arg-type]
                "per_s_10s": dict(zip(names, m.rates(10.0), strict=True)),
                "per_s_60s": dict(zip(names, m.rates(60.0), strict=True)),
                "points": [point(s) for s in tail]}

    async def snapshot(self) -> Snapshot:
        """What /metrics shows of the running parts; store counts cached for a second."""
        now = self.clock()
        if self._counts is None or now - self._counts[0] > 1.0:
            try:
                counts = await self.io(self.queue.store.count)
            except ApiError:
                counts = None
            self._counts = (now, counts)
        views = self.scheduler.suspensions(self.now())
        manual = sum(1 for v in views if not v.automatic)
        dead = sum(1 for d in self.scheduler.destinations(self.now()) if d.dead)
        tenants = self.scheduler.tenants()
        self.metrics.observe_tenants(tenants)
        snap = Snapshot(at=now, counts=self._counts[1], scheduler=self.scheduler.stats(),
                        manual_suspensions=manual, automatic_suspensions=len(views) - manual,
                        dead_destinations=dead, manager=self.manager.stats,
                        agent=self.manager.agent.stats,
                        cluster=None if self.manager.cluster is None
                        else self.manager.cluster.status(),
                        tenants=tenants)
        self.metrics.snapshot = snap
        return snap

    # -- policy -----------------------------------------------------------------------------

    def policy(self) -> dict[str, Any]:
        policy: Policy = self.scheduler.policy
        return {"source": policy.source, "path": self.manager.policy_path,
                "suspensions_file": self.config.scheduler.suspensions,
                "policy": policy.to_data()}

    def _expiry(self, ttl: str | None, expires_at: float | None) -> float | None:
        if ttl is not None and expires_at is not None:
            raise ApiError(422, "invalid request", "give 'ttl' or 'expires_at', not both")
        now = self.clock()
        if ttl is not None:
            try:
                seconds = parse_duration(ttl)
            except ValueError as exc:
                raise ApiError(422, "invalid request",
                               [{"path": "ttl", "message": str(exc)}]) from None
            if not 0 < seconds <= MAX_TTL_S:
                raise ApiError(422, "invalid request",
                               [{"path": "ttl", "message": "between 1s and 366d"}])
            return now + seconds
        if expires_at is not None:
            if not (math.isfinite(expires_at) and now < expires_at <= now + MAX_TTL_S):
                raise ApiError(422, "invalid request",
                               [{"path": "expires_at",
                                 "message": "a time in the coming 366 days"}])
            return float(expires_at)
        return None

    async def _settle(self, done: Callable[[], bool], what: str) -> None:
        """Wait until the queue manager's loop has applied our event."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SETTLE_S
        while not done():
            if loop.time() > deadline:
                raise ApiError(503, "not applied", f"the queue manager did not apply {what} "
                                                   f"within {SETTLE_S:g}s (is it stopping?)")
            await asyncio.sleep(0.005)

    async def _record(self, who: str, action: AuditAction, target: str, reason: str,
                      before: Any, after: Any, *, reversible: bool,
                      rollback_of: int | None = None) -> AuditRecord:
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self.pool, functools.partial(
                    self.audit.append, who, action, target, reason, before, after,
                    reversible=reversible, now=self.clock(), rollback_of=rollback_of))
        except OSError as exc:
            log.error("audit history %s not written: %s", self.audit.path, exc)
            raise ApiError(503, "audit not written",
                           f"the change was applied, but the audit history "
                           f"{self.audit.path} could not be written: {exc}") from None

    # suspensions

    def _manual(self) -> dict[str, SuspensionView]:
        return {v.id: v for v in self.scheduler.suspensions(self.now()) if not v.automatic}

    async def _persist_suspensions(self) -> None:
        path = self.config.scheduler.suspensions
        if not path:
            return
        from_policy = {s.id for s in self.scheduler.policy.suspensions}
        items = [Suspension(v.fields, v.id, v.expires_at, v.tag, v.reason).to_data()
                 for v in self._manual().values() if v.id not in from_policy]
        text = ("# Suspensions added at run time (REST API, web page, `sluice suspend`);\n"
                "# rewritten by sluice serve on every change.\n"
                + yaml.safe_dump(items, sort_keys=True))
        try:
            await asyncio.get_running_loop().run_in_executor(
                self.pool, write_atomically, path, text)
        except OSError as exc:
            log.error("suspensions not saved to %s: %s", path, exc)
            raise ApiError(503, "not saved", f"the change is in force but {path} could not be "
                                             f"written, so a restart would lose it: {exc}"
                           ) from None

    def _change(self, event: Any) -> None:
        """Hand an operator change to the manager, which checks it first."""
        try:
            self.manager.change(event)
        except ValueError as exc:
            raise ApiError(409, "conflict", str(exc)) from None

    async def _post_suspension(self, susp: Suspension) -> SuspensionView:
        manual = self._manual()
        same = next((v for v in manual.values() if v.fields == susp.fields), None)
        if same is None and susp.id in manual:
            raise ApiError(409, "conflict", f"a suspension with id {susp.id!r} exists with "
                                            "other fields")
        target = same.id if same is not None else susp.id

        def applied() -> bool:
            view = self._manual().get(target)
            return (view is not None and view.expires_at == susp.expires_at
                    and view.reason == (susp.reason or view.reason))

        self._change(SuspensionAdded(susp))
        await self._settle(applied, f"suspension {target}")
        return self._manual()[target]

    async def _drop_suspension(self, sid: str) -> None:
        self._change(SuspensionRemoved(sid))
        await self._settle(lambda: sid not in self._manual(), f"the removal of {sid}")

    async def add_suspension(self, who: str, fields: Mapping[str, str], *, ttl: str | None,
                             expires_at: float | None, sid: str | None, tag: str,
                             reason: str) -> tuple[dict[str, Any], int]:
        if not fields:
            raise ApiError(422, "invalid request",
                           [{"path": "fields", "message": "a suspension needs at least one "
                                                         "field"}])
        expiry = self._expiry(ttl, expires_at)
        data: dict[str, Any] = {**fields, "tag": tag, "reason": reason}
        if expiry is not None:
            data["expires_at"] = expiry
        if sid:
            data["id"] = sid
        try:
            susp = parse_suspension(data, "fields", source="request")
        except PolicyError as exc:
            raise ApiError(422, "invalid suspension", _problems(exc)) from None
        async with self._lock:
            manual = self._manual()
            same = next((v for v in manual.values() if v.fields == susp.fields), None)
            before = suspension_data(same) if same is not None else None
            view = await self._post_suspension(susp)
            after = suspension_data(view)
            record = await self._record(who, AuditAction.SUSPENSION_ADD, view.id, reason,
                                        before, after, reversible=True)
            await self._persist_suspensions()
        return after, record.id

    async def remove_suspension(self, who: str, sid: str, reason: str) -> int:
        async with self._lock:
            views = self.scheduler.suspensions(self.now())
            view = next((v for v in views if v.id == sid), None)
            if view is None:
                raise ApiError(404, "not found", f"no suspension {sid!r}")
            if view.automatic:
                raise ApiError(409, "conflict", f"{sid} is a counter over its threshold; it "
                               "ends by itself (change the policy to change the threshold)")
            await self._drop_suspension(sid)
            record = await self._record(who, AuditAction.SUSPENSION_REMOVE, sid, reason,
                                        suspension_data(view), None, reversible=True)
            await self._persist_suspensions()
        return record.id

    # conditions

    def _counter(self, counter_id: str) -> Counter:
        try:
            counter: Counter = self.scheduler.policy.counter(counter_id)
        except KeyError:
            raise ApiError(404, "not found", f"no counter {counter_id!r} in the running policy "
                                             "(GET /api/v1/policy lists them)") from None
        return counter

    @staticmethod
    def _parse_condition(counter: Counter, data: Mapping[str, Any]) -> Condition:
        """A condition checked as the policy file's would be, against its counter."""
        counter_data = counter.to_data()
        counter_data["conditions"] = [dict(data)]
        stem = "policies[0].conditions[0]"
        try:
            policy = parse_policy({"policies": [counter_data]}, source="request")
        except PolicyError as exc:
            mine = [(p, m) for p, m in exc.problems if p.startswith(stem)] or exc.problems
            raise ApiError(422, "invalid condition",
                           _problems(PolicyError("request", mine), stem, "condition")) from None
        return policy.counters[0].conditions[0]

    @staticmethod
    def _condition_at(counter: Counter, cond_id: str) -> tuple[int, Condition] | None:
        for i, cond in enumerate(counter.conditions):
            if cond.id == cond_id:
                return i, cond
        return None

    async def _post_condition(self, counter: Counter, cond: Condition, position: int) -> int:
        # The scheduler replaces a condition with the same id, then inserts.
        remaining = [c for c in counter.conditions if c.id != cond.id]
        position = max(0, min(position, len(remaining)))

        def applied() -> bool:
            try:
                now_counter = self.scheduler.policy.counter(counter.id)
            except KeyError:
                return True  # reloaded away meanwhile: nothing more will happen
            found = self._condition_at(now_counter, cond.id)
            return found is not None and found[1] == cond

        self._change(ConditionAdded(counter.id, cond, position))
        await self._settle(applied, f"condition {cond.id}")
        return position

    async def _drop_condition(self, counter: Counter, cond_id: str) -> None:
        def applied() -> bool:
            try:
                return self._condition_at(self.scheduler.policy.counter(counter.id),
                                          cond_id) is None
            except KeyError:
                return True

        self._change(ConditionRemoved(counter.id, cond_id))
        await self._settle(applied, f"the removal of condition {cond_id}")

    @staticmethod
    def _new_condition_id(counter: Counter) -> str:
        taken = {c.id for c in counter.conditions}
        for n in itertools.count(1):
            cid = f"api-{n}"
            if cid not in taken:
                return cid
        raise AssertionError("unreachable")

    async def add_condition(self, who: str, counter_id: str, match: Mapping[str, str],
                            thresholds: Mapping[str, Any], *, position: int,
                            ttl: str | None, expires_at: float | None, cid: str | None,
                            tag: str, reason: str) -> dict[str, Any]:
        expiry = self._expiry(ttl, expires_at)
        async with self._lock:
            counter = self._counter(counter_id)
            data: dict[str, Any] = {"if": dict(match), **thresholds,
                                    "id": cid or self._new_condition_id(counter),
                                    "tag": tag, "reason": reason}
            if expiry is not None:
                data["expires_at"] = expiry
            cond = self._parse_condition(counter, data)
            found = self._condition_at(counter, cond.id)
            before = None if found is None else {
                "counter": counter.id, "position": found[0], "condition": found[1].to_data()}
            at = await self._post_condition(counter, cond, position)
            after = {"counter": counter.id, "position": at, "condition": cond.to_data()}
            record = await self._record(who, AuditAction.CONDITION_ADD,
                                        f"{counter.id}/{cond.id}", reason, before, after,
                                        reversible=True)
        return {**after, "audit_id": record.id}

    async def remove_condition(self, who: str, counter_id: str, cond_id: str,
                               reason: str) -> int:
        async with self._lock:
            counter = self._counter(counter_id)
            found = self._condition_at(counter, cond_id)
            if found is None:
                raise ApiError(404, "not found", f"counter {counter.id} has no condition with "
                                                 f"id {cond_id!r}")
            await self._drop_condition(counter, cond_id)
            before = {"counter": counter.id, "position": found[0],
                      "condition": found[1].to_data()}
            record = await self._record(who, AuditAction.CONDITION_REMOVE,
                                        f"{counter.id}/{cond_id}", reason, before, None,
                                        reversible=True)
        return record.id

    # reload

    @staticmethod
    def _policy_data(policy: Policy) -> dict[str, Any]:
        return {"source": policy.source, "policy": policy.to_data()}

    async def _install(self, policy: Policy) -> None:
        # The same content counts as installed: the policy file watcher may
        # have read the same file meanwhile.
        want = _canonical(policy.to_data())

        def applied() -> bool:
            running = self.scheduler.policy
            return running is policy or _canonical(running.to_data()) == want

        self._change(PolicyReloaded(policy))
        await self._settle(applied, "the policy")

    async def reload(self, who: str, reason: str) -> dict[str, Any]:
        path = self.manager.policy_path
        async with self._lock:
            try:
                policy = await self.io(load_policy_file, path) if path else Policy()
            except PolicyError as exc:
                raise ApiError(422, "invalid policy", _problems(exc)) from None
            old: Policy = self.scheduler.policy
            await self._install(policy)
            record = await self._record(who, AuditAction.POLICY_RELOAD, path or "<no file>",
                                        reason, self._policy_data(old),
                                        self._policy_data(policy), reversible=True)
            self._replaced[record.id] = old
        log.info("policy reloaded from %s through the API by %s", path, who)
        return {"source": policy.source, "counters": len(policy.counters),
                "suspensions": len(policy.suspensions), "audit_id": record.id}

    # rollback

    async def rollback(self, who: str, record_id: int, reason: str, force: bool) -> int:
        async with self._lock:
            rec = self.audit.get(record_id)
            if rec is None:
                raise ApiError(404, "not found", f"no audit record {record_id}")
            undone = self.audit.rolled_back_by(record_id)
            if undone is not None:
                raise ApiError(409, "conflict", f"record {record_id} was already rolled back "
                                                f"by record {undone}")
            if not rec.reversible:
                raise ApiError(409, "not reversible",
                               f"{rec.action} cannot be rolled back" +
                               (" (queue changes are final; act on the queue again)"
                                if rec.action.startswith("queue.") else ""))
            before, after = await self._undo(rec, force)
            record = await self._record(who, AuditAction.ROLLBACK, rec.target, reason,
                                        before, after, reversible=False,
                                        rollback_of=record_id)
            if rec.action in (AuditAction.SUSPENSION_ADD, AuditAction.SUSPENSION_REMOVE):
                await self._persist_suspensions()
        return record.id

    async def _undo(self, rec: AuditRecord, force: bool) -> tuple[Any, Any]:
        now = self.clock()
        match rec.action:
            case AuditAction.SUSPENSION_ADD:
                sid = rec.after["id"]
                current = self._manual().get(sid)
                if current is None:
                    raise ApiError(409, "conflict", f"suspension {sid} is no longer in force "
                                                    "(it expired or was removed)")
                previous = rec.before
                if previous is None or (previous.get("expires_at") is not None
                                        and previous["expires_at"] <= now):
                    await self._drop_suspension(sid)
                    return suspension_data(current), None
                view = await self._post_suspension(_suspension_of(previous))
                return suspension_data(current), suspension_data(view)
            case AuditAction.SUSPENSION_REMOVE:
                susp = _suspension_of(rec.before)
                if susp.expires_at is not None and susp.expires_at <= now:
                    raise ApiError(409, "conflict", f"suspension {susp.id} would have expired "
                                                    "by now")
                same = next((v for v in self._manual().values() if v.fields == susp.fields),
                            None)
                if same is not None:
                    raise ApiError(409, "conflict", f"the same fields are suspended again "
                                                    f"(suspension {same.id})")
                view = await self._post_suspension(susp)
                return None, suspension_data(view)
            case AuditAction.CONDITION_ADD:
                counter = self._counter_for_undo(rec.after["counter"])
                cond_id = rec.after["condition"]["id"]
                found = self._condition_at(counter, cond_id)
                if found is None:
                    raise ApiError(409, "conflict", f"condition {cond_id} is no longer in "
                                                    f"counter {counter.id}")
                before = {"counter": counter.id, "position": found[0],
                          "condition": found[1].to_data()}
                if rec.before is None:
                    await self._drop_condition(counter, cond_id)
                    return before, None
                old = self._parse_condition(counter, rec.before["condition"])
                at = await self._post_condition(counter, old, int(rec.before["position"]))
                return before, {"counter": counter.id, "position": at,
                                "condition": old.to_data()}
            case AuditAction.CONDITION_REMOVE:
                counter = self._counter_for_undo(rec.before["counter"])
                data = rec.before["condition"]
                if data.get("expires_at") is not None and data["expires_at"] <= now:
                    raise ApiError(409, "conflict", f"condition {data.get('id')} would have "
                                                    "expired by now")
                if self._condition_at(counter, str(data.get("id"))) is not None:
                    raise ApiError(409, "conflict", f"counter {counter.id} has a condition "
                                                    f"{data.get('id')} again")
                cond = self._parse_condition(counter, data)
                at = await self._post_condition(counter, cond, int(rec.before["position"]))
                return None, {"counter": counter.id, "position": at,
                              "condition": cond.to_data()}
            case AuditAction.POLICY_RELOAD:
                running = self.scheduler.policy
                if (not force and _canonical(running.to_data())
                        != _canonical(rec.after["policy"])):
                    raise ApiError(409, "conflict", "the policy changed since this reload; "
                                   "roll back with force=true to restore it anyway")
                policy = self._replaced.get(rec.id)
                if policy is None:
                    try:
                        policy = parse_policy(rec.before["policy"], rec.before["source"])
                    except PolicyError as exc:
                        raise ApiError(409, "conflict", "the recorded policy no longer "
                                                        f"parses: {exc}") from None
                await self._install(policy)
                return self._policy_data(running), self._policy_data(policy)
        raise ApiError(409, "not reversible", f"{rec.action} cannot be rolled back")

    def _counter_for_undo(self, counter_id: str) -> Counter:
        try:
            counter: Counter = self.scheduler.policy.counter(counter_id)
        except KeyError:
            raise ApiError(409, "conflict", f"counter {counter_id} is no longer in the "
                                            "policy") from None
        return counter
