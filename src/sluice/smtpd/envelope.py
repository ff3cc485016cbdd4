"""The envelope of one mail transaction: MAIL and RCPT arguments, parsed and kept.

SUMMARY
    parse_path("<a@b> SIZE=10") -> ("a@b", "SIZE=10")    (None, "") if malformed
    parse_mail_params("SIZE=10 BODY=8BITMIME") -> MailParams | Reply
    undecodable(text) -> bool                            bytes that were not UTF-8
    Transaction(sender)                                  from MAIL to the end of DATA

DESCRIPTION
    sluice.smtpd.session reads the command lines; this module turns their
    arguments into values and Reply refusals (RFC 5321 4.1.2 paths,
    RFC 1870 SIZE, RFC 6152 BODY, RFC 6531 SMTPUTF8, RFC 4954 AUTH=).

STRATEGIES
    One regular expression, not an e-mail header parser: parsing paths
    with the email package was a tenth of the accept path's CPU.  Source
    routes (``<@relay:a@b>``, obsolete) are accepted and dropped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from sluice.model import Reply
from sluice.suppression import SuppressionEntry

__all__ = ["MailParams", "Transaction", "parse_mail_params", "parse_path", "undecodable"]

_ATOM_LOCAL = r'[^\s@<>()\\,;:"\[\]]+'
_QUOTED_LOCAL = r'"(?:[^"\\\r\n]|\\.)*"'
_DOMAIN = r'(?:\[[^\[\]\s\\]+\]|[^\s@<>()\\,;:"\[\]]+)'
_MAILBOX_RE = re.compile(rf"^(?:{_ATOM_LOCAL}|{_QUOTED_LOCAL})@{_DOMAIN}$")
_ROUTE_RE = re.compile(r"^@[^:]*:")  # RFC 5321 4.1.2 obsolete source route, ignored
_MAX_PATH = 256  # RFC 5321 4.5.3.1.3
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")  # C0 controls and DEL: never in a path


@dataclass(slots=True)
class Transaction:
    """One mail transaction, from MAIL FROM to the end of DATA or RSET."""

    sender: str
    smtputf8: bool = False
    recipients: list[str] = field(default_factory=list)
    dropped: list[tuple[str, SuppressionEntry]] = field(default_factory=list)

    def __init__(self, sender: str, smtputf8: bool = False, recipients: list[str] | None = None,
                 dropped: list[tuple[str, SuppressionEntry]] | None = None) -> None:
        self.sender = sender
        self.smtputf8 = smtputf8
        self.recipients = [] if recipients is None else recipients
        self.dropped = [] if dropped is None else dropped


@dataclass(frozen=True, slots=True)
class MailParams:
    """The MAIL FROM parameters Sluice acts on."""

    size: int | None = None
    smtputf8: bool = False

    def __init__(self, size: int | None = None, smtputf8: bool = False) -> None:
        object.__setattr__(self, "size", size)
        object.__setattr__(self, "smtputf8", smtputf8)


def parse_path(arg: str) -> tuple[str | None, str]:
    """'<a@b> SIZE=10' -> ('a@b', 'SIZE=10'); '<>' -> ('', ...); None if malformed."""
    text = arg.strip()
    if text.startswith("<"):
        end = text.find(">")
        if end < 0:
            return None, ""
        address, rest = text[1:end].strip(), text[end + 1 :]
    else:
        address, _, rest = text.partition(" ")
    if address.startswith("@"):
        address = _ROUTE_RE.sub("", address)
    if len(address) > _MAX_PATH or _CONTROL_RE.search(address):
        return None, ""
    if address and not _MAILBOX_RE.match(address):
        return None, ""
    return address, rest.strip()


_NO_PARAMS = MailParams()


def parse_mail_params(params: str) -> MailParams | Reply:
    """MAIL FROM's parameters, or the Reply refusing them."""
    if not params:
        return _NO_PARAMS
    size: int | None = None
    smtputf8 = False
    for param in params.split():
        key, eq, value = param.partition("=")
        key = key.upper()
        if key == "SIZE" and value.isdigit() and value.isascii():
            size = int(value)
        elif key == "BODY" and value.upper() in ("7BIT", "8BITMIME"):
            pass
        elif key == "SMTPUTF8" and not eq:
            smtputf8 = True
        elif key == "AUTH" and value:
            pass  # RFC 4954 5: we need not trust it, and do not
        elif key in ("SIZE", "BODY", "SMTPUTF8"):
            return Reply(501, "5.5.4", f"Bad {key} parameter")
        else:
            return Reply(555, "5.5.4", f"MAIL parameter {key} not supported")
    return MailParams(size, smtputf8)


def undecodable(text: str) -> bool:
    """Whether ``text`` holds bytes that were not UTF-8 (decoded with surrogateescape)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False
