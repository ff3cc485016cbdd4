"""The accounting log: one JSON line per queue transition.

SUMMARY
    AccountingLog(path, rotate="hourly", node=...).record(events)
    make_event(kind, entry, now, **fields) -> dict

DESCRIPTION
    Every transition of a recipient entry -- received, deferred, delivered,
    bounced, expired, held, released, retried, deleted, ndr, discarded,
    duplicate (a resend not queued again) -- appends one line, and so does
    the end of every SMTP connection (``session``: who, TLS, AUTH, what was
    refused), so that the API process counts the receiving processes' work
    from the same lines (sluice.api.metrics).  The lines
    are the input of the Spark pipeline (sluice.pipeline), so their fields
    are a contract: see EVENT_FIELDS and docs/accounting.md.  Absent
    values are JSON null, never missing keys.

STRATEGIES
    Rotation by name.  Lines go to ``sluice-acct-YYYYMMDDTHH.jsonl`` (hourly)
    or ``sluice-acct-YYYYMMDD.jsonl`` (daily), in UTC, chosen at the time of
    the write.  Several processes can append to the same file without
    coordinating: the file is opened with O_APPEND and every batch is one
    write(2).  Files older than ``keep`` are removed when a new one opens.

LIMITATIONS
    Lines are written after the queue change is committed (a ``delivered``
    line before: sluice.queue, "A success is logged before the store has
    it") and are not fsynced one by one: a power cut can lose the last
    lines, never a message.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Any

import orjson

from sluice._fdio import write_all
from sluice.logs import publish
from sluice.model import ClientSession, QueueEntry, Reply

__all__ = [
    "EVENT_FIELDS",
    "SESSION_FIELDS",
    "AccountingLog",
    "EventKind",
    "iso_time",
    "make_event",
    "session_event",
]


class EventKind(StrEnum):
    """What happened to a recipient: the ``event`` of an accounting line."""
    RECEIVED = "received"
    DEFERRED = "deferred"
    DELIVERED = "delivered"
    BOUNCED = "bounced"  # permanent failure (5xx, null MX, operator bounce)
    EXPIRED = "expired"  # retry_maxtime passed
    HELD = "held"
    RELEASED = "released"
    RETRY = "retry"  # operator: retry now
    PRIORITY = "priority"
    DELETED = "deleted"
    NDR = "ndr"  # an NDR was queued for this failed recipient
    DISCARDED = "discarded"  # an expired NDR, or mail dropped by policy
    SUPPRESSED = "suppressed"  # refused or dropped by the suppression list
    RECOVERED = "recovered"  # returned to the queue after a restart
    DUPLICATE = "duplicate"  # a resend answered with the first queue id, not queued again
    SESSION = "session"  # an SMTP connection ended (not a recipient: qid and spid null)


#: The SMTP session's context, on ``received`` and ``session`` lines (else null).
SESSION_FIELDS: tuple[str, ...] = (
    "client_ip",  # the client's address
    "helo",  # what it said in EHLO/HELO (the last one: again after STARTTLS)
    "tls_protocol",  # e.g. TLSv1.3, or null without TLS
    "tls_cipher",  # e.g. TLS_AES_256_GCM_SHA384
    "auth_user",  # the AUTH user, or null
)


#: The contract with the pipeline: every line carries exactly these keys.
EVENT_FIELDS: tuple[str, ...] = (
    "time",  # ISO 8601 UTC with milliseconds, e.g. 2026-11-22T10:00:00.123Z
    "event",  # an EventKind value
    "node",  # node id that wrote the line
    "qid",  # SPID-index
    "spid",
    "sender",  # envelope sender, "" for the null sender
    "recipient",
    "domain",  # recipient domain, lower case
    "tenantid",
    "jobid",
    "transportid",
    "localip",  # source IP used for the attempt (or the entry's list, comma-joined)
    "remotemx",  # MX host name of the attempt
    "remoteip",  # IP address connected to
    "attempt",  # attempts so far, including this one
    "code",  # SMTP basic code (int) or null
    "enhanced",  # RFC 3463 code or null
    "response",  # reply text or null
    "queue_age_s",  # seconds since arrival
    "size",  # message size in bytes
    "duration_s",  # duration of the delivery attempt, or null
    "is_report",  # true for NDRs
    *SESSION_FIELDS,
    "refused",  # session: replies 4xx/5xx sent, {"550": 2, ...}; else null
    "auth_failures",  # session: failed AUTH attempts; else null
    "tls_failure",  # session: why the TLS handshake failed; else null
)


_compact = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
# A lone surrogate; chr() because mypyc compiles no surrogate in a literal.
_SURROGATE = re.compile("[" + chr(0xD800) + "-" + chr(0xDFFF) + "]")


def _encode(event: Mapping[str, Any]) -> bytes:
    """One line: UTF-8 JSON without spaces, keys in the dict's order.

    orjson writes the bytes the standard library's compact encoder would
    (ensure_ascii off, then UTF-8) in a fifteenth of its time: 0.7 against
    10.7 us for a delivered line, and every message makes two.  The same
    bytes for every line make_event and session_event build, whose floats
    are rounded to at most four decimals: below 1e-4 the two spell
    exponents differently (1e-05 against 1e-5), and orjson writes NaN as
    null.  What orjson refuses goes through the standard library: a string
    holding bytes that were not UTF-8 (the surrogate escapes of a client's
    HELO name; addresses that are not UTF-8 are refused at MAIL and RCPT),
    each written as U+FFFD, or a value past orjson's types (an int key).
    """
    try:
        return orjson.dumps(event)
    except TypeError:
        return _SURROGATE.sub("\ufffd", _compact(event)).encode("utf-8")


_second: tuple[int, str] = (-1, "")  # the last whole second formatted, and its text


def iso_time(at: float) -> str:
    """POSIX seconds as 2026-11-22T10:00:00.123Z."""
    # Every line carries a time; format the date part once per second.  The
    # cache is one tuple, replaced whole, so threads never see half of it.
    global _second
    whole = int(at // 1)
    ms = int((at - whole) * 1000)
    cached = _second
    if cached[0] != whole:
        cached = (whole, datetime.fromtimestamp(whole, UTC).strftime("%Y-%m-%dT%H:%M:%S."))
        _second = cached
    return f"{cached[1]}{ms:03d}Z"


def make_event(
    kind: EventKind | str,
    entry: QueueEntry,
    now: float,
    *,
    node: str = "",
    reply: Reply | None = None,
    attempt: int | None = None,
    localip: str | None = None,
    remotemx: str | None = None,
    remoteip: str | None = None,
    duration_s: float | None = None,
    client: ClientSession | None = None,
) -> dict[str, Any]:
    """One accounting line for ``entry``, with every key of EVENT_FIELDS.

    ``client``: the SMTP session a received message came in on.
    """
    return {
        "time": iso_time(now),
        "event": str(kind),
        "node": node,
        "qid": entry.qid,
        "spid": entry.spid,
        "sender": entry.sender,
        "recipient": entry.recipient,
        "domain": entry.domain,
        "tenantid": entry.tenantid,
        "jobid": entry.jobid,
        "transportid": entry.transportid,
        "localip": localip if localip is not None else ",".join(entry.localip),
        "remotemx": remotemx,
        "remoteip": remoteip,
        "attempt": entry.attempts if attempt is None else attempt,
        "code": reply.code if reply else None,
        "enhanced": (reply.enhanced or None) if reply else None,
        "response": reply.text if reply else None,
        "queue_age_s": round(max(0.0, now - entry.arrival_at), 3),
        "size": entry.size,
        "duration_s": None if duration_s is None else round(duration_s, 4),
        "is_report": entry.is_report,
        **_client_fields(client),
        "refused": None,
        "auth_failures": None,
        "tls_failure": None,
    }


def _client_fields(client: ClientSession | None) -> dict[str, Any]:
    if client is None:
        return dict.fromkeys(SESSION_FIELDS)
    return {"client_ip": client.client_ip, "helo": client.helo or None,
            "tls_protocol": client.tls_protocol, "tls_cipher": client.tls_cipher,
            "auth_user": client.auth_user}


def session_event(
    client: ClientSession,
    now: float,
    *,
    node: str = "",
    started_at: float | None = None,
    refused: Mapping[str, int] | None = None,
    auth_failures: int = 0,
    tls_failure: str | None = None,
) -> dict[str, Any]:
    """The line of an SMTP connection that ended, with every key of EVENT_FIELDS.

    Args:
        client: who it was and what the session had agreed (TLS, AUTH).
        now: when it ended.
        node: the node id.
        started_at: when it began (``duration_s``), if known.
        refused: replies 4xx/5xx sent, by basic code.
        auth_failures: failed AUTH attempts.
        tls_failure: why a TLS handshake failed, if one did.
    """
    event: dict[str, Any] = dict.fromkeys(EVENT_FIELDS)
    event.update(
        time=iso_time(now), event=str(EventKind.SESSION), node=node,
        duration_s=None if started_at is None else round(max(0.0, now - started_at), 4),
        is_report=False, refused=dict(refused or {}), auth_failures=auth_failures,
        tls_failure=tls_failure, **_client_fields(client))
    return event


class AccountingLog:
    """Appends accounting lines to time-rotated files under ``path``."""

    def __init__(self, path: str | os.PathLike[str], rotate: str = "hourly",
                 keep_s: float = 30 * 86400.0, node: str = "") -> None:
        if rotate not in ("hourly", "daily"):
            raise ValueError(f"rotate must be hourly or daily, not {rotate!r}")
        self.path = Path(path)
        self.rotate = rotate
        self.keep_s = keep_s
        self.node = node
        self._lock = threading.Lock()
        self._fd = -1
        self._name = ""
        self._span = (0.0, 0.0)  # [start, end) of the period self._name covers
        self.path.mkdir(parents=True, exist_ok=True)

    def filename(self, at: float) -> str:
        """The name of the file that holds lines written at ``at`` (hourly or daily)."""
        fmt = "%Y%m%dT%H" if self.rotate == "hourly" else "%Y%m%d"
        return f"sluice-acct-{datetime.fromtimestamp(at, UTC).strftime(fmt)}.jsonl"

    def _period(self, at: float) -> tuple[float, float]:
        length = 3600.0 if self.rotate == "hourly" else 86400.0
        start = at - at % length  # UTC periods: whole hours and days since the epoch
        return start, start + length

    def record(self, events: Iterable[Mapping[str, Any]], now: float | None = None) -> int:
        """Append ``events`` (dicts from make_event); returns how many."""
        lines: list[bytes] = []
        written = []
        for event in events:
            if self.node and not event.get("node"):
                event = {**event, "node": self.node}
            elif not isinstance(event, dict):
                event = dict(event)  # orjson encodes dicts, not other mappings
            written.append(event)
            lines.append(_encode(event))
        if not lines:
            return 0
        count = len(lines)
        lines.append(b"")  # the last line's end
        data = b"\n".join(lines)
        at = time.time() if now is None else now
        with self._lock:
            write_all(self._file_for(at), data)
        publish(written)  # the log lines and mail log (sluice.logs), once logging is set up
        return count

    def _file_for(self, at: float) -> int:
        start, end = self._span
        if self._fd >= 0 and start <= at < end:
            return self._fd  # the common case: no date formatting per record
        self._span = self._period(at)
        name = self.filename(at)
        if name != self._name or self._fd < 0:
            if self._fd >= 0:
                os.close(self._fd)
            self._fd = os.open(self.path / name,
                               os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640)
            self._name = name
            self._prune()
        return self._fd

    def _prune(self) -> None:
        # By the wall clock and modification time (not the event time, which
        # a test or a replay may set anywhere); never the file just opened.
        cutoff = time.time() - self.keep_s
        for old in self.path.glob("sluice-acct-*.jsonl"):
            if old.name == self._name:
                continue
            try:
                if old.stat().st_mtime < cutoff:
                    old.unlink()
            except FileNotFoundError:
                continue

    def files(self) -> list[Path]:
        """The accounting files under ``path``, oldest first."""
        return sorted(self.path.glob("sluice-acct-*.jsonl"))

    def close(self) -> None:
        """Close the file being appended to; the next write opens it again."""
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
                self._name = ""
