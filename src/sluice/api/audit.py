"""The audit history: every change made through the API, and how to undo it.

SUMMARY
    log = AuditLog(path); record = log.append(who, action, target, reason,
    before, after, reversible, now=...); log.get(id); log.page(limit,
    before); log.rolled_back_by(id)

DESCRIPTION
    One JSON line per change, appended to ``api.audit_path`` (by default
    ``<queue.path>/api-audit.jsonl``): id, time, who (the name of the
    token), what (AuditAction), the target, the reason the caller gave,
    and the state before and after as plain data.  Policy changes carry
    enough ``before`` to be rolled back (sluice.api.control does it); a
    rollback is itself a record, with ``rollback_of`` naming the change it
    undid.  None of the specification's systems keeps such a history.

STRATEGIES
    Append, flush and fsync before the API answers, so a change the caller
    saw acknowledged is in the history even after a crash.  Ids count up
    from the last one in the file.  A torn last line (a crash in the
    middle of a write) is skipped when the file is read, and the next
    record starts on a fresh line.

INVARIANTS
    Records are never rewritten: "rolled back" is derived from later
    records.  A change is rolled back at most once.

LIMITATIONS
    The file is read into memory at start and grows by one line per
    operator change (a few hundred bytes); move it away to start afresh.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

__all__ = ["AuditAction", "AuditLog", "AuditRecord"]

log = logging.getLogger("sluice.api.audit")


class AuditAction(StrEnum):
    SUSPENSION_ADD = "suspension.add"
    SUSPENSION_REMOVE = "suspension.remove"
    CONDITION_ADD = "condition.add"
    CONDITION_REMOVE = "condition.remove"
    POLICY_RELOAD = "policy.reload"
    ROLLBACK = "rollback"
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


@dataclass(frozen=True, slots=True)
class AuditRecord:
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

    def to_data(self) -> dict[str, Any]:
        return asdict(self)


class AuditLog:
    """The history in memory, mirrored to a JSON-lines file."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._records: list[AuditRecord] = []
        self._by_id: dict[int, AuditRecord] = {}
        self._undone: dict[int, int] = {}  # change id -> id of the rollback
        self._torn = False
        self._load()

    def _load(self) -> None:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return
        self._torn = bool(data) and not data.endswith(b"\n")
        bad = 0
        for line in data.splitlines():
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
                record = AuditRecord(
                    id=int(raw["id"]), at=float(raw["at"]), who=str(raw["who"]),
                    action=str(raw["action"]), target=str(raw["target"]),
                    reason=str(raw["reason"]), before=raw.get("before"),
                    after=raw.get("after"), reversible=bool(raw["reversible"]),
                    rollback_of=(None if raw.get("rollback_of") is None
                                 else int(raw["rollback_of"])))
            except (ValueError, KeyError, TypeError):
                bad += 1
                continue
            self._remember(record)
        if bad:
            log.warning("%s: skipped %d unreadable audit lines", self.path, bad)

    def _remember(self, record: AuditRecord) -> None:
        self._records.append(record)
        self._by_id[record.id] = record
        if record.rollback_of is not None:
            self._undone.setdefault(record.rollback_of, record.id)

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[AuditRecord]:
        return iter(list(self._records))

    def append(self, who: str, action: AuditAction, target: str, reason: str, before: Any,
               after: Any, *, reversible: bool, now: float,
               rollback_of: int | None = None) -> AuditRecord:
        """Write one record durably; returns it with its id.  Blocks (fsync)."""
        with self._lock:
            last = self._records[-1].id if self._records else 0
            record = AuditRecord(last + 1, now, who, str(action), target, reason, before, after,
                                 reversible, rollback_of)
            line = json.dumps(record.to_data(), separators=(",", ":"), ensure_ascii=False,
                              default=str)
            data = (("\n" if self._torn else "") + line + "\n").encode("utf-8")
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            self._torn = False
            self._remember(record)
            return record

    def get(self, record_id: int) -> AuditRecord | None:
        return self._by_id.get(record_id)

    def rolled_back_by(self, record_id: int) -> int | None:
        return self._undone.get(record_id)

    def page(self, limit: int, before: int | None = None) -> tuple[list[AuditRecord], int | None]:
        """Up to ``limit`` records older than id ``before`` (None: the newest),
        newest first, and the cursor for the next page (None: no more)."""
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
