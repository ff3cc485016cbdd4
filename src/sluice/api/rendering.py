"""One recipient's message from an injection template: rendered, then written as MIME bytes.

SUMMARY
    render(template, values, recipient, name, hostname, now) -> bytes

DESCRIPTION
    The template's From, Subject, headers and parts are rendered with
    Jinja2 (sandboxed, a missing substitution raises); the message has
    From, To, Subject, Date, Message-ID, the template's headers, and a
    text part, an HTML part or both (multipart/alternative).  Raises
    jinja2.TemplateError, or ValueError for a header that is not one
    (a line break in it, a reserved or a repeated unique name).

STRATEGIES
    Two writers, one result.  The email package (EmailMessage with the
    SMTP policy) is the reference, and it costs about a millisecond a
    message -- most of an injection request's time, for headers it parses
    again and folds again.  The common message -- an ASCII recipient
    without a display name, template headers the email package treats as
    plain unstructured text -- is written here, byte for byte what the
    email package writes for it (tests/unit/test_api_rendering.py compares
    the two): a header that is not printable ASCII on one line is folded
    by the email package alone (cached per value), and each part is
    encoded with the email package's own choice of 7bit, 8bit,
    quoted-printable or base64 (_encode_text: the rule of contentmanager,
    which keeps it private, written here).  Any other message goes through
    the email package whole.

    Templates are compiled once per distinct source (a sendout sends the
    same template in every batch).

SEE ALSO
    sluice.api.injector (its caller), email.policy, email.contentmanager, email.quoprimime
"""

from __future__ import annotations

import base64
import binascii
import functools
import random
import re
import sys
from collections.abc import Callable
from email import quoprimime
from email.headerregistry import Address, HeaderRegistry, UnstructuredHeader
from email.message import EmailMessage
from email.policy import SMTP, SMTPUTF8
from email.utils import formataddr, formatdate, make_msgid
from typing import TYPE_CHECKING, Any

import jinja2
from jinja2.sandbox import SandboxedEnvironment

if TYPE_CHECKING:
    from sluice.api.inject import TemplateContent

__all__ = ["render", "render_with_email_package"]

_TEXT = SandboxedEnvironment(undefined=jinja2.StrictUndefined, autoescape=False)
_HTML = SandboxedEnvironment(undefined=jinja2.StrictUndefined, autoescape=True)

#: The headers a template cannot set.
RESERVED = frozenset({"from", "to", "subject", "date", "message-id"})

#: The email package's line limit (policy.max_line_length), CRLF not counted.
MAX_LINE = 78

