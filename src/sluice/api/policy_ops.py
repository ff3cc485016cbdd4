"""The API's changes to the pickup policy: suspensions, conditions, reloads.

SUMMARY
    ops = control.policy_ops
    await ops.add_suspension(who, fields, ...) -> SuspensionResult; remove_suspension
    await ops.add_condition(who, counter, match, thresholds, ...) -> ConditionResult;
    remove_condition; await ops.reload(who, reason) -> ReloadResult

DESCRIPTION
    Policy changes are events posted to the queue manager
    (PolicyReloaded, ConditionAdded, ConditionRemoved, SuspensionAdded,
    SuspensionRemoved).  Each is checked here first against the
    scheduler's own rules, so an event can never fail inside the
    manager's loop, then this module waits until the scheduler shows the
    change before it answers: the caller sees the state it asked for, and
    the audit record's ``after`` is what the scheduler really holds.
    sluice.api.rollback uses the same steps to undo a change.

STRATEGIES
    Suspensions survive restarts.  With scheduler.suspensions set, every
    change rewrites that file (write, fsync, rename) with the manual
    suspensions in force, which the queue manager loads at start.

LIMITATIONS
    Conditions added at run time live in memory: a restart, or a reload
    of the policy file (by the API, SIGHUP or the file watcher), ends
    them -- the reload's audit record keeps them (and says which changes
    it ended), and rolling it back brings them back.  Conditions of the
    policy file have no id unless the file gives one, and only conditions
    with an id can be removed here.

SEE ALSO
    sluice.api.control, sluice.api.rollback, sluice.scheduler, docs/api.md
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from sluice.api.audit import AuditAction
from sluice.api.errors import ApiError, problems
from sluice.api.models import ConditionResult, ReloadResult, SuspensionResult
from sluice.api.views import suspension_model
from sluice.config import parse_duration
from sluice.policyfile import load_policy_file
from sluice.scheduler import (
    Condition,
    ConditionAdded,
    ConditionRemoved,
    Counter,
    Event,
    Policy,
    PolicyError,
    PolicyReloaded,
    Suspension,
    SuspensionAdded,
    SuspensionRemoved,
    SuspensionView,
    parse_policy,
    parse_suspension,
)

if TYPE_CHECKING:
    from sluice.api.control import Control

__all__ = ["MAX_TTL_S", "PolicyOps", "canonical", "suspension_data", "suspension_of",
           "write_atomically"]

log = logging.getLogger("sluice.api")

#: How long a change may take to show in the scheduler before we give up.
SETTLE_S = 5.0

#: The longest expiry a suspension or condition may be given.
MAX_TTL_S = 366 * 86400.0


def canonical(data: Any) -> str:
    """``data`` as canonical JSON, so equal policies compare equal as text."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)


def suspension_data(view: SuspensionView) -> dict[str, Any]:
    """A suspension as the audit history keeps it."""
    return suspension_model(view).model_dump()


def suspension_of(data: Mapping[str, Any]) -> Suspension:
    """A suspension back from its audit data."""
    return Suspension(tuple(sorted(dict(data["fields"]).items())), str(data["id"]),
                      data.get("expires_at"), str(data.get("tag", "")),
                      str(data.get("reason", "")))


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


