"""Mailbox syntax: RFC 5321 paths with RFC 6531's UTF-8, domains as A-labels.

SUMMARY
    check(address) -> Mailbox | Invalid
    a_label(domain) -> str | None       IDN (U-labels) to A-labels, lower case
    LOCAL_PART, DOMAIN                  the rules as regular expressions

DESCRIPTION
    One definition of "an address we may send to", shared by the HTTP
    injection API (sluice.api.injector) and the sendout pipeline, which
    applies LOCAL_PART and DOMAIN as Spark ``rlike`` expressions and calls
    a_label() for the few domains that are not ASCII.  The patterns are
    written in the dialect Python's ``re`` and Java's regex share.

    A mailbox is Local-part "@" Domain (RFC 5321 4.1.2):

    - the local part is a Dot-string (atoms of atext joined by single
      dots) or a Quoted-string; RFC 6531 adds any UTF-8 beyond ASCII to
      both;
    - the domain is two or more LDH labels (RFC 5321 Domain, RFC 1035),
      after an internationalised domain is turned into A-labels with
      IDNA 2008 and the UTS 46 mapping (the ``idna`` package), which also
      lower-cases it.  The local part keeps its case (RFC 5321 2.4).

    Limits (RFC 5321 4.5.3.1): local part 64 octets, domain 253 octets
    (255 with the brackets of a path), the whole address 254 octets.

LIMITATIONS
    Address literals (``user@[192.0.2.1]``) and single-label domains are
    refused: legal on a LAN, never right in a campaign list.

SEE ALSO
    RFC 5321, RFC 6531, RFC 5890-5893 (IDNA 2008), UTS 46
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import idna

__all__ = [
    "BAD_DOMAIN",
    "BAD_IDN",
    "BAD_LOCAL",
    "DOMAIN",
    "LITERAL",
    "LOCAL_PART",
    "LONG_ADDRESS",
    "LONG_LOCAL",
    "MAX_ADDRESS_OCTETS",
    "MAX_DOMAIN_OCTETS",
    "MAX_LOCAL_OCTETS",
    "NO_AT",
    "Invalid",
    "Mailbox",
    "a_label",
    "check",
]

_ATEXT = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]|[^\x00-\x7F]"
#: RFC 5321 Local-part: Dot-string or Quoted-string, UTF-8 allowed (RFC 6531).
LOCAL_PART = (
    rf"(?:(?:{_ATEXT})+(?:\.(?:{_ATEXT})+)*"
    r'|"(?:[\x20\x21\x23-\x5B\x5D-\x7E]|[^\x00-\x7F]|\\[\x20-\x7E])*")'
)
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
#: A domain of two or more LDH labels (A-labels for IDNs).
DOMAIN = rf"(?:{_LABEL}\.)+{_LABEL}"

MAX_LOCAL_OCTETS = 64
MAX_DOMAIN_OCTETS = 253
MAX_ADDRESS_OCTETS = 254

#: Why an address is refused (the sendout's "invalid" outcomes say the same).
NO_AT = "no local part and domain"
BAD_LOCAL = "local part is not RFC 5321/6531 syntax"
LONG_LOCAL = f"local part longer than {MAX_LOCAL_OCTETS} octets"
LITERAL = "address literals are not accepted"
BAD_IDN = "domain is not a valid internationalised domain name"
BAD_DOMAIN = "domain is not a valid host name of two or more labels"
LONG_ADDRESS = f"address longer than {MAX_ADDRESS_OCTETS} octets"

_LOCAL_RE = re.compile(LOCAL_PART)
_DOMAIN_RE = re.compile(DOMAIN)


@dataclass(frozen=True, slots=True)
class Mailbox:
    """A valid address, its domain in A-labels and lower case."""

    address: str
    local: str
    domain: str


@dataclass(frozen=True, slots=True)
class Invalid:
    """Why check() refused an address."""
    reason: str


def a_label(domain: str) -> str | None:
    """``domain`` as lower-case A-labels, or None if it is not a valid IDN."""
    name = domain.strip().rstrip(".")
    if not name:
        return None
    if name.isascii():
        return name.lower()
    try:
        return idna.encode(name, uts46=True).decode("ascii").lower()
    except (idna.IDNAError, UnicodeError):
        return None


def check(address: str) -> Mailbox | Invalid:
    """Whether ``address`` is a mailbox we may send to, and its normal form."""
    text = address.strip()
    if text.startswith("<") and text.endswith(">"):
        text = text[1:-1].strip()
    local, at, domain = text.rpartition("@")
    if not at or not local:
        return Invalid(NO_AT)
    if _LOCAL_RE.fullmatch(local) is None:
        return Invalid(BAD_LOCAL)
    if len(local.encode("utf-8")) > MAX_LOCAL_OCTETS:
        return Invalid(LONG_LOCAL)
    if domain.startswith("["):
        return Invalid(LITERAL)
    ascii_domain = a_label(domain)
    if ascii_domain is None:
        return Invalid(BAD_IDN)
    if len(ascii_domain) > MAX_DOMAIN_OCTETS or _DOMAIN_RE.fullmatch(ascii_domain) is None:
        return Invalid(BAD_DOMAIN)
    normal = f"{local}@{ascii_domain}"
    if len(normal.encode("utf-8")) > MAX_ADDRESS_OCTETS:
        return Invalid(LONG_ADDRESS)
    return Mailbox(normal, local, ascii_domain)
