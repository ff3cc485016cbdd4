"""The audit history: every change made to the queue or the policy, and how to undo it.

SUMMARY
    log = AuditLog(path)            (audit_path(config): the configured file)
    record = log.append(who, action, target, reason, before, after,
                        reversible=..., now=...)
    log.get(id); log.page(limit, before); log.rolled_back_by(id); log.ended_by(id)
    log.queue_action(who, action, selector, ...)   (the API and the CLI)
    log.restarted(now)                             (`sluice serve` at start)

DESCRIPTION
    One JSON line per change, appended to ``api.audit_path`` (by default
    ``<queue.path>/api-audit.jsonl``): id, time, who (the name of the
    token, ``cli:<user>`` for a command, ``SIGHUP`` or ``policy file
    watcher`` for a reload `sluice serve` made itself), what
    (AuditAction), the target, the reason given, and the state before and
    after as plain data.  Policy changes carry enough ``before`` to be
    rolled back (sluice.api.rollback does it); a rollback is itself a
    record, with ``rollback_of`` naming the change it undid.

    What ends a change.  Conditions added or removed at run time live in
    the scheduler's memory: a reload of the policy file (from the API,
    SIGHUP or the file watcher) replaces them with the file's, and so does
    a restart.  A reload's record therefore lists in ``ends`` the condition
    changes made since the policy was last loaded, and `sluice serve`
    writes a ``restart`` record listing them when it starts.  A change so
    ended, or one whose expiry has passed, is no longer reversible
    (reversible_now); rolling back the reload is what brings such
    conditions back.

STRATEGIES
    Several writers.  `sluice serve` keeps the history in memory, and the
    CLI appends to the same file from other processes.  Every append takes
    an exclusive lock on the file (flock), first reads what others
    appended since (so ids stay unique and increasing), then writes,
    flushes and fsyncs before the change is reported done.  Readers pick
    up other processes' lines on their next look (a stat, then only the
    new bytes).

    A torn last line (a crash in the middle of a write) is skipped when
    read, and the next record starts on a fresh line.

INVARIANTS
    Records are never rewritten: "rolled back" and "ended" are derived
    from later records.  A change is rolled back at most once.

LIMITATIONS
    The file is read into memory at start and grows by one line per
    operator change (a few hundred bytes); move it away to start afresh.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sluice._fdio import write_all
from sluice.model import Selector
from sluice.store import Action

if TYPE_CHECKING:
    from sluice.config import Config

__all__ = ["MAX_QIDS", "AuditAction", "AuditLog", "AuditRecord", "audit_path",
           "describe_selector", "selector_data"]

log = logging.getLogger("sluice.api.audit")

#: Touched queue ids kept in the record of a queue action.
MAX_QIDS = 1000


class AuditAction(StrEnum):
    """The kinds of change the audit history records, as its ``action`` names them."""
    SUSPENSION_ADD = "suspension.add"
    SUSPENSION_REMOVE = "suspension.remove"
    CONDITION_ADD = "condition.add"
    CONDITION_REMOVE = "condition.remove"
    POLICY_RELOAD = "policy.reload"
    ROLLBACK = "rollback"
    RESTART = "restart"
    QUEUE_HOLD = "queue.hold"
    QUEUE_RELEASE = "queue.release"
    QUEUE_RETRY = "queue.retry"
    QUEUE_DELETE = "queue.delete"
    QUEUE_PRIORITY = "queue.priority"
    QUEUE_BOUNCE = "queue.bounce"
    SHAPING_FIRE = "shaping.fire"  # an automatic action began (sluice.shaping)
    SHAPING_END = "shaping.end"
    SHAPING_BOUNCE = "shaping.bounce"
    SHAPING_RELOAD = "shaping.reload"


#: The record of each queue action.
AUDIT_OF_ACTION = {
    Action.HOLD: AuditAction.QUEUE_HOLD,
    Action.RELEASE: AuditAction.QUEUE_RELEASE,
    Action.RETRY: AuditAction.QUEUE_RETRY,
    Action.DELETE: AuditAction.QUEUE_DELETE,
    Action.PRIORITY: AuditAction.QUEUE_PRIORITY,
    Action.BOUNCE: AuditAction.QUEUE_BOUNCE,
}

#: Changes a policy reload or a restart ends (they live in the scheduler's memory).
_RUNTIME_CONDITION_CHANGES = (AuditAction.CONDITION_ADD, AuditAction.CONDITION_REMOVE)
_POLICY_LOADS = (AuditAction.POLICY_RELOAD, AuditAction.RESTART)


def audit_path(config: Config) -> str:
    """Where the history is kept: api.audit_path, else beside the queue."""
    return config.api.audit_path or str(Path(config.queue.path) / "api-audit.jsonl")


@dataclass(frozen=True, slots=True)
class AuditRecord:
    """One change in the audit history: when, who, what, why, and the state before and after."""
    id: int
    at: float
    who: str
    action: str
    target: str
    reason: str
    before: Any
    after: Any
    reversible: bool
    rollback_of: int | None = None
    #: Earlier changes this one ended (a reload or restart: run-time conditions).
    ends: tuple[int, ...] = field(default=())

    def to_data(self) -> dict[str, Any]:
        """The record as plain data, as the history file keeps it."""
        data = asdict(self)
        data["ends"] = list(self.ends)
        return data

    @property
    def expires_at(self) -> float | None:
        """When the change added would have ended by itself (suspensions, conditions)."""
        after = self.after if isinstance(self.after, dict) else {}
        if self.action == AuditAction.SUSPENSION_ADD:
            value = after.get("expires_at")
        elif self.action == AuditAction.CONDITION_ADD:
            cond = after.get("condition")
            value = cond.get("expires_at") if isinstance(cond, dict) else None
        else:
            return None
        return float(value) if isinstance(value, int | float) else None


def _parse(line: bytes) -> AuditRecord:
    raw = json.loads(line)
    return AuditRecord(
        id=int(raw["id"]), at=float(raw["at"]), who=str(raw["who"]),
        action=str(raw["action"]), target=str(raw["target"]),
        reason=str(raw["reason"]), before=raw.get("before"),
        after=raw.get("after"), reversible=bool(raw["reversible"]),
        rollback_of=(None if raw.get("rollback_of") is None else int(raw["rollback_of"])),
        ends=tuple(int(i) for i in raw.get("ends") or ()))


def selector_data(selector: Selector, all_: bool) -> dict[str, Any]:
    """A selector as an audit record keeps it."""
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


def describe_selector(selector: Selector) -> str:
    """A selector in a few words: the target of a queue action's record."""
    data = selector_data(selector, False)
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


