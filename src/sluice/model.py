"""Plain data of the queue: messages, recipient entries, replies, outcomes.

SUMMARY
    The vocabulary every other package speaks.  Nothing here does I/O or
    reads the clock; every value is a frozen, slotted dataclass or an Enum.

DESCRIPTION
    A message is spooled once under its SPID (spool id, hexadecimal).  The
    meta queue holds one *entry* per recipient, identified by its queue id
    (QID) ``<SPID>-<index>``, where index is the recipient's position in the
    envelope.  An entry is in exactly one QueueState at any time; when it
    leaves the queue (delivered, NDR queued, deleted) it is gone.

    Times are absolute POSIX seconds and end in ``_at``; durations are
    seconds and end in ``_s``.

INVARIANTS
    A QID names one entry for the life of its message; SPIDs are never
    reused while their spool file exists.  ``priority`` is 0 (normal) or 1
    (high), as Halon defines it.

SEE ALSO
    sluice.store (where entries live), sluice.scheduler (what picks them).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

__all__ = [
    "Accepted",
    "ClientSession",
    "Delivered",
    "Outcome",
    "PermFail",
    "QueueEntry",
    "QueueState",
    "Reply",
    "Selector",
    "Submission",
    "TempFail",
    "format_qid",
    "parse_qid",
    "recipient_domain",
]


class QueueState(StrEnum):
    """Where a recipient entry is in its life cycle (DESIGN.md)."""

    HOLD = "hold"  # ignored by the queue manager until released
    INCOMING = "incoming"  # accepted, not yet looked at
    DEFERRED = "deferred"  # waiting for next_attempt_at
    ACTIVE = "active"  # claimed into a queue manager's memory
    DELIVERING = "delivering"  # a delivery attempt is in flight
    BOUNCE = "bounce"  # failed for good; waiting for its NDR


#: States that belong to a running queue manager; after a restart they
#: return to the queue to be retried (at-least-once delivery).
IN_FLIGHT_STATES = (QueueState.ACTIVE, QueueState.DELIVERING)

_SPID_RE = re.compile(r"^[0-9A-F]{8,32}$")
_QID_RE = re.compile(r"^([0-9A-F]{8,32})-(\d{1,6})$")


def format_qid(spid: str, idx: int) -> str:
    """The queue id of recipient number ``idx`` of message ``spid``."""
    return f"{spid}-{idx}"


def parse_qid(qid: str) -> tuple[str, int | None]:
    """Split a queue id into (spid, index); a bare SPID gives (spid, None).

    Raises ValueError for anything else, so that a typo on the command line
    selects nothing instead of everything.
    """
    text = qid.strip().upper()
    m = _QID_RE.match(text)
    if m:
        return m.group(1), int(m.group(2))
    if _SPID_RE.match(text):
        return text, None
    raise ValueError(f"not a queue id or SPID: {qid!r}")


def recipient_domain(address: str) -> str:
    """The domain part of an address, lower-cased; '' when there is none."""
    _, at, domain = address.rpartition("@")
    return domain.strip().rstrip(".").lower() if at else ""


def ascii_envelope(sender: str, recipients: Iterable[str]) -> bool:
    """Whether every address of an envelope is ASCII.

    Otherwise the message can only travel with SMTPUTF8 (RFC 6531).
    """
    return sender.isascii() and all(r.isascii() for r in recipients)


#: The blank line that ends a header block (or content that starts with one).
_HEADER_END_RE = re.compile(rb"(?:^|\n)\r?\n")


def utf8_header(head: bytes) -> bool:
    """Whether the header block at the start of ``head`` holds UTF-8 beyond ASCII.

    ``head`` is the start of a message, or a header block alone; it may
    stop in the middle of a character where a reader cut it (the first
    64 KB, a header limit), which still counts as UTF-8.  8-bit headers
    that are not UTF-8 (legacy charsets sent raw) do not count: SMTPUTF8
    would promise something the message does not keep.  Delivery asks
    for SMTPUTF8 for such a header, and refuses a message received with
    SMTPUTF8 that has one where SMTPUTF8 is not offered; an NDR returns
    it as message/global-headers.
    """
    if head.isascii():
        return False
    end = _HEADER_END_RE.search(head)
    block = head[:end.start() + 1] if end is not None else head
    if block.isascii():
        return False
    try:
        block.decode("utf-8")
    except UnicodeDecodeError as exc:
        # Decoding stops at the first fault: one that is only a character
        # cut at the very end leaves everything before it valid.
        return exc.end == len(block) and exc.reason == "unexpected end of data"
    return True


@dataclass(frozen=True, slots=True)
class Reply:
    """An SMTP reply: basic code, RFC 3463 enhanced code and text.

    A reply a delivery attempt got also says who gave it and when, for
    the NDR (RFC 3464) and the operator:

    ``remote_mta``  the host name of the next hop that sent this reply;
                    empty for a reply Sluice made itself (no connection,
                    a SIZE the server announced, an expiry, a hook, an
                    operator).  ``text`` is then the server's text alone:
                    "host X said:" is for people, see describe().
    ``attempt_at``  when the queue recorded the attempt that got it (for a
                    success replayed from the journal after a restart,
                    when the journal wrote it); None for a reply no
                    attempt got (an operator's bounce, a dead
                    destination's deferral).
    ``phase``       the SMTP phase the delivery client was in when the
                    reply came (sluice.shaping.rules.PHASES: connect,
                    helo, mail, rcpt, data, end-of-data); empty when
                    unknown.  For traffic
                    shaping only (sluice.shaping): it is not stored
                    (to_record) and does not take part in equality.
    """

    code: int
    enhanced: str = ""
    text: str = ""
    remote_mta: str = ""
    attempt_at: float | None = None
    phase: str = field(default="", compare=False)

    def __init__(self, code: int, enhanced: str = "", text: str = "", remote_mta: str = "",
                 attempt_at: float | None = None, phase: str = "") -> None:
        object.__setattr__(self, "code", code)
        object.__setattr__(self, "enhanced", enhanced)
        object.__setattr__(self, "text", text)
        object.__setattr__(self, "remote_mta", remote_mta)
        object.__setattr__(self, "attempt_at", attempt_at)
        object.__setattr__(self, "phase", phase)

    def __str__(self) -> str:
        parts = [str(self.code)]
        if self.enhanced:
            parts.append(self.enhanced)
        if self.text:
            parts.append(self.text)
        return " ".join(parts)

    def attempted_at(self, at: float) -> Reply:
        """This reply, got by an attempt the queue recorded at ``at``.

        (dataclasses.replace, written out: one reply a recorded attempt.)
        """
        return Reply(self.code, self.enhanced, self.text, self.remote_mta, at, self.phase)

    def describe(self) -> str:
        """The reply for a person.

        "host mx.example.com said: 550 5.1.1 ..." when a server gave it, else
        what Sluice said.
        """
        return f"host {self.remote_mta} said: {self}" if self.remote_mta else str(self)

    def to_record(self) -> list[object]:
        """The reply as a JSON list, as the record-based stores keep it."""
        record: list[object] = [self.code, self.enhanced, self.text]
        if self.remote_mta or self.attempt_at is not None:
            record += [self.remote_mta, self.attempt_at]
        return record

    @classmethod
    def from_record(cls, record: Sequence[Any]) -> Reply:
        """The reply of to_record().

        A three-item record (written before Sluice kept who and when) reads as
        a reply Sluice made, at no time.
        """
        at = record[4] if len(record) > 4 else None
        return cls(*reply_fields(record), None if at is None else float(at))

    @property
    def is_permanent(self) -> bool:
        """Whether the reply is a permanent failure (5xx)."""
        return 500 <= self.code <= 599

    @property
    def is_transient(self) -> bool:
        """Whether the reply is a transient failure (4xx)."""
        return 400 <= self.code <= 499


def reply_fields(record: Sequence[Any]) -> tuple[int, str, str, str]:
    """Code, enhanced code, text and remote MTA of a stored reply record.

    The one reading of Reply.to_record()'s list: Reply.from_record() and
    the listings that make rows without a Reply (sluice.store) share it.
    A three-item record was written before Sluice kept who gave a reply.
    """
    return (int(record[0]), record[1] or "", record[2] or "",
            (record[3] if len(record) > 3 else "") or "")


@dataclass(frozen=True, slots=True)
class Delivered:
    """The next hop took responsibility (2xx)."""

    reply: Reply

    def __init__(self, reply: Reply) -> None:
        object.__setattr__(self, "reply", reply)


@dataclass(frozen=True, slots=True)
class TempFail:
    """Try again later (4xx, connection failure, dead destination)."""

    reply: Reply

    def __init__(self, reply: Reply) -> None:
        object.__setattr__(self, "reply", reply)


@dataclass(frozen=True, slots=True)
class PermFail:
    """Never try again: bounce and send an NDR (5xx, null MX)."""

    reply: Reply

    def __init__(self, reply: Reply) -> None:
        object.__setattr__(self, "reply", reply)


Outcome = Delivered | TempFail | PermFail


@dataclass(frozen=True, slots=True)
class ClientSession:
    """The SMTP session a message came in on, as its accounting lines carry it.

    ``tls_protocol`` and ``tls_cipher`` are None without TLS; ``auth_user``
    None without AUTH; ``helo`` is what the client said last (EHLO again
    after STARTTLS).
    """

    client_ip: str
    helo: str = ""
    tls_protocol: str | None = None
    tls_cipher: str | None = None
    auth_user: str | None = None

    def __init__(self, client_ip: str, helo: str = "", tls_protocol: str | None = None,
                 tls_cipher: str | None = None, auth_user: str | None = None) -> None:
        object.__setattr__(self, "client_ip", client_ip)
        object.__setattr__(self, "helo", helo)
        object.__setattr__(self, "tls_protocol", tls_protocol)
        object.__setattr__(self, "tls_cipher", tls_cipher)
        object.__setattr__(self, "auth_user", auth_user)


@dataclass(frozen=True, slots=True)
class Submission:
    """What a client hands us with a message: envelope and queue fields.

    ``hold`` puts the entries in the hold state; ``delay_s`` > 0 queues them
    deferred until now + delay (Halon's queue() "hold" and "delay").
    ``spid``: the SPID to queue the message under, drawn by the caller with
    sluice.spool.new_spid() (the SMTP server names it in the Received
    header); empty = the store draws one.  A store that finds it taken
    (another process drew the same one in the same millisecond) draws
    another: Accepted.spid is the one that counts.
    ``smtputf8``: the client asked for SMTPUTF8 on MAIL FROM (RFC 6531);
    kept with the message so that delivery knows it may carry UTF-8.
    ``client``: the SMTP session it came in on (None from HTTP, sendmail
    and NDRs); written on its ``received`` lines, not stored.
    """

    sender: str
    recipients: tuple[str, ...]
    tenantid: str = ""
    jobid: str = ""
    transportid: str = ""
    localip: tuple[str, ...] = ()
    priority: int = 0
    hold: bool = False
    delay_s: float = 0.0
    is_report: bool = False
    spid: str = ""
    smtputf8: bool = False
    client: ClientSession | None = None

    def __init__(self, sender: str, recipients: tuple[str, ...], tenantid: str = "",
                 jobid: str = "", transportid: str = "", localip: tuple[str, ...] = (),
                 priority: int = 0, hold: bool = False, delay_s: float = 0.0,
                 is_report: bool = False, spid: str = "", smtputf8: bool = False,
                 client: ClientSession | None = None) -> None:
        object.__setattr__(self, "sender", sender)
        object.__setattr__(self, "recipients", recipients)
        object.__setattr__(self, "tenantid", tenantid)
        object.__setattr__(self, "jobid", jobid)
        object.__setattr__(self, "transportid", transportid)
        object.__setattr__(self, "localip", localip)
        object.__setattr__(self, "priority", priority)
        object.__setattr__(self, "hold", hold)
        object.__setattr__(self, "delay_s", delay_s)
        object.__setattr__(self, "is_report", is_report)
        object.__setattr__(self, "spid", spid)
        object.__setattr__(self, "smtputf8", smtputf8)
        object.__setattr__(self, "client", client)
        self.__post_init__()

    def __post_init__(self) -> None:
        if not self.recipients:
            raise ValueError("a submission needs at least one recipient")
        if self.spid and not _SPID_RE.match(self.spid):
            raise ValueError(f"not a SPID: {self.spid!r}")
        if self.priority not in (0, 1):
            raise ValueError(f"priority must be 0 or 1, not {self.priority}")
        if self.delay_s < 0:
            raise ValueError("delay_s must not be negative")

    def initial_state(self, now: float) -> tuple[QueueState, float]:
        """The state and next_attempt_at its entries start with when queued at ``now``.

        Every store flavour uses it, and so does the accounting of a submission.
        """
        if self.hold:
            return QueueState.HOLD, now
        if self.delay_s > 0:
            return QueueState.DEFERRED, now + self.delay_s
        return QueueState.INCOMING, now


@dataclass(frozen=True, slots=True)
class Accepted:
    """A submission is durable: content and meta are on stable storage.

    ``duplicate``: nothing was queued; the message is a resend of one
    queued earlier, whose queue ids these are (sluice.smtpd.dedupe).
    """

    spid: str
    qids: tuple[str, ...]
    size: int
    duplicate: bool = False

    def __init__(self, spid: str, qids: tuple[str, ...], size: int,
                 duplicate: bool = False) -> None:
        object.__setattr__(self, "spid", spid)
        object.__setattr__(self, "qids", qids)
        object.__setattr__(self, "size", size)
        object.__setattr__(self, "duplicate", duplicate)


@dataclass(frozen=True, slots=True)
class QueueEntry:
    """One recipient of one message, as the meta queue keeps it.

    ``is_report`` and ``smtputf8`` are the message's (Submission's) flags,
    the same in every entry of a message.
    """

    spid: str
    idx: int
    sender: str
    recipient: str
    state: QueueState
    arrival_at: float
    next_attempt_at: float
    attempts: int = 0
    last_reply: Reply | None = None
    priority: int = 0
    tenantid: str = ""
    jobid: str = ""
    transportid: str = ""
    localip: tuple[str, ...] = ()
    is_report: bool = False
    size: int = 0
    domain: str = field(default="")
    smtputf8: bool = False
    #: The queue id (format_qid of spid and idx), made once: the queue
    #: manager looks it up several times per recipient and attempt.
    qid: str = field(init=False, repr=False, compare=False)

    def __init__(self, spid: str, idx: int, sender: str, recipient: str, state: QueueState,
                 arrival_at: float, next_attempt_at: float, attempts: int = 0,
                 last_reply: Reply | None = None, priority: int = 0, tenantid: str = "",
                 jobid: str = "", transportid: str = "", localip: tuple[str, ...] = (),
                 is_report: bool = False, size: int = 0, domain: str = "",
                 smtputf8: bool = False) -> None:
        object.__setattr__(self, "spid", spid)
        object.__setattr__(self, "idx", idx)
        object.__setattr__(self, "sender", sender)
        object.__setattr__(self, "recipient", recipient)
        object.__setattr__(self, "state", state)
        object.__setattr__(self, "arrival_at", arrival_at)
        object.__setattr__(self, "next_attempt_at", next_attempt_at)
        object.__setattr__(self, "attempts", attempts)
        object.__setattr__(self, "last_reply", last_reply)
        object.__setattr__(self, "priority", priority)
        object.__setattr__(self, "tenantid", tenantid)
        object.__setattr__(self, "jobid", jobid)
        object.__setattr__(self, "transportid", transportid)
        object.__setattr__(self, "localip", localip)
        object.__setattr__(self, "is_report", is_report)
        object.__setattr__(self, "size", size)
        object.__setattr__(self, "domain", domain)
        object.__setattr__(self, "smtputf8", smtputf8)
        self.__post_init__()

    def __post_init__(self) -> None:
        if not self.domain:
            object.__setattr__(self, "domain", recipient_domain(self.recipient))
        object.__setattr__(self, "qid", format_qid(self.spid, self.idx))


@dataclass(frozen=True, slots=True)
class Selector:
    """Which entries an operator command or a listing applies to.

    Every given criterion must match (AND).  ``qids`` holds queue ids or
    bare SPIDs (all recipients of the message).  An empty selector matches
    everything; commands that change the queue refuse it unless the
    operator says so explicitly.
    """

    qids: tuple[str, ...] = ()
    states: tuple[QueueState, ...] = ()
    domain: str | None = None
    sender: str | None = None
    recipient: str | None = None
    tenantid: str | None = None
    jobid: str | None = None
    transportid: str | None = None

    def __init__(self, qids: tuple[str, ...] = (), states: tuple[QueueState, ...] = (),
                 domain: str | None = None, sender: str | None = None,
                 recipient: str | None = None, tenantid: str | None = None,
                 jobid: str | None = None, transportid: str | None = None) -> None:
        object.__setattr__(self, "qids", qids)
        object.__setattr__(self, "states", states)
        object.__setattr__(self, "domain", domain)
        object.__setattr__(self, "sender", sender)
        object.__setattr__(self, "recipient", recipient)
        object.__setattr__(self, "tenantid", tenantid)
        object.__setattr__(self, "jobid", jobid)
        object.__setattr__(self, "transportid", transportid)
        self.__post_init__()

    def __post_init__(self) -> None:
        for qid in self.qids:
            parse_qid(qid)  # raises on a malformed id
        if self.domain is not None:
            object.__setattr__(self, "domain", self.domain.lower().rstrip("."))

    @property
    def is_empty(self) -> bool:
        """Whether the selector has no criterion (it would match every entry)."""
        return not (
            self.qids
            or self.states
            or self.domain is not None
            or self.sender is not None
            or self.recipient is not None
            or self.tenantid is not None
            or self.jobid is not None
            or self.transportid is not None
        )

    def matches(self, entry: QueueEntry) -> bool:
        """Whether ``entry`` is selected; the reference for every store flavour."""
        if self.qids:
            hit = False
            for qid in self.qids:
                spid, idx = parse_qid(qid)
                if entry.spid == spid and (idx is None or entry.idx == idx):
                    hit = True
                    break
            if not hit:
                return False
        if self.states and entry.state not in self.states:
            return False
        if self.domain is not None and entry.domain != self.domain:
            return False
        if self.sender is not None and entry.sender.lower() != self.sender.lower():
            return False
        if self.recipient is not None and entry.recipient.lower() != self.recipient.lower():
            return False
        if self.tenantid is not None and entry.tenantid != self.tenantid:
            return False
        if self.jobid is not None and entry.jobid != self.jobid:
            return False
        return self.transportid is None or entry.transportid == self.transportid
