"""Logging for `sluice serve`: one line per event, text or JSON, and a mail log.

SUMMARY
    setup_logging(config.logging, level=None, hostname="")   once, at start-up
    publish(events)            accounting events -> log lines (+ mail log)
    maillog_line(event, host, pid) -> str | None   one Postfix-style line
    ready(message)             the start-up line, shown at every level

DESCRIPTION
    Every record goes to stderr through one handler on the root logger, so
    each event is written once.  ``logging.format`` picks the line: text
    (``time LEVEL logger: message``) or one JSON object (time, level,
    logger, message, and ``exc`` when an unexpected error carries one).
    ``logging.level`` is the level of every logger, ``logging.levels``
    overrides it by logger name (``sluice.smtpd: debug``).

    What happens to mail is told by the accounting events (sluice.
    accounting): the accounting log hands every batch it writes to
    publish(), which logs each delivery, deferral, bounce, expiry, NDR and
    operator action as one line on the ``sluice.mail`` logger -- INFO, and
    WARNING for failures -- and, when ``logging.maillog`` names a file,
    appends Postfix-style lines there (``sluice/smtp[pid]: QUEUEID:
    to=<...>, relay=..., delay=..., delays=a/b/c/d, dsn=..., status=...``)
    that pflogsumm (``--syslog-name=sluice``) and the analytics' maillog
    import read.  The queue id is the message's SPID.

LIMITATIONS
    The delays= parts are what the accounting event knows: time in queue
    before the attempt, 0 for connection set-up, and the attempt's whole
    duration as transmission.  The relay has no port (the event has none).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import IO, Any

from sluice._fdio import write_all
from sluice.config import LoggingConfig

__all__ = ["LOG_LEVEL_ENV", "JsonFormatter", "MailLog", "describe", "maillog_line", "publish",
           "ready", "setup_logging"]

#: How serve passes ``--log-level`` on to the receiving processes it spawns.
LOG_LEVEL_ENV = "SLUICE_LOG_LEVEL"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

mail_log = logging.getLogger("sluice.mail")
_ready_log = logging.getLogger("sluice.ready")
_maillog: MailLog | None = None
_enabled = False  # publish() is silent until setup_logging() (CLI tools log nothing)

#: Accounting events that report a failure, logged at WARNING.
_FAILURES = frozenset({"deferred", "bounced", "expired"})
#: Postfix's words for the outcome of an attempt.
_STATUS = {"delivered": "sent", "deferred": "deferred", "bounced": "bounced"}
_DSN = {"delivered": "2.0.0", "deferred": "4.0.0", "bounced": "5.0.0"}


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time (UTC, ISO 8601), level, logger, message."""

    def format(self, record: logging.LogRecord) -> str:
        """The record as one line of JSON, with its ``event`` and traceback if it has them."""
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        event = getattr(record, "event", None)
        if isinstance(event, Mapping):
            out["event"] = dict(event)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def setup_logging(config: LoggingConfig, level: str | None = None, *, hostname: str = "",
                  stream: IO[str] | None = None) -> logging.Handler:
    """Install the one stderr handler (replacing any), levels and the mail log."""
    global _maillog, _enabled
    if level:
        os.environ[LOG_LEVEL_ENV] = level  # for receiving processes spawned later
    else:
        os.environ.pop(LOG_LEVEL_ENV, None)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
        old.close()
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if config.format == "json"
                         else logging.Formatter(TEXT_FORMAT))
    root.addHandler(handler)
    root.setLevel(_level(level or config.level))
    # aiosmtpd logs every connection at INFO; that is a debugging aid.
    logging.getLogger("mail.log").setLevel(logging.WARNING)
    _ready_log.setLevel(logging.INFO)  # the start-up line shows at every level
    for name, value in config.levels.items():
        logging.getLogger(name).setLevel(_level(value))
    if _maillog is not None:
        _maillog.close()
    _maillog = MailLog(config.maillog, hostname) if config.maillog else None
    _enabled = True
    return handler


def ready(message: str) -> None:
    """The line that says the server is up (tests and operators wait for it)."""
    _ready_log.info("%s", message)


def _level(name: str) -> int:
    value = logging.getLevelName(name.upper())
    return value if isinstance(value, int) else logging.INFO


def publish(events: Iterable[Mapping[str, Any]]) -> None:
    """Log accounting events, one line each, and append them to the mail log."""
    if not _enabled:
        return
    info = mail_log.isEnabledFor(logging.INFO)
    warning = mail_log.isEnabledFor(logging.WARNING)
    maillog = _maillog
    if not warning and maillog is None:
        return
    lines: list[str] = []
    for event in events:
        kind = str(event.get("event"))
        if kind == "session":  # not mail: sluice.smtpd logged the connection's lines
            continue
        if info or (warning and kind in _FAILURES):
            level = logging.WARNING if kind in _FAILURES else logging.INFO
            mail_log.log(level, "%s", describe(event), extra={"event": event})
        if maillog is not None:
            line = maillog_line(event)
            if line is not None:
                lines.append(line)
    if maillog is not None and lines:
        maillog.write(lines)


