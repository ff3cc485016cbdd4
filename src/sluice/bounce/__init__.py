"""Non-delivery reports: RFC 3464 delivery status notifications, RFC 6533 for UTF-8.

SUMMARY
    build_ndr(..., utf8) -> bytes; status_code(reply, expired) -> str;
    FailedRecipient; read_header_block(stream, limit) -> bytes.

DESCRIPTION
    An NDR is a ``multipart/report; report-type=delivery-status`` message
    (RFC 6522) with three parts:

    1. a text/plain explanation for a person;
    2. ``message/delivery-status`` (RFC 3464): per-message fields
       Reporting-MTA and Arrival-Date, then per recipient Final-Recipient,
       Action: failed, Status (an RFC 3463 code), Remote-MTA (the server
       that gave the last reply, when one did), Diagnostic-Code and
       Last-Attempt-Date (when the attempt that got the last reply was
       recorded; absent when none was made);
    3. ``text/rfc822-headers``: the header of the original message.

    It goes from the null sender ``<>`` to the original envelope sender and
    is queued like any message, with retry_maxtime_reports.  Never an NDR
    for an NDR, nor for mail from the null sender (RFC 5321 section 6.1):
    the caller discards those and logs it.

    Diagnostic-Code: ``smtp;`` with the reply as the remote server sent
    it (code, enhanced code, text -- never our "host X said:", which the
    human part adds), or ``X-Sluice;`` with the text of a diagnostic
    Sluice made itself (no connection, a size over the server's SIZE, no
    SMTPUTF8, an expiry, a hook's or an operator's bounce): RFC 3464
    2.3.6 keeps ``smtp`` for what an SMTP server said.

    Status codes: the enhanced code of the last reply when it has one of
    the right class; otherwise 5.0.0 for a permanent failure and 4.4.7
    ("delivery time expired", RFC 3463 section 3.5) for an expired message
    whose last reply carried no usable code.  An expired message keeps its
    last transient code (e.g. 4.4.1), as Postfix does: the reader learns
    why the attempts failed, and "Action: failed" says it is final.

    Internationalised mail (RFC 6533, as Postfix does it, but only where
    UTF-8 is really used -- the rule of the delivery agent, see
    sluice.delivery.agent.smtputf8_refusal):

    - a non-ASCII failed recipient makes part 2
      ``message/global-delivery-status`` (8bit), where such a recipient is
      ``Final-Recipient: utf-8; usér@exämple.org`` (the utf-8-address form,
      RFC 6533 section 3: raw UTF-8, which that media type allows) and an
      ASCII one stays ``rfc822;``; Diagnostic-Code keeps UTF-8 reply text
      there (section 6.2) instead of "?";
    - a message received with SMTPUTF8 (``utf8``) whose header block is
      UTF-8 gets part 3 as ``message/global-headers`` (8bit), the bytes as
      they were; a legacy 8-bit header block, or one not received with
      SMTPUTF8, stays text/rfc822-headers, as the agent sends such
      headers as they are;
    - a non-ASCII original sender is written raw in ``To:`` (RFC 6532),
      never as encoded words, which are not allowed in an address.

    A non-ASCII address needs no flag: it can only have come with SMTPUTF8
    (RFC 6531), also on messages queued before the flag was kept.  The
    report-type stays ``delivery-status``: RFC 6533 updates RFC 6522 so that
    it also names message/global-delivery-status (so does the IANA
    report-type registry).  Each part takes the global type only for what it
    holds, so readers that know only RFC 3464 still read the parts that are
    ASCII.  Whoever queues the NDR flags it SMTPUTF8 when the original was.

    Pure: no I/O, no clock (``now`` is a parameter).
"""

from __future__ import annotations

import dataclasses
import io
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from email.generator import BytesGenerator
from email.message import Message
from email.policy import SMTP, SMTPUTF8
from email.utils import format_datetime
from typing import IO

from sluice.model import Reply, utf8_header

__all__ = ["FailedRecipient", "build_ndr", "read_header_block", "status_code"]

_ENHANCED_RE = re.compile(r"^[245]\.\d{1,3}\.\d{1,3}$")


@dataclass(frozen=True, slots=True)
class FailedRecipient:
    """One recipient an NDR reports on.

    ``reply``: the last reply (None: expired before any attempt).
    ``last_attempt_at``: when the attempt that got it was made (None: no
    attempt; no Last-Attempt-Date).  ``remote_mta``: the server that
    sent ``reply``, None when Sluice made the reply itself.
    """

    recipient: str
    reply: Reply | None
    last_attempt_at: float | None = None
    remote_mta: str | None = None
    expired: bool = False


