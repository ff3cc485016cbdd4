"""The suppression list: recipients Sluice no longer sends to.

SUMMARY
    SuppressionList.load(path) -> SuppressionList
    SuppressionList.lookup(address) -> SuppressionEntry | None
    SuppressionEntry.reply() -> Reply(550, "5.1.1", ...)
    write_suppression_list(path, entries, generated_at=...) -> int
    merge_entries(old, new, delivered_at, now) -> list[SuppressionEntry]

DESCRIPTION
    ``sluice analytics suppress`` finds recipients that hard-bounced, or
    soft-bounced N times in a row within D days, and writes them to the
    file named by ``suppression.path``.  The SMTP server and the queue read
    that file through this module, which is plain Python (no Spark, no
    I/O beyond the one file) so that the MTA needs no JVM.

    How the receiving side uses it (``suppression.mode``)::

        suppressed = SuppressionList.load(cfg.suppression.path)   # at start
        mode = SuppressionMode(cfg.suppression.mode)
        ...
        entry = suppressed.lookup(rcpt)          # at RCPT TO, cheap
        if entry is not None and mode is SuppressionMode.REJECT:
            return entry.reply()                 # 550 5.1.1 <rcpt>: suppressed ...
        # mode DROP: accept the RCPT, leave the recipient out of the queued
        # message, and write make_event(EventKind.SUPPRESSED, ...,
        # reply=entry.reply()) to the accounting log.

    lookup() notices a new file by itself (see Strategies); refresh()
    forces a look.

FILE FORMAT
    UTF-8 JSON lines.  The first line is a header::

        {"format": "sluice-suppression", "version": 1,
         "generated_at": "2026-11-22T10:00:00.000Z", "entries": 2}

    then one object per entry::

        {"address": "bob@example.com", "reason": "hard",
         "category": "bad-mailbox", "code": 550, "enhanced": "5.1.1",
         "response": "user unknown", "first_at": "2026-11-20T08:00:00.000Z",
         "last_at": "2026-11-21T09:30:00.000Z", "count": 2, "expires_at": null}

    Only ``address`` is required; an address ``@example.com`` suppresses a
    whole domain.  Blank lines and lines starting with ``#`` are ignored,
    so an operator can add entries by hand (reason ``manual``; drop the
    header's ``entries`` count or keep it right).

STRATEGIES
    Atomic replacement.  The writer writes a temporary file in the same
    directory, fsyncs it, renames it over the list and fsyncs the
    directory: a reader sees the old list or the new one, never half.

    Cheap change detection.  lookup() stats the file at most once per
    ``recheck_s`` (default 1 s) and reloads when its inode, size or
    mtime changed.  A list that fails to parse on reload is not used: the
    previous one stays in force and ``last_error`` says why -- a bad file
    must not turn off suppression, nor stop the SMTP server.

INVARIANTS
    Addresses are kept in normal form (angle brackets and space removed,
    lower case) and lookups normalise the same way.  Local parts are
    case-sensitive in RFC 5321, but no mailbox provider treats them so,
    and a list that misses Bob@ because it holds bob@ would be worse.

LIMITATIONS
    The whole list is held in memory: about 200 bytes per entry.

SEE ALSO
    sluice.pipeline.suppress (the writer's job), sluice.accounting
    (EventKind.SUPPRESSED), docs/analytics.md
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Any

from sluice.accounting import EventKind, iso_time, make_event
from sluice.model import QueueEntry, QueueState, Reply, recipient_domain

__all__ = [
    "FORMAT",
    "VERSION",
    "SuppressionEntry",
    "SuppressionFileError",
    "SuppressionList",
    "SuppressionMode",
    "SuppressionReason",
    "merge_entries",
    "normalise_address",
    "read_suppression_file",
    "suppressed_event",
    "write_suppression_list",
]

FORMAT = "sluice-suppression"
VERSION = 1


class SuppressionReason(StrEnum):
    """Why an address is on the suppression list."""
    HARD = "hard"  # a permanent failure that says the address is bad
    SOFT = "soft"  # N soft failures in a row within D days
    MANUAL = "manual"  # put there by an operator; the pipeline keeps it


class SuppressionMode(StrEnum):
    """What the SMTP server does with a suppressed recipient."""
    REJECT = "reject"  # 550 5.1.1 at RCPT TO
    DROP = "drop"  # accept, leave the recipient out, log it


class SuppressionFileError(Exception):
    """A suppression file cannot be used; str() names the file and line."""

    def __init__(self, path: str | os.PathLike[str], line: int, message: str) -> None:
        self.path = str(path)
        self.line = line
        self.message = message
        where = f"{self.path}:{line}" if line else self.path
        super().__init__(f"{where}: {message}")


def normalise_address(address: str) -> str:
    """'<Bob@Example.COM.>' -> 'bob@example.com'; '@Example.com' stays a domain."""
    text = address.strip()
    if text.startswith("<") and text.endswith(">"):
        text = text[1:-1].strip()
    return text.rstrip(".").lower()


def _time_text(at: float | None) -> str | None:
    return None if at is None else iso_time(at)


def _time_value(value: object, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a time, not {value!r}")
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            at = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            raise ValueError(f"{what}: {value!r} is not an ISO 8601 time") from None
        if at.tzinfo is None:
            at = at.replace(tzinfo=UTC)
        return at.timestamp()
    raise ValueError(f"{what} must be a time, not {value!r}")


@dataclass(frozen=True, slots=True)
class SuppressionEntry:
    """One suppressed address (or ``@domain``) and why."""

    address: str
    reason: SuppressionReason = SuppressionReason.MANUAL
    category: str = ""
    code: int | None = None
    enhanced: str = ""
    response: str = ""
    first_at: float | None = None
    last_at: float | None = None
    count: int = 1
    expires_at: float | None = None

    def __post_init__(self) -> None:
        address = normalise_address(self.address)
        if not address or (address.startswith("@") and len(address) == 1):
            raise ValueError("an entry needs an address or @domain")
        if "@" not in address:
            raise ValueError(f"{self.address!r} is neither an address nor @domain")
        object.__setattr__(self, "address", address)
        object.__setattr__(self, "reason", SuppressionReason(self.reason))
        if self.count < 1:
            raise ValueError("count must be at least 1")

    @property
    def is_domain(self) -> bool:
        """Whether the entry lists a whole domain (``@example.com``)."""
        return self.address.startswith("@")

    def is_expired(self, now: float) -> bool:
        """Whether the entry has an expiry time and it has passed at ``now``."""
        return self.expires_at is not None and self.expires_at <= now

    def reply(self, address: str | None = None) -> Reply:
        """What to answer at RCPT TO: 550 5.1.1 with the reason, for people."""
        who = normalise_address(address) if address else self.address
        why = {
            SuppressionReason.HARD: "it bounced permanently",
            SuppressionReason.SOFT: "it failed repeatedly",
            SuppressionReason.MANUAL: "the operator listed it",
        }[self.reason]
        detail = f" ({self.category})" if self.category else ""
        since = ""
        if self.last_at is not None:
            since = " on " + datetime.fromtimestamp(self.last_at, UTC).strftime("%Y-%m-%d")
        return Reply(
            550,
            "5.1.1",
            f"<{who}>: recipient address suppressed: {why}{detail}{since}",
        )

    def to_json(self) -> dict[str, Any]:
        """The entry as JSON, its times as ISO 8601 text."""
        return {
            "address": self.address,
            "reason": str(self.reason),
            "category": self.category,
            "code": self.code,
            "enhanced": self.enhanced,
            "response": self.response,
            "first_at": _time_text(self.first_at),
            "last_at": _time_text(self.last_at),
            "count": self.count,
            "expires_at": _time_text(self.expires_at),
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> SuppressionEntry:
        """Raises ValueError naming the bad key."""
        address = obj.get("address")
        if not isinstance(address, str):
            raise ValueError("'address' must be a string")
        try:
            reason = SuppressionReason(obj.get("reason") or "manual")
        except ValueError:
            allowed = ", ".join(r.value for r in SuppressionReason)
            raise ValueError(f"'reason' must be one of {allowed}") from None
        code = obj.get("code")
        if code is not None and (isinstance(code, bool) or not isinstance(code, int)):
            raise ValueError("'code' must be an integer or null")
        count = obj.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int):
            raise ValueError("'count' must be an integer")
        texts = {}
        for key in ("category", "enhanced", "response"):
            value = obj.get(key) or ""
            if not isinstance(value, str):
                raise ValueError(f"'{key}' must be a string")
            texts[key] = value
        return cls(
            address=address,
            reason=reason,
            code=code,
            count=count,
            first_at=_time_value(obj.get("first_at"), "'first_at'"),
            last_at=_time_value(obj.get("last_at"), "'last_at'"),
            expires_at=_time_value(obj.get("expires_at"), "'expires_at'"),
            **texts,
        )


def read_suppression_file(
    path: str | os.PathLike[str],
) -> tuple[dict[str, Any], list[SuppressionEntry]]:
    """(header, entries) of a suppression file.  Raises SuppressionFileError."""
    header: dict[str, Any] = {}
    entries: list[SuppressionEntry] = []
    try:
        with open(path, encoding="utf-8") as fh:
            for number, line in enumerate(fh, 1):
                text = line.strip()
                if not text or text.startswith("#"):
                    continue
                try:
                    obj = json.loads(text)
                except json.JSONDecodeError as exc:
                    raise SuppressionFileError(path, number, f"not JSON: {exc.msg}") from None
                if not isinstance(obj, dict):
                    raise SuppressionFileError(path, number, "each line must be a JSON object")
                if "format" in obj:
                    if obj.get("format") != FORMAT or obj.get("version") != VERSION:
                        raise SuppressionFileError(
                            path, number, f"not a {FORMAT} version {VERSION} file"
                        )
                    header = obj
                    continue
                try:
                    entries.append(SuppressionEntry.from_json(obj))
                except ValueError as exc:
                    raise SuppressionFileError(path, number, str(exc)) from None
    except UnicodeDecodeError:
        raise SuppressionFileError(path, 0, "not UTF-8 text") from None
    except OSError as exc:
        raise SuppressionFileError(path, 0, exc.strerror or str(exc)) from None
    expected = header.get("entries")
    if isinstance(expected, int) and expected != len(entries):
        raise SuppressionFileError(
            path, 0, f"header says {expected} entries, the file has {len(entries)} (truncated?)"
        )
    return header, entries


def write_suppression_list(
    path: str | os.PathLike[str],
    entries: Iterable[SuppressionEntry],
    *,
    generated_at: float | None = None,
) -> int:
    """Replace the file at ``path`` atomically; returns the number of entries."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    rows = sorted(entries, key=lambda e: e.address)
    header = {
        "format": FORMAT,
        "version": VERSION,
        "generated_at": iso_time(time.time() if generated_at is None else generated_at),
        "entries": len(rows),
    }
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(json.dumps(header, separators=(",", ":")) + "\n")
            for entry in rows:
                fh.write(json.dumps(entry.to_json(), separators=(",", ":"),
                                    ensure_ascii=False) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return len(rows)


def merge_entries(
    old: Iterable[SuppressionEntry],
    new: Iterable[SuppressionEntry],
    delivered_at: Mapping[str, float],
    now: float,
) -> list[SuppressionEntry]:
    """The list after a pipeline run.

    - old entries that expired by ``now`` go;
    - old hard/soft entries go when the address was delivered to after the
      entry's last failure (an operator let mail through and it worked);
    - manual entries stay, whatever happens;
    - a new entry for a listed address updates it: the earlier first_at,
      the later facts, and hard is never weakened to soft.
    """
    merged: dict[str, SuppressionEntry] = {}
    for entry in old:
        if entry.is_expired(now):
            continue
        if entry.reason is not SuppressionReason.MANUAL:
            ok_at = delivered_at.get(entry.address)
            if ok_at is not None and (entry.last_at is None or ok_at > entry.last_at):
                continue
        merged[entry.address] = entry
    for entry in new:
        if entry.is_expired(now):
            continue
        before = merged.get(entry.address)
        if before is None:
            merged[entry.address] = entry
            continue
        if before.reason is SuppressionReason.MANUAL:
            continue
        firsts = [t for t in (before.first_at, entry.first_at) if t is not None]
        updated = replace(entry, first_at=min(firsts) if firsts else None)
        if before.reason is SuppressionReason.HARD and entry.reason is SuppressionReason.SOFT:
            updated = replace(before, last_at=entry.last_at or before.last_at)
        merged[entry.address] = updated
    return sorted(merged.values(), key=lambda e: e.address)


class SuppressionList:
    """The suppressed addresses, reloaded when their file changes."""

    def __init__(
        self,
        entries: Iterable[SuppressionEntry] = (),
        *,
        path: str | os.PathLike[str] | None = None,
        recheck_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = Path(path) if path is not None else None
        self.recheck_s = recheck_s
        self.last_error: str | None = None
        self.generated_at: float | None = None
        self._clock = clock
        self._entries: dict[str, SuppressionEntry] = {e.address: e for e in entries}
        self._stat_key: tuple[int, int, int] | None = None
        self._checked_at = clock()
        self._lock = threading.Lock()

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str] | None,
        *,
        recheck_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> SuppressionList:
        """The list in ``path``; empty while the file does not exist yet.

        None gives an empty list that never reloads (suppression off).
        A file that exists but cannot be used raises SuppressionFileError:
        at start an operator must hear about it.
        """
        out = cls(path=path, recheck_s=recheck_s, clock=clock)
        if path is not None:
            out._reload(strict=True)
        return out

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[SuppressionEntry]:
        return iter(list(self._entries.values()))

    def __contains__(self, address: object) -> bool:
        return isinstance(address, str) and self.lookup(address) is not None

    def lookup(self, address: str, now: float | None = None) -> SuppressionEntry | None:
        """The entry that suppresses ``address`` (itself, then its @domain)."""
        if self.path is not None and self._clock() - self._checked_at >= self.recheck_s:
            self.refresh()
        entries = self._entries  # one reference: a reload swaps the dict whole
        key = normalise_address(address)
        entry = entries.get(key)
        if entry is None:
            domain = recipient_domain(key)
            entry = entries.get("@" + domain) if domain else None
        if entry is None:
            return None
        if entry.expires_at is not None and entry.is_expired(time.time() if now is None else now):
            return None
        return entry

    def refresh(self) -> bool:
        """Reload if the file changed; True when a new list is in force."""
        if self.path is None:
            return False
        return self._reload(strict=False)

    def _stat(self) -> tuple[int, int, int] | None:
        assert self.path is not None
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def _reload(self, strict: bool) -> bool:
        with self._lock:
            self._checked_at = self._clock()
            key = self._stat()
            if key == self._stat_key:
                return False
            if key is None:  # removed: suppression off until it comes back
                self._entries = {}
                self._stat_key = None
                self.generated_at = None
                self.last_error = None
                return True
            assert self.path is not None
            try:
                header, entries = read_suppression_file(self.path)
            except SuppressionFileError as exc:
                if strict:
                    raise
                self.last_error = str(exc)
                # Do not retry the same broken file on every lookup.
                self._stat_key = key
                return False
            self._entries = {e.address: e for e in entries}
            self._stat_key = key
            self.last_error = None
            try:
                self.generated_at = _time_value(header.get("generated_at"), "generated_at")
            except ValueError:
                self.generated_at = None
            return True


def suppressed_event(address: str, sender: str, entry: SuppressionEntry, now: float, *,
                     node: str = "", spid: str = "", size: int = 0) -> dict[str, Any]:
    """The accounting line of one suppressed recipient (refused or dropped).

    No queue entry exists for it, so ``qid`` is null, and ``spid`` is the
    message's when the rest of its recipients were queued.
    """
    row = QueueEntry(spid=spid, idx=0, sender=sender, recipient=address,
                     state=QueueState.INCOMING, arrival_at=now, next_attempt_at=now, size=size)
    event = make_event(EventKind.SUPPRESSED, row, now, node=node, reply=entry.reply(address),
                       attempt=0)
    event["qid"] = None
    event["spid"] = spid or None
    return event
