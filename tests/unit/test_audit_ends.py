"""A run-time condition change that a reload or a restart ended is not reversible.

Conditions added or removed through the API live in the scheduler's memory:
a reload of the policy file (SIGHUP, the file watcher, the API) or a
restart replaces them with the file's.  The audit history must say so --
the reload or restart record lists what it ended, and the ended change is
no longer offered as reversible -- also when a second process (another
`sluice serve`, a command) wrote the records.
"""

from __future__ import annotations

from pathlib import Path

from sluice.api.audit import AuditAction, AuditLog


def _condition(log: AuditLog, now: float) -> int:
    return log.append("alice", AuditAction.CONDITION_ADD, "domain", "slow down", None,
                      {"counter": "domain", "id": "c1"}, reversible=True, now=now).id


def test_a_sighup_reload_ends_the_conditions_added_before_it(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "audit.jsonl")
    added = _condition(log, 100.0)
    record = log.get(added)
    assert record is not None and log.reversible_now(record, 101.0)
    reload = log.append("SIGHUP", AuditAction.POLICY_RELOAD, "policy.yaml", "SIGHUP", {}, {},
                        reversible=True, now=102.0)
    assert reload.ends == (added,) and reload.who == "SIGHUP"
    assert log.ended_by(added) == reload.id
    assert not log.reversible_now(record, 103.0)
    # Another reader of the same file (the API of another process) agrees.
    other = AuditLog(tmp_path / "audit.jsonl")
    assert other.ended_by(added) == reload.id
    # The reload itself can still be rolled back: that is what brings it back.
    assert log.reversible_now(reload, 103.0)


def test_a_restart_is_recorded_once_with_the_conditions_it_lost(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "audit.jsonl")
    added = _condition(log, 100.0)
    restart = log.restarted(200.0)
    assert restart is not None and restart.action == AuditAction.RESTART
    assert restart.ends == (added,)
    record = log.get(added)
    assert record is not None and not log.reversible_now(record, 201.0)
    # Nothing left to end: a second start writes no record.
    assert log.restarted(300.0) is None