def describe(event: Mapping[str, Any]) -> str:
    """An accounting event as one readable line."""
    kind = event.get("event")
    parts = [f"{kind} {event.get('qid')}", f"from=<{event.get('sender') or ''}>",
             f"to=<{event.get('recipient')}>"]
    if event.get("remotemx") or event.get("remoteip"):
        parts.append(f"relay={_relay(event)}")
    if event.get("attempt"):
        parts.append(f"attempt={event['attempt']}")
    if event.get("queue_age_s") is not None:
        parts.append(f"age={float(event['queue_age_s']):.1f}s")
    if event.get("tenantid"):
        parts.append(f"tenant={event['tenantid']}")
    reply = _reply(event)
    if reply:
        parts.append(f"({reply})")
    return " ".join(parts)


def _relay(event: Mapping[str, Any]) -> str:
    mx = event.get("remotemx") or event.get("remoteip") or "none"
    ip = event.get("remoteip")
    return f"{mx}[{ip}]" if ip else str(mx)


def _reply(event: Mapping[str, Any]) -> str:
    code, enhanced, text = event.get("code"), event.get("enhanced"), event.get("response")
    return " ".join(str(p) for p in (code, enhanced, text) if p not in (None, "")).replace(
        "\n", " ").replace("\r", " ")


def _stamp(event: Mapping[str, Any]) -> str:
    # Accounting times are ISO 8601 UTC; the mail log keeps RFC 3339 stamps
    # (as Postfix's postlogd with a modern syslog), which carry year and zone.
    text = str(event.get("time") or "")
    if text.endswith("Z"):
        return text[:-1] + "+00:00"
    return text or datetime.now(UTC).isoformat(timespec="milliseconds")


def maillog_line(event: Mapping[str, Any], host: str = "", pid: int | None = None) -> str | None:
    """The Postfix-style line for one accounting event.

    None if Postfix would write none for it.
    """
    kind = str(event.get("event"))
    qid = event.get("spid") or event.get("qid")
    head = f"{_stamp(event)} {host or event.get('node') or 'localhost'}"
    proc = os.getpid() if pid is None else pid
    if kind == "received":
        return (f"{head} sluice/qmgr[{proc}]: {qid}: from=<{event.get('sender') or ''}>, "
                f"size={event.get('size') or 0}, nrcpt=1 (queue active)")
    if kind in _STATUS:
        age = float(event.get("queue_age_s") or 0.0)
        took = float(event.get("duration_s") or 0.0)
        delays = f"0/{_secs(age - took)}/0/{_secs(took)}"
        dsn = event.get("enhanced") or _DSN[kind]
        reply = _reply(event)
        if event.get("remotemx") and event.get("code") is not None:
            why = f"host {_relay(event)} said: {reply}"
            if kind == "delivered":
                why = reply
        else:
            why = reply or kind
        service = "error" if kind == "bounced" and not event.get("remotemx") else "smtp"
        relay = _relay(event) if event.get("remotemx") or event.get("remoteip") else "none"
        return (f"{head} sluice/{service}[{proc}]: {qid}: to=<{event.get('recipient')}>, "
                f"relay={relay}, delay={_secs(age)}, delays={delays}, dsn={dsn}, "
                f"status={_STATUS[kind]} ({why})")
    if kind == "ndr":
        # Postfix names the notification's own queue id; the event has none.
        return f"{head} sluice/bounce[{proc}]: {qid}: sender non-delivery notification: -"
    if kind == "expired":
        return (f"{head} sluice/qmgr[{proc}]: {qid}: from=<{event.get('sender') or ''}>, "
                f"status=expired, returned to sender")
    return None


def _secs(value: float) -> str:
    # As Postfix writes them: at most two decimals, no exponent.
    return f"{max(0.0, value):.2f}".rstrip("0").rstrip(".") or "0"


class MailLog:
    """Appends lines to one file that several processes share.

    Each batch is one write(2) (O_APPEND); the file is reopened when
    logrotate moves it away.
    """

    def __init__(self, path: str, hostname: str = "") -> None:
        self.path = path
        self.hostname = hostname
        self._lock = threading.Lock()
        self._fd = -1
        self._ino = -1
        self._checked = 0.0

    def _open(self) -> int:
        now = time.monotonic()
        if self._fd >= 0 and now - self._checked < 1.0:
            return self._fd
        self._checked = now
        try:
            ino = os.stat(self.path).st_ino
        except FileNotFoundError:
            ino = -1
        if self._fd < 0 or ino != self._ino:
            if self._fd >= 0:
                os.close(self._fd)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC,
                               0o640)
            self._ino = os.fstat(self._fd).st_ino
        return self._fd

    def write(self, lines: list[str]) -> None:
        """Append ``lines`` in one write, under our host name if one is set.

        A failure to write is logged as a warning, not raised.
        """
        if self.hostname:
            lines = [_rehost(line, self.hostname) for line in lines]
        data = ("\n".join(lines) + "\n").encode("utf-8", errors="replace")
        with self._lock:
            try:
                write_all(self._open(), data)
            except OSError as exc:
                logging.getLogger("sluice.logs").warning("mail log %s: %s", self.path, exc)

    def close(self) -> None:
        """Close the file; the next write opens it again."""
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def _rehost(line: str, host: str) -> str:
    stamp, _, rest = line.partition(" ")
    _, _, tail = rest.partition(" ")
    return f"{stamp} {host} {tail}"
