"""Rolling back a change of the audit history: the inverse change, recorded.

SUMMARY
    audit_id = await control.rollbacks.rollback(who, record_id, reason, force)

DESCRIPTION
    A rollback applies the inverse change: an added suspension or
    condition is removed (or the one it replaced is put back), a removed
    one is added again where it was, a reload restores the policy that ran
    before -- whoever made it: the API, SIGHUP or the file watcher.  The
    rollback is itself a record (``rollback_of``), and a change is rolled
    back at most once.

STRATEGIES
    Undo only what still holds.  It refuses (409) when the state moved on
    so that the inverse would be wrong: the suspension already ended, the
    counter is gone, the policy was changed since (unless forced), a
    reload or restart ended the run-time condition (roll the reload back
    instead).  Queue actions are final.

SEE ALSO
    sluice.api.audit, sluice.api.policy_ops, docs/api.md
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sluice.api.audit import AuditAction, AuditRecord
from sluice.api.errors import ApiError
from sluice.api.policy_ops import canonical, suspension_data, suspension_of
from sluice.scheduler import Counter, Policy, PolicyError, parse_policy

if TYPE_CHECKING:
    from sluice.api.control import Control

__all__ = ["Rollbacks"]


class Rollbacks:
    """Undo a recorded change."""

    def __init__(self, control: Control) -> None:
        self.c = control

    async def rollback(self, who: str, record_id: int, reason: str, force: bool) -> int:
        """Undo the change of audit record ``record_id``, and audit that; the new record's id.

        Refused (409) when the record was rolled back already, is not
        reversible, or a reload ended it.
        """
        c = self.c
        async with c.change_lock:
            rec = c.audit.get(record_id)
            if rec is None:
                raise ApiError(404, "not found", f"no audit record {record_id}")
            undone = c.audit.rolled_back_by(record_id)
            if undone is not None:
                raise ApiError(409, "conflict", f"record {record_id} was already rolled back "
                                                f"by record {undone}")
            if not rec.reversible:
                raise ApiError(409, "not reversible",
                               f"{rec.action} cannot be rolled back" +
                               (" (queue changes are final; act on the queue again)"
                                if rec.action.startswith("queue.") else ""))
            ended = c.audit.ended_by(record_id)
            if ended is not None:
                raise ApiError(409, "conflict", f"record {record_id} was ended by record "
                               f"{ended}, which reloaded the policy (roll that back to bring "
                               "run-time conditions back)")
            before, after = await self._undo(rec, force)
            record = await c.record(who, AuditAction.ROLLBACK, rec.target, reason, before,
                                    after, reversible=False, rollback_of=record_id)
            if rec.action in (AuditAction.SUSPENSION_ADD, AuditAction.SUSPENSION_REMOVE):
                await c.policy_ops.persist_suspensions()
        return record.id

    def _counter(self, counter_id: str) -> Counter:
        try:
            counter: Counter = self.c.scheduler.policy.counter(counter_id)
        except KeyError:
            raise ApiError(409, "conflict", f"counter {counter_id} is no longer in the "
                                            "policy") from None
        return counter

    async def _undo(self, rec: AuditRecord, force: bool) -> tuple[Any, Any]:
        ops = self.c.policy_ops
        now = self.c.clock()
        match rec.action:
            case AuditAction.SUSPENSION_ADD:
                sid = rec.after["id"]
                current = ops.manual().get(sid)
                if current is None:
                    raise ApiError(409, "conflict", f"suspension {sid} is no longer in force "
                                                    "(it expired or was removed)")
                previous = rec.before
                if previous is None or (previous.get("expires_at") is not None
                                        and previous["expires_at"] <= now):
                    await ops.drop_suspension(sid)
                    return suspension_data(current), None
                view = await ops.post_suspension(suspension_of(previous))
                return suspension_data(current), suspension_data(view)
            case AuditAction.SUSPENSION_REMOVE:
                susp = suspension_of(rec.before)
                if susp.expires_at is not None and susp.expires_at <= now:
                    raise ApiError(409, "conflict", f"suspension {susp.id} would have expired "
                                                    "by now")
                same = next((v for v in ops.manual().values() if v.fields == susp.fields),
                            None)
                if same is not None:
                    raise ApiError(409, "conflict", f"the same fields are suspended again "
                                                    f"(suspension {same.id})")
                view = await ops.post_suspension(susp)
                return None, suspension_data(view)
            case AuditAction.CONDITION_ADD:
                counter = self._counter(rec.after["counter"])
                cond_id = rec.after["condition"]["id"]
                found = ops.condition_at(counter, cond_id)
                if found is None:
                    raise ApiError(409, "conflict", f"condition {cond_id} is no longer in "
                                                    f"counter {counter.id}")
                before = {"counter": counter.id, "position": found[0],
                          "condition": found[1].to_data()}
                if rec.before is None:
                    await ops.drop_condition(counter, cond_id)
                    return before, None
                old = ops.parse_condition(counter, rec.before["condition"])
                at = await ops.post_condition(counter, old, int(rec.before["position"]))
                return before, {"counter": counter.id, "position": at,
                                "condition": old.to_data()}
            case AuditAction.CONDITION_REMOVE:
                counter = self._counter(rec.before["counter"])
                data = rec.before["condition"]
                if data.get("expires_at") is not None and data["expires_at"] <= now:
                    raise ApiError(409, "conflict", f"condition {data.get('id')} would have "
                                                    "expired by now")
                if ops.condition_at(counter, str(data.get("id"))) is not None:
                    raise ApiError(409, "conflict", f"counter {counter.id} has a condition "
                                                    f"{data.get('id')} again")
                cond = ops.parse_condition(counter, data)
                at = await ops.post_condition(counter, cond, int(rec.before["position"]))
                return None, {"counter": counter.id, "position": at,
                              "condition": cond.to_data()}
            case AuditAction.POLICY_RELOAD:
                running = self.c.scheduler.policy
                if (not force and canonical(running.to_data())
                        != canonical(rec.after["policy"])):
                    raise ApiError(409, "conflict", "the policy changed since this reload; "
                                   "roll back with force=true to restore it anyway")
                policy: Policy | None = ops.replaced.get(rec.id)
                if policy is None:
                    try:
                        policy = parse_policy(rec.before["policy"], rec.before["source"])
                    except PolicyError as exc:
                        raise ApiError(409, "conflict", "the recorded policy no longer "
                                                        f"parses: {exc}") from None
                await ops.install(policy)
                return ops.policy_data(running), ops.policy_data(policy)
        raise ApiError(409, "not reversible", f"{rec.action} cannot be rolled back")