class AuditLog:
    """The history in memory, mirrored to a JSON-lines file several processes append to."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._records: list[AuditRecord] = []
        self._by_id: dict[int, AuditRecord] = {}
        self._undone: dict[int, int] = {}  # change id -> id of the rollback
        self._ended: dict[int, int] = {}  # change id -> id of the record that ended it
        self._file: tuple[int, int] | None = None  # (device, inode) read so far
        self._offset = 0  # bytes of complete lines read
        self._bad = 0
        with self._lock:
            self._refresh()
        if self._bad:
            log.warning("%s: skipped %d unreadable audit lines", self.path, self._bad)

    # -- reading ---------------------------------------------------------------------

    def _refresh(self) -> None:
        """Read what was appended since the last look (by any process).  Locked."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return
        ident = (st.st_dev, st.st_ino)
        if ident != self._file or st.st_size < self._offset:
            # A new file (moved away to start afresh): read it from the start.
            self._records, self._by_id, self._undone, self._ended = [], {}, {}, {}
            self._file, self._offset = ident, 0
        if st.st_size == self._offset:
            return
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read(st.st_size - self._offset)
        end = data.rfind(b"\n") + 1  # a line still being written waits for its end
        for line in data[:end].splitlines():
            if not line.strip():
                continue
            try:
                record = _parse(line)
            except (ValueError, KeyError, TypeError):
                self._bad += 1
                continue
            if record.id in self._by_id:
                continue
            self._remember(record)
        self._offset += end

    def _remember(self, record: AuditRecord) -> None:
        self._records.append(record)
        self._by_id[record.id] = record
        if record.rollback_of is not None:
            self._undone.setdefault(record.rollback_of, record.id)
        for ended in record.ends:
            self._ended.setdefault(ended, record.id)

    def __len__(self) -> int:
        with self._lock:
            self._refresh()
            return len(self._records)

    def __iter__(self) -> Iterator[AuditRecord]:
        with self._lock:
            self._refresh()
            return iter(list(self._records))

    def get(self, record_id: int) -> AuditRecord | None:
        """The record with id ``record_id``, the file read again first; None if there is none."""
        with self._lock:
            self._refresh()
            return self._by_id.get(record_id)

    def rolled_back_by(self, record_id: int) -> int | None:
        """The id of the record that rolled ``record_id`` back, if one did."""
        with self._lock:
            return self._undone.get(record_id)

    def ended_by(self, record_id: int) -> int | None:
        """The reload or restart that ended a run-time condition change, if one did."""
        with self._lock:
            return self._ended.get(record_id)

    def reversible_now(self, record: AuditRecord, now: float) -> bool:
        """Whether a rollback could still apply.

        The kind of change allows it, nothing ended it and it has not expired
        by itself.
        """
        if not record.reversible or self.ended_by(record.id) is not None:
            return False
        expires = record.expires_at
        return expires is None or expires > now

    def page(self, limit: int, before: int | None = None) -> tuple[list[AuditRecord], int | None]:
        """Up to ``limit`` records older than id ``before`` (None: the newest), newest first.

        Also the cursor for the next page (None: no more).
        """
        with self._lock:
            self._refresh()
            records = self._records
            # Ids grow with the position in the file, so a bisection finds the start.
            lo, hi = 0, len(records)
            if before is not None:
                while lo < hi:
                    mid = (lo + hi) // 2
                    if records[mid].id < before:
                        lo = mid + 1
                    else:
                        hi = mid
                end = lo
            else:
                end = len(records)
            start = max(0, end - limit)
            out = records[start:end][::-1]
        return out, (out[-1].id if start > 0 and out else None)

    def _open_condition_changes(self) -> list[int]:
        """Condition changes since the policy was last loaded, not yet undone.  Locked."""
        out: list[int] = []
        for record in reversed(self._records):
            if record.action in _POLICY_LOADS:
                break
            if (record.action in _RUNTIME_CONDITION_CHANGES and record.id not in self._undone
                    and record.id not in self._ended):
                out.append(record.id)
        return out[::-1]

    # -- writing ---------------------------------------------------------------------

    def append(self, who: str, action: AuditAction, target: str, reason: str, before: Any,
               after: Any, *, reversible: bool, now: float,
               rollback_of: int | None = None, ends: Sequence[int] | None = None
               ) -> AuditRecord:
        """Write one record durably; returns it with its id.  Blocks (lock, fsync).

        A policy reload ends the run-time condition changes made since the
        policy was last loaded, unless ``ends`` says otherwise.
        """
        with self._lock:
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                self._refresh()
                if ends is None:
                    ends = self._open_condition_changes() if action in _POLICY_LOADS else ()
                last = self._records[-1].id if self._records else 0
                record = AuditRecord(last + 1, now, who, str(action), target, reason, before,
                                     after, reversible, rollback_of, tuple(ends))
                line = json.dumps(record.to_data(), separators=(",", ":"), ensure_ascii=False,
                                  default=str)
                size = os.fstat(fd).st_size
                torn = size > 0 and os.pread(fd, 1, size - 1) != b"\n"
                data = (("\n" if torn else "") + line + "\n").encode("utf-8")
                write_all(fd, data)
                os.fsync(fd)
                self._remember(record)
                self._offset = size + len(data)
                return record
            finally:
                os.close(fd)  # and with it the lock

    def queue_action(self, who: str, action: Action, selector: Selector, *, all_: bool,
                     reason: str, qids: Sequence[str], priority: int | None, now: float
                     ) -> AuditRecord:
        """The record of an operator action on the queue (final: not reversible)."""
        after: dict[str, Any] = {"count": len(qids), "qids": list(qids[:MAX_QIDS]),
                                 "selector": selector_data(selector, all_)}
        if priority is not None:
            after["priority"] = priority
        return self.append(who, AUDIT_OF_ACTION[action], describe_selector(selector), reason,
                           None, after, reversible=False, now=now)

    def restarted(self, now: float, who: str = "sluice serve") -> AuditRecord | None:
        """At start: record that the run-time condition changes of the last run are gone.

        None when there were none.
        """
        with self._lock:
            self._refresh()
            open_changes = self._open_condition_changes()
        if not open_changes:
            return None
        targets = [self._by_id[i].target for i in open_changes]
        return self.append(who, AuditAction.RESTART, "run-time conditions",
                           "a restart loads the policy file; conditions added or removed at "
                           "run time are gone", {"conditions": targets}, None,
                           reversible=False, now=now, ends=open_changes)