def status_code(reply: Reply | None, expired: bool) -> str:
    """The RFC 3463 Status for a failed recipient (see the module doc)."""
    enhanced = reply.enhanced if reply else ""
    if enhanced and _ENHANCED_RE.match(enhanced):
        cls = enhanced[0]
        if expired and cls in "45":
            return enhanced
        if not expired and cls == "5":
            return enhanced
    # No usable code: "delivery time expired", or an unspecified permanent
    # failure (also for an operator's bounce of an entry whose last reply
    # was transient: the failure is final now).
    return "4.4.7" if expired else "5.0.0"


def _rfc5322_date(at: float) -> str:
    return format_datetime(datetime.fromtimestamp(at, UTC))


def _diagnostic(reply: Reply | None, remote_mta: str | None, utf8: bool = False) -> str:
    """The Diagnostic-Code field's value (RFC 3464 2.3.6).

    ``smtp;`` and the reply as the remote server sent it, or ``X-Sluice;``
    and the text of a diagnostic Sluice made itself (a private
    diagnostic-type, as Postfix writes X-Postfix), whose SMTP code no server
    ever sent.
    """
    if reply is None:
        return "X-Sluice; delivery time expired before any attempt"
    if remote_mta:
        kind, said = "smtp", str(reply)
    else:
        kind, said = "X-Sluice", reply.text or str(reply)
    # One line, in US-ASCII: a reply with 8-bit text (decoded with U+FFFD
    # for what was not UTF-8) keeps its words, with "?" for the rest; the
    # human part has it all.  RFC 6533 6.2: in a global delivery-status
    # part it may be UTF-8.
    text = " ".join(said.split())
    if not utf8:
        text = text.encode("ascii", "replace").decode("ascii")
    return f"{kind}; {text}"


def _field(name: str, value: str) -> str:
    """``Name: value`` and a newline, folded at spaces after 78 characters where it can be.

    Folding as RFC 5322 2.2.3 allows.  Never encoded words: the fields of a
    global delivery-status part hold UTF-8 as it is.
    """
    lines = [f"{name}:"]
    bare = True  # no word on the first line yet: never fold right after the name
    for word in value.split(" "):
        if not bare and len(lines[-1]) + 1 + len(word) > 78:
            lines.append("")
        lines[-1] += " " + word
        bare = False
    return "\n".join(lines) + "\n"


class _Generator(BytesGenerator):
    """The email package's BytesGenerator, knowing RFC 6533's two media types.

    It writes a message/* part it has no handler for as message/rfc822,
    through an ASCII codec.  message/global-delivery-status and
    message/global-headers hold lines of UTF-8: they are written like a
    text part, CRLF line ends and the bytes of a surrogate-escaped payload
    as they are (see _surrogates).  message/delivery-status is written the
    same way, from the text build_ndr() folded itself.  The generator finds
    a handler by the name ``_handle_<maintype>_<subtype>``.
    """

    def _handle_message_global_delivery_status(self, msg: Message) -> None:
        self._handle_text(msg)  # type: ignore[attr-defined]

    _handle_message_global_headers = _handle_message_global_delivery_status
    # The ASCII part too: its fields are folded by _field, not by the package.
    _handle_message_delivery_status = _handle_message_global_delivery_status


def read_header_block(stream: IO[bytes], limit: int = 65536) -> bytes:
    """The header of a message (up to the empty line), at most ``limit`` bytes.

    Reads line by line from a stream, so that a large body is never loaded.
    """
    out = bytearray()
    while len(out) < limit:
        line = stream.readline(limit - len(out) + 1)
        if not line or line in (b"\r\n", b"\n"):
            break
        out += line
    return bytes(out[:limit])


def _human_text(hostname: str, failed: Sequence[FailedRecipient]) -> str:
    lines = [
        f"This is the mail system at host {hostname}.",
        "",
        "I'm sorry to have to inform you that your message could not",
        "be delivered to one or more recipients. It's attached below.",
        "",
    ]
    for f in failed:
        why = "the retry period expired" if f.expired else "delivery failed permanently"
        said = dataclasses.replace(f.reply, remote_mta=f.remote_mta or "") if f.reply else None
        reply = f" ({' '.join(said.describe().split())})" if said else ""
        lines.append(f"<{f.recipient}>: {why}{reply}")
    lines.append("")
    return "\r\n".join(lines)