#: A header value written as it is: printable ASCII words with single spaces, no encoded word.
_PLAIN_VALUE = re.compile(r"[\x21-\x7e]+(?: [\x21-\x7e]+)*")
#: An address written as it is in To: a dot-atom at a domain.
_PLAIN_ADDRESS = re.compile(r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+(?:\.[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+)*"
                            r"@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*")
_PLAIN_MSGID = re.compile(r"<\d+\.\d+\.\d+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*>")

_PART_HEADERS = 'Content-Type: text/{}; charset="utf-8"\r\nContent-Transfer-Encoding: {}\r\n'
#: Line ends as the generator splits a payload.
_LINE_END = re.compile(r"\r\n|\r|\n")
#: The email package's boundary: 15 '=', 19 digits, '=='.
_BOUNDARY_DIGITS = len(repr(sys.maxsize - 1))


@functools.lru_cache(maxsize=64)
def _compiled(source: str, html: bool) -> jinja2.Template:
    env = _HTML if html else _TEXT
    return env.from_string(source)


@functools.lru_cache(maxsize=1024)
def _unstructured(name: str) -> bool:
    """Whether ``name`` is a header the email package treats as unstructured text."""
    registry: HeaderRegistry = SMTP.header_factory  # type: ignore[assignment]
    return issubclass(registry[name], UnstructuredHeader)


@functools.lru_cache(maxsize=1024)
def _plain_name(name: str) -> bool:
    """A template header written here: unstructured, repeatable, not one set_content moves."""
    low = name.lower()
    return (_unstructured(name) and SMTP.header_max_count(name) is None
            and not low.startswith("content-") and low != "mime-version")


def _headers(template: TemplateContent, text: Callable[[str], str]) -> list[tuple[str, str]]:
    out = []
    for key, value in template.headers.items():
        if key.lower() in RESERVED:
            raise ValueError(f"header {key} is set by the template itself")
        out.append((key, text(value)))
    return out


@functools.lru_cache(maxsize=4096)
def _folded(name: str, value: str) -> bytes:
    """A header line as the email package writes it with the SMTP policy (raises as it does)."""
    stored = SMTP.header_store_parse(name, value)
    return SMTP.fold_binary(*stored)


def _header(name: str, value: str) -> bytes:
    line = f"{name}: {value}"
    if (len(line) <= MAX_LINE and _unstructured(name) and "=?" not in value
            and _PLAIN_VALUE.fullmatch(value)):
        return line.encode("ascii") + b"\r\n"
    return _folded(name, value)


def _encode_text(text: str) -> tuple[str, str]:
    """set_content()'s choice and encoding of a UTF-8 text part under the SMTP policy.

    The email package keeps this rule private (contentmanager), so it is
    ours, written from it: 7bit when every line fits and is ASCII, else 8bit
    when lines fit (the policy allows 8bit), else quoted-printable or
    base64, whichever is shorter on the first ten lines.  The comparison
    test holds it to the email package's output.
    """
    lines = text.encode("utf-8").splitlines()

    def normal(ls: list[bytes]) -> bytes:
        return b"\n".join(ls) + b"\n"

    if max((len(x) for x in lines), default=0) <= MAX_LINE:
        body = normal(lines)
        if body.isascii():
            return "7bit", body.decode("ascii")
        return "8bit", body.decode("ascii", "surrogateescape")
    sniff = b"\r\n".join(lines[:10]) + b"\r\n"
    sniff_qp = quoprimime.body_encode(sniff.decode("latin-1"), MAX_LINE)
    if len(sniff_qp) > len(binascii.b2a_base64(sniff)):
        embedded = b"\r\n".join(lines) + b"\r\n"
        return "base64", base64.encodebytes(embedded).decode("ascii")
    if len(lines) <= 10:
        return "quoted-printable", sniff_qp
    return "quoted-printable", quoprimime.body_encode(normal(lines).decode("latin-1"), MAX_LINE)


def _part(text: str) -> tuple[str, bytes]:
    """A part's transfer encoding and body, chosen and encoded as set_content() does."""
    cte, data = _encode_text(text)
    return cte, _LINE_END.sub("\r\n", data).encode("ascii", "surrogateescape")


def _boundary(parts: list[bytes]) -> str | None:
    token = random.randrange(sys.maxsize)
    boundary = "=" * 15 + f"{token:0{_BOUNDARY_DIGITS}d}" + "=="
    if any(boundary.encode("ascii") in p for p in parts):
        return None  # as good as never; the email package finds another
    return boundary


def render(template: TemplateContent, values: dict[str, Any], recipient: str,
           name: str, hostname: str, now: float) -> bytes:
    """One recipient's message from ``template`` (see the module's description)."""
    def text(source: str) -> str:
        return _compiled(source, False).render(values)

    from_ = text(template.from_)
    subject = text(template.subject)
    headers = _headers(template, text)
    body = text(template.text_body) if template.text_body else None
    html = _compiled(template.html_body, True).render(values) if template.html_body else None
    msgid = make_msgid(domain=hostname or "sluice.invalid")
    date = formatdate(now, usegmt=True)
    fast = _write(from_, subject, headers, body, html, msgid, date, recipient, name)
    if fast is not None:
        return fast
    return _with_email_package(from_, subject, headers, body, html, msgid, date, recipient,
                               name)


def _write(from_: str, subject: str, headers: list[tuple[str, str]], body: str | None,
           html: str | None, msgid: str, date: str, recipient: str, name: str) -> bytes | None:
    """The message written directly, or None when it needs the email package."""
    if not recipient.isascii() or not all(_plain_name(key) for key, _ in headers):
        return None
    text_cte, text_part = _part(body) if body is not None else ("", b"")
    html_cte, html_part = _part(html) if html is not None else ("", b"")
    out = [_folded("From", from_)]
    if not name and _PLAIN_ADDRESS.fullmatch(recipient) and len(recipient) <= MAX_LINE - 4:
        out.append(f"To: {recipient}\r\n".encode("ascii"))
    else:
        out.append(_folded("To", formataddr((name, recipient)) if name
                           else str(Address(addr_spec=recipient))))
    out.append(_header("Subject", subject))
    out.append(_folded("Date", date))
    if _PLAIN_MSGID.fullmatch(msgid) and len(msgid) <= MAX_LINE - 12:
        out.append(f"Message-ID: {msgid}\r\n".encode("ascii"))
    else:
        out.append(_folded("Message-ID", msgid))
    out += [_header(key, value) for key, value in headers]
    if body is None or html is None:
        subtype, cte, part = (("plain", text_cte, text_part) if body is not None
                              else ("html", html_cte, html_part))
        out.append(_PART_HEADERS.format(subtype, cte).encode("ascii"))
        out.append(b"MIME-Version: 1.0\r\n\r\n")
        out.append(part)
        return b"".join(out)
    boundary = _boundary([text_part, html_part])
    if boundary is None:
        return None
    line = f"--{boundary}\r\n".encode("ascii")
    out.append(b'MIME-Version: 1.0\r\nContent-Type: multipart/alternative;\r\n boundary="'
               + boundary.encode("ascii") + b'"\r\n\r\n')
    out += [line, _PART_HEADERS.format("plain", text_cte).encode("ascii"), b"\r\n", text_part,
            b"\r\n", line, _PART_HEADERS.format("html", html_cte).encode("ascii"),
            b"MIME-Version: 1.0\r\n\r\n",
            html_part, b"\r\n", f"--{boundary}--\r\n".encode("ascii")]
    return b"".join(out)


def _with_email_package(from_: str, subject: str, headers: list[tuple[str, str]],
                        body: str | None, html: str | None, msgid: str, date: str,
                        recipient: str, name: str) -> bytes:
    utf8 = not recipient.isascii()
    msg = EmailMessage(policy=SMTPUTF8 if utf8 else SMTP)
    msg["From"] = from_
    msg["To"] = formataddr((name, recipient)) if name else Address(addr_spec=recipient)
    msg["Subject"] = subject
    msg["Date"] = date
    msg["Message-ID"] = msgid
    for key, value in headers:
        msg[key] = value
    if body is not None:
        msg.set_content(body)
    if html is not None:
        if body is None:
            msg.set_content(html, subtype="html")
        else:
            msg.add_alternative(html, subtype="html")
    return msg.as_bytes()


def render_with_email_package(template: TemplateContent, values: dict[str, Any],
                              recipient: str, name: str, hostname: str, now: float) -> bytes:
    """As render(), every message through the email package (the reference, for tests)."""
    def text(source: str) -> str:
        return _compiled(source, False).render(values)

    return _with_email_package(
        text(template.from_), text(template.subject),
        _headers(template, text),
        text(template.text_body) if template.text_body else None,
        _compiled(template.html_body, True).render(values) if template.html_body else None,
        make_msgid(domain=hostname or "sluice.invalid"), formatdate(now, usegmt=True),
        recipient, name)