class PolicyOps:
    """Suspensions, conditions and reloads, each checked, applied, awaited and recorded."""

    def __init__(self, control: Control) -> None:
        self.c = control
        #: Policies replaced by reloads of this run, by audit id (exact objects
        #: for rollbacks; after a restart the record's data is parsed instead).
        self.replaced: dict[int, Policy] = {}

    # -- shared steps ----------------------------------------------------------------

    def expiry(self, ttl: str | None, expires_at: float | None) -> float | None:
        """The expiry a request asks for (POSIX time), checked against the clock."""
        if ttl is not None and expires_at is not None:
            raise ApiError(422, "invalid request", "give 'ttl' or 'expires_at', not both")
        now = self.c.clock()
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
            # Relative to the server's clock, which the request cannot know: a
            # conflict with the state, not a malformed request.
            if not (math.isfinite(expires_at) and now < expires_at <= now + MAX_TTL_S):
                raise ApiError(409, "conflict",
                               [{"path": "expires_at",
                                 "message": "a time in the coming 366 days (the server's "
                                            f"clock says {now:.0f})"}])
            return float(expires_at)
        return None

    async def settle(self, done: Callable[[], bool], what: str) -> None:
        """Wait until the queue manager's loop has applied our event."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SETTLE_S
        while not done():
            if loop.time() > deadline:
                raise ApiError(503, "not applied", f"the queue manager did not apply {what} "
                                                   f"within {SETTLE_S:g}s (is it stopping?)")
            await asyncio.sleep(0.005)

    def change(self, event: Event) -> None:
        """Hand an operator change to the manager, which checks it first."""
        try:
            self.c.manager.change(event)
        except ValueError as exc:
            raise ApiError(409, "conflict", str(exc)) from None

    # -- suspensions -----------------------------------------------------------------

    def manual(self) -> dict[str, SuspensionView]:
        """The suspensions added by hand, by id."""
        return {v.id: v for v in self.c.scheduler.suspensions(self.c.now()) if not v.automatic}

    async def persist_suspensions(self) -> None:
        """Write the suspensions added at run time to scheduler.suspensions, if set.

        A failure to write is a 503 that says the change is in force but would
        not survive a restart.
        """
        path = self.c.config.scheduler.suspensions
        if not path:
            return
        from_policy = {s.id for s in self.c.scheduler.policy.suspensions}
        items = [Suspension(v.fields, v.id, v.expires_at, v.tag, v.reason).to_data()
                 for v in self.manual().values() if v.id not in from_policy]
        text = ("# Suspensions added at run time (REST API, web page, `sluice suspend`);\n"
                "# rewritten by sluice serve on every change.\n"
                + yaml.safe_dump(items, sort_keys=True))
        try:
            await asyncio.get_running_loop().run_in_executor(
                self.c.pool, write_atomically, path, text)
        except OSError as exc:
            log.error("suspensions not saved to %s: %s", path, exc)
            raise ApiError(503, "not saved", f"the change is in force but {path} could not be "
                                             f"written, so a restart would lose it: {exc}"
                           ) from None

    async def post_suspension(self, susp: Suspension) -> SuspensionView:
        """Hand a suspension to the scheduler and wait until it is in force.

        One with the same fields is updated; the same id with other fields is a
        409.
        """
        manual = self.manual()
        same = next((v for v in manual.values() if v.fields == susp.fields), None)
        if same is None and susp.id in manual:
            raise ApiError(409, "conflict", f"a suspension with id {susp.id!r} exists with "
                                            "other fields")
        target = same.id if same is not None else susp.id

        def applied() -> bool:
            view = self.manual().get(target)
            return (view is not None and view.expires_at == susp.expires_at
                    and view.reason == (susp.reason or view.reason))

        self.change(SuspensionAdded(susp))
        await self.settle(applied, f"suspension {target}")
        return self.manual()[target]

    async def drop_suspension(self, sid: str) -> None:
        """Have the scheduler lift a suspension, and wait until it has."""
        self.change(SuspensionRemoved(sid))
        await self.settle(lambda: sid not in self.manual(), f"the removal of {sid}")

    async def add_suspension(self, who: str, fields: Mapping[str, str], *, ttl: str | None,
                             expires_at: float | None, sid: str | None, tag: str,
                             reason: str) -> SuspensionResult:
        """POST /suspensions: check, apply, audit and save a suspension by hand."""
        if not fields:
            raise ApiError(422, "invalid request",
                           [{"path": "fields", "message": "a suspension needs at least one "
                                                         "field"}])
        expiry = self.expiry(ttl, expires_at)
        data: dict[str, Any] = {**fields, "tag": tag, "reason": reason}
        if expiry is not None:
            data["expires_at"] = expiry
        if sid:
            data["id"] = sid
        try:
            susp = parse_suspension(data, "fields", source="request")
        except PolicyError as exc:
            raise ApiError(422, "invalid suspension", problems(exc)) from None
        async with self.c.change_lock:
            same = next((v for v in self.manual().values() if v.fields == susp.fields), None)
            before = suspension_data(same) if same is not None else None
            view = await self.post_suspension(susp)
            record = await self.c.record(who, AuditAction.SUSPENSION_ADD, view.id, reason,
                                         before, suspension_data(view), reversible=True)
            await self.persist_suspensions()
        return SuspensionResult(suspension=suspension_model(view), audit_id=record.id)

    async def remove_suspension(self, who: str, sid: str, reason: str) -> int:
        """DELETE /suspensions/{id}: lift a suspension by hand, audit and save; the audit id.

        A counter over its threshold is not one to lift (409).
        """
        async with self.c.change_lock:
            views = self.c.scheduler.suspensions(self.c.now())
            view = next((v for v in views if v.id == sid), None)
            if view is None:
                raise ApiError(404, "not found", f"no suspension {sid!r}")
            if view.automatic:
                raise ApiError(409, "conflict", f"{sid} is a counter over its threshold; it "
                               "ends by itself (change the policy to change the threshold)")
            await self.drop_suspension(sid)
            record = await self.c.record(who, AuditAction.SUSPENSION_REMOVE, sid, reason,
                                         suspension_data(view), None, reversible=True)
            await self.persist_suspensions()
        return record.id

    # -- conditions ------------------------------------------------------------------

    def counter(self, counter_id: str, *, status: int = 404) -> Counter:
        """The running policy's counter ``counter_id``; an ApiError with ``status`` if none."""
        try:
            counter: Counter = self.c.scheduler.policy.counter(counter_id)
        except KeyError:
            raise ApiError(status, "not found" if status == 404 else "conflict",
                           f"no counter {counter_id!r} in the running policy "
                           "(GET /api/v1/policy lists them)") from None
        return counter

    @staticmethod
    def parse_condition(counter: Counter, data: Mapping[str, Any]) -> Condition:
        """A condition checked as the policy file's would be, against its counter.

        The counter of the running policy, so a refusal is a conflict with that
        policy: 409.
        """
        counter_data = counter.to_data()
        counter_data["conditions"] = [dict(data)]
        stem = "policies[0].conditions[0]"
        try:
            policy = parse_policy({"policies": [counter_data]}, source="request")
        except PolicyError as exc:
            mine = [(p, m) for p, m in exc.problems if p.startswith(stem)] or exc.problems
            raise ApiError(409, "condition refused",
                           problems(PolicyError("request", mine), stem, "condition")) from None
        return policy.counters[0].conditions[0]

    @staticmethod
    def condition_at(counter: Counter, cond_id: str) -> tuple[int, Condition] | None:
        """The position and condition with id ``cond_id`` in ``counter``; None if none."""
        for i, cond in enumerate(counter.conditions):
            if cond.id == cond_id:
                return i, cond
        return None

    async def post_condition(self, counter: Counter, cond: Condition, position: int) -> int:
        """Hand a condition to the scheduler, wait until it is in force; where it went.

        The scheduler replaces a condition with the same id, then inserts at
        ``position`` (clamped to the conditions that remain).
        """
        # The scheduler replaces a condition with the same id, then inserts.
        remaining = [c for c in counter.conditions if c.id != cond.id]
        position = max(0, min(position, len(remaining)))

        def applied() -> bool:
            try:
                now_counter = self.c.scheduler.policy.counter(counter.id)
            except KeyError:
                return True  # reloaded away meanwhile: nothing more will happen
            found = self.condition_at(now_counter, cond.id)
            return found is not None and found[1] == cond

        self.change(ConditionAdded(counter.id, cond, position))
        await self.settle(applied, f"condition {cond.id}")
        return position

    async def drop_condition(self, counter: Counter, cond_id: str) -> None:
        """Have the scheduler remove a condition, and wait until it has."""
        def applied() -> bool:
            try:
                return self.condition_at(self.c.scheduler.policy.counter(counter.id),
                                         cond_id) is None
            except KeyError:
                return True

        self.change(ConditionRemoved(counter.id, cond_id))
        await self.settle(applied, f"the removal of condition {cond_id}")

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
                            tag: str, reason: str) -> ConditionResult:
        """POST /policy/conditions: check, apply and audit a condition added at run time."""
        expiry = self.expiry(ttl, expires_at)
        async with self.c.change_lock:
            counter = self.counter(counter_id)
            data: dict[str, Any] = {"if": dict(match), **thresholds,
                                    "id": cid or self._new_condition_id(counter),
                                    "tag": tag, "reason": reason}
            if expiry is not None:
                data["expires_at"] = expiry
            cond = self.parse_condition(counter, data)
            found = self.condition_at(counter, cond.id)
            before = None if found is None else {
                "counter": counter.id, "position": found[0], "condition": found[1].to_data()}
            at = await self.post_condition(counter, cond, position)
            after = {"counter": counter.id, "position": at, "condition": cond.to_data()}
            record = await self.c.record(who, AuditAction.CONDITION_ADD,
                                         f"{counter.id}/{cond.id}", reason, before, after,
                                         reversible=True)
        return ConditionResult(counter=counter.id, position=at, condition=cond.to_data(),
                               audit_id=record.id)

    async def remove_condition(self, who: str, counter_id: str, cond_id: str,
                               reason: str) -> int:
        """DELETE a condition from a counter of the running policy, and audit it; the audit id."""
        async with self.c.change_lock:
            counter = self.counter(counter_id)
            found = self.condition_at(counter, cond_id)
            if found is None:
                raise ApiError(404, "not found", f"counter {counter.id} has no condition with "
                                                 f"id {cond_id!r}")
            await self.drop_condition(counter, cond_id)
            before = {"counter": counter.id, "position": found[0],
                      "condition": found[1].to_data()}
            record = await self.c.record(who, AuditAction.CONDITION_REMOVE,
                                         f"{counter.id}/{cond_id}", reason, before, None,
                                         reversible=True)
        return record.id

    # -- reloads ---------------------------------------------------------------------

    @staticmethod
    def policy_data(policy: Policy) -> dict[str, Any]:
        """A policy as the audit history keeps it: its source and content."""
        return {"source": policy.source, "policy": policy.to_data()}

    async def install(self, policy: Policy) -> None:
        """Hand the scheduler a whole policy and wait until it runs.

        The same content counts as installed: the policy file watcher may have
        read the same file meanwhile.
        """
        # The same content counts as installed: the policy file watcher may
        # have read the same file meanwhile.
        want = canonical(policy.to_data())

        def applied() -> bool:
            running = self.c.scheduler.policy
            return running is policy or canonical(running.to_data()) == want

        self.change(PolicyReloaded(policy))
        await self.settle(applied, "the policy")

    async def reload(self, who: str, reason: str) -> ReloadResult:
        """POST /policy/reload: read scheduler.policy again, install and audit it.

        A broken file is a 409, and the running policy stays.
        """
        path = self.c.manager.policy_path
        async with self.c.change_lock:
            try:
                policy = await self.c.io(load_policy_file, path) if path else Policy()
            except PolicyError as exc:
                # The file on disk is the state this request meets: a conflict.
                raise ApiError(409, "invalid policy", problems(exc)) from None
            old: Policy = self.c.scheduler.policy
            await self.install(policy)
            record = await self.c.record(who, AuditAction.POLICY_RELOAD, path or "<no file>",
                                         reason, self.policy_data(old),
                                         self.policy_data(policy), reversible=True)
            self.replaced[record.id] = old
        log.info("policy reloaded from %s through the API by %s", path, who)
        return ReloadResult(source=policy.source, counters=len(policy.counters),
                            suspensions=len(policy.suspensions), audit_id=record.id)
