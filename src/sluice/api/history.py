"""One message's history, read from the accounting log.

SUMMARY
    message_history(log_dir, spid, since_at, max_bytes) -> History

DESCRIPTION
    Every transition of every recipient is a line of the accounting log
    (sluice.accounting), so a message's history is the lines whose
    ``spid`` is its SPID.  The files are named by the UTC hour (or day)
    of their lines, so only the files from the message's arrival on --
    the SPID's first 11 hex digits are its arrival in milliseconds -- are
    read, oldest first.

STRATEGIES
    Search, then parse.  Each file is memory-mapped and searched for the
    exact bytes ``"spid":"<SPID>"`` (every writer serialises lines the
    same way, compactly), so the scan runs at memory speed and only the
    matching lines are parsed as JSON.

    Bounded.  A request reads at most ``max_bytes`` of files (the
    api.history_max_bytes setting) and at most MAX_EVENTS lines; beyond
    that the answer says it is truncated.  The cost grows with the log
    written since the message arrived, never with the whole log.

LIMITATIONS
    Lines are written after each change commits (a delivery's before:
    sluice.queue) and are not fsynced one by one, so a power cut can lose
    the last few.  A message older than
    accounting.keep has lost the start of its history with the files.
"""

from __future__ import annotations

import json
import mmap
import os
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

__all__ = ["MAX_EVENTS", "History", "message_history", "spid_arrival_at"]

#: The most lines one history holds.
MAX_EVENTS = 10_000

_NAME_RE = re.compile(r"^sluice-acct-(\d{8})(?:T(\d{2}))?\.jsonl$")


@dataclass(slots=True)
class History:
    """The accounting lines of one message, and how much of the log was read for them."""
    events: list[dict[str, Any]] = field(default_factory=list)
    files: int = 0
    bytes_scanned: int = 0
    truncated: bool = False


def spid_arrival_at(spid: str) -> float | None:
    """The arrival time a SPID carries (its first 11 hex digits: milliseconds)."""
    if len(spid) != 16:
        return None
    try:
        return int(spid[:11], 16) / 1000.0
    except ValueError:
        return None


def _period_end_at(name: str) -> float | None:
    """When the period of an accounting file ends (None: not one of ours)."""
    m = _NAME_RE.match(name)
    if m is None:
        return None
    day = datetime.strptime(m.group(1), "%Y%m%d").replace(tzinfo=UTC).timestamp()
    if m.group(2) is None:
        return day + 86400.0
    return day + (int(m.group(2)) + 1) * 3600.0


def message_history(log_dir: str | os.PathLike[str], spid: str, since_at: float | None,
                    max_bytes: int) -> History:
    """Every accounting line of message ``spid`` in files from ``since_at`` on."""
    out = History()
    base = Path(log_dir)
    try:
        names = sorted(n for n in os.listdir(base) if _NAME_RE.match(n))
    except FileNotFoundError:
        return out
    needle = b'"spid":"' + spid.encode("ascii") + b'"'
    for name in names:
        end_at = _period_end_at(name)
        if since_at is not None and end_at is not None and end_at <= since_at:
            continue
        path = base / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            continue  # removed by the accounting log's pruning meanwhile
        if out.bytes_scanned + size > max_bytes:
            out.truncated = True
            break
        out.files += 1
        out.bytes_scanned += size
        if size == 0:
            continue
        if not _scan(path, size, needle, spid, out):
            break
    return out


def _scan(path: Path, size: int, needle: bytes, spid: str, out: History) -> bool:
    """Append the matching lines of one file; False when MAX_EVENTS is reached."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as mm:
            pos = mm.find(needle)
            while pos >= 0:
                start = mm.rfind(b"\n", 0, pos) + 1
                end = mm.find(b"\n", pos)
                if end < 0:
                    break  # a line still being written: the next request sees it
                try:
                    event = json.loads(mm[start:end])
                except ValueError:
                    event = None
                if isinstance(event, dict) and event.get("spid") == spid:
                    if len(out.events) >= MAX_EVENTS:
                        out.truncated = True
                        return False
                    out.events.append(event)
                pos = mm.find(needle, end)
    except (OSError, ValueError):
        return True  # unreadable or vanished: the other files still count
    return True