def _surrogates(data: bytes) -> str:
    """Bytes as a payload the email package writes back byte for byte.

    The BytesGenerator writes a str payload holding surrogate escapes as the
    bytes they stand for (with CRLF line ends), where a plain str would go
    through an ASCII codec or a charset's transfer encoding.
    """
    return data.decode("ascii", "surrogateescape").replace("\r\n", "\n")


def build_ndr(
    *,
    reporting_mta: str,
    from_address: str,
    original_sender: str,
    original_spid: str,
    arrival_at: float,
    now: float,
    failed: Sequence[FailedRecipient],
    original_headers: bytes,
    utf8: bool = False,
) -> bytes:
    """The NDR as bytes with CRLF line ends, ready to be queued.

    ``utf8``: the original was received with SMTPUTF8 (see the module doc
    for what that changes).
    """
    if not failed:
        raise ValueError("an NDR needs at least one failed recipient")
    if not original_sender:
        raise ValueError("never an NDR for mail from the null sender")
    if "@" not in from_address:
        from_address = f"{from_address}@{reporting_mta}"

    global_status = not all(f.recipient.isascii() for f in failed)
    global_headers = utf8 and utf8_header(original_headers)
    # Only To: can need UTF-8 in the header block; the SMTP policy would
    # write it as encoded words, which an address may not hold.
    policy = SMTP if original_sender.isascii() else SMTPUTF8

    report = Message(policy=SMTP)
    report["From"] = f"Mail Delivery System <{from_address}>"
    report["To"] = f"<{original_sender}>"
    report["Subject"] = "Undelivered Mail Returned to Sender"
    report["Date"] = _rfc5322_date(now)
    # Deterministic (no clock, no randomness): one NDR per message and time.
    report["Message-ID"] = f"<{original_spid}.{int(now * 1000)}.ndr@{reporting_mta}>"
    report["Auto-Submitted"] = "auto-replied"  # RFC 3834: no auto-reply loops
    report["MIME-Version"] = "1.0"
    report.set_type("multipart/report")
    report.set_param("report-type", "delivery-status")

    human_text = _human_text(reporting_mta, failed)
    human = Message(policy=SMTP)
    human.set_type("text/plain")
    human.set_param("charset", "us-ascii" if human_text.isascii() else "utf-8")
    human["Content-Description"] = "Notification"
    if human_text.isascii():
        human.set_payload(human_text)
    else:
        # A reply with 8-bit text: UTF-8 as it is (8BITMIME), not base64,
        # so that the sender can read it in any client.
        human["Content-Transfer-Encoding"] = "8bit"
        human.set_payload(_surrogates(human_text.encode("utf-8")))

    per_message = [
        ("Reporting-MTA", f"dns; {reporting_mta}"),
        ("X-Sluice-Queue-ID", original_spid),
        ("Arrival-Date", _rfc5322_date(arrival_at)),
    ]
    fields = [per_message]
    for f in failed:
        address_type = "rfc822" if f.recipient.isascii() else "utf-8"
        block = [
            ("Final-Recipient", f"{address_type}; {f.recipient}"),
            ("Action", "failed"),
            ("Status", status_code(f.reply, f.expired)),
        ]
        if f.remote_mta:
            block.append(("Remote-MTA", f"dns; {f.remote_mta}"))
        block.append(("Diagnostic-Code", _diagnostic(f.reply, f.remote_mta, global_status)))
        if f.last_attempt_at is not None:
            block.append(("Last-Attempt-Date", _rfc5322_date(f.last_attempt_at)))
        fields.append(block)

    status = Message(policy=SMTP)
    # Written by hand (_field): the email package would fold a long
    # Diagnostic-Code right after its name, and long UTF-8 words into
    # encoded words even with the SMTPUTF8 policy.
    text = "\n".join("".join(_field(n, v) for n, v in b) for b in fields)
    status.set_type("message/global-delivery-status" if global_status
                    else "message/delivery-status")
    status["Content-Description"] = "Delivery report"
    if global_status:
        status["Content-Transfer-Encoding"] = "8bit"
    status.set_payload(_surrogates(text.encode("utf-8")))

    headers = Message(policy=SMTP)
    headers.set_type("message/global-headers" if global_headers else "text/rfc822-headers")
    headers["Content-Description"] = "Undelivered Message Headers"
    if any(b > 127 for b in original_headers):
        headers["Content-Transfer-Encoding"] = "8bit"
    else:
        headers["Content-Transfer-Encoding"] = "7bit"
    headers.set_payload(_surrogates(original_headers))

    report.attach(human)
    report.attach(status)
    report.attach(headers)
    out = io.BytesIO()
    _Generator(out, mangle_from_=False, policy=policy).flatten(report)
    return out.getvalue()
