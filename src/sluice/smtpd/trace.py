"""The trace field we prepend to every message we accept (RFC 5321 4.4).

SUMMARY
    protocol_name(esmtp, tls, auth, smtputf8) -> "ESMTPSA", ...
    received_header(helo=, client_ip=, hostname=, protocol=, spid=,
                    recipient=None, at=) -> bytes

DESCRIPTION
    A header of the form::

        Received: from client.example ([192.0.2.1])
                by mx.example (Sluice) with ESMTPS id 7F3A91C2.1
                for <bob@example.org>; Sun, 22 Nov 2026 10:00:00 +0000

    ``from`` holds what the client said in HELO/EHLO and, in the comment,
    the address it connected from as an address literal (RFC 5321 4.1.3:
    ``[IPv6:...]`` for IPv6); no reverse DNS lookup is made on the accept
    path.  ``with`` names the protocol in the RFC 3848 / RFC 6531
    registry: SMTP, ESMTP, then S for TLS and A for AUTH; UTF8SMTP... when
    the client used SMTPUTF8.  ``for`` is given only when the message has
    a single recipient, so that one copy does not list the others (as
    Postfix does).  The date is UTC in RFC 5322 form.

STRATEGIES
    The date string is built once per second, not once per message.
"""

from __future__ import annotations

import time

__all__ = ["protocol_name", "received_header"]

_DAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")
_date_cache: list[object] = [-1, ""]


def rfc5322_date(at: float) -> str:
    """``at`` as an RFC 5322 date-time in UTC, e.g. 'Sun, 22 Nov 2026 10:00:00 +0000'."""
    second = int(at)
    if _date_cache[0] == second:
        return str(_date_cache[1])
    t = time.gmtime(second)
    text = (f"{_DAYS[t.tm_wday]}, {t.tm_mday:02d} {_MONTHS[t.tm_mon - 1]} {t.tm_year} "
            f"{t.tm_hour:02d}:{t.tm_min:02d}:{t.tm_sec:02d} +0000")
    _date_cache[0], _date_cache[1] = second, text
    return text


def protocol_name(esmtp: bool, tls: bool, auth: bool, smtputf8: bool = False) -> str:
    """The ``with`` value of RFC 3848 (ESMTPS, ESMTPSA...) and RFC 6531 (UTF8SMTP...)."""
    if smtputf8:
        base = "UTF8SMTP"
    elif esmtp:
        base = "ESMTP"
    else:
        return "SMTP"  # RFC 3848 has no S/A forms without EHLO
    return base + ("S" if tls else "") + ("A" if auth else "")


def address_literal(ip: str) -> str:
    """The RFC 5321 4.1.3 address literal: [192.0.2.1] or [IPv6:2001:db8::1]."""
    return f"[IPv6:{ip}]" if ":" in ip else f"[{ip}]"


def _clean(text: str) -> str:
    # A HELO argument is the client's to choose: keep it on one line and out
    # of the comment syntax, so it cannot forge header structure.
    out = "".join(ch if " " < ch < "\x7f" and ch not in "()\\;" else "?" for ch in text)
    return out[:255] or "unknown"


def received_header(*, helo: str, client_ip: str, hostname: str, protocol: str, spid: str,
                    recipient: str | None = None, at: float) -> bytes:
    """The folded header, ending in CRLF; UTF-8 (only SMTPUTF8 recipients need it)."""
    lines = [
        f"Received: from {_clean(helo)} ({address_literal(client_ip)})",
        f"\tby {hostname} (Sluice) with {protocol} id {spid}",
    ]
    date = rfc5322_date(at)
    if recipient is not None and "\r" not in recipient and "\n" not in recipient:
        lines.append(f"\tfor <{recipient}>; {date}")
    else:
        lines[-1] += ";"
        lines.append(f"\t{date}")
    return ("\r\n".join(lines) + "\r\n").encode("utf-8", "surrogateescape")
