"""The transport map: where mail for a domain goes instead of its MX (Postfix transport(5)).

SUMMARY
    TransportEntry.parse("smtp:[127.0.0.1]:2526") -> TransportEntry
    TransportMap.parse(mapping) -> TransportMap
    TransportMap.lookup(domain, transportid) -> TransportEntry | None

DESCRIPTION
    ``delivery.transport`` maps a key to a value, as Postfix's transport(5):

    keys     ``example.com``    that domain only
             ``.example.com``   any subdomain of example.com (not the domain)
             ``*``              every domain not matched otherwise
             ``bulk/example.com``, ``bulk/.example.com``, ``bulk/*``
                                the same, only for entries whose transportid
                                is ``bulk`` (a Sluice addition; these win
                                over keys without a transportid)
    values   ``transport:nexthop`` where transport is
             ``smtp``           SMTP; nexthop ``host``, ``host:port``,
                                ``[host]``, ``[host]:port``, or several of
                                them separated by commas (tried in order).
                                Brackets mean "no MX lookup": connect to the
                                host's addresses.  Without brackets the
                                host's MX records are used, as for a domain.
                                An empty nexthop means the recipient domain.
             ``lmtp``           LMTP (RFC 2033); nexthop ``host:port``,
                                ``[host]:port``, ``inet:host:port``; never
                                an MX lookup; the port defaults to 24.
             ``error``          bounce with the text after the colon,
                                e.g. ``error:5.1.1 mailbox unavailable``.
             ``retry``          defer with the text after the colon.
             An empty transport (``:[host]``) means smtp.

    IPv6 addresses are written in brackets (``[::1]:25`` or Postfix's
    ``[ipv6:::1]:25``).

STRATEGIES
    Most specific key first, as Postfix does: the full domain, then each
    parent domain as ``.parent`` from the nearest up, then ``*``; with a
    transportid, the same walk with the ``transportid/`` prefix comes first.
    Values are parsed once, when the map is loaded, so that a mistake is a
    configuration error naming the key, never a delivery failure.

INVARIANTS
    Keys are lower case without a trailing dot.

SEE ALSO
    transport(5) of Postfix, sluice.delivery.router, docs/delivery.md
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

__all__ = ["Gateway", "Service", "TransportEntry", "TransportMap", "TransportMapError"]

DEFAULT_LMTP_PORT = 24


class TransportMapError(ValueError):
    """A transport map entry or a nexthop cannot be understood."""


class Service(StrEnum):
    """What a transport map value asks for."""

    SMTP = "smtp"
    LMTP = "lmtp"
    ERROR = "error"  # bounce with the given text
    RETRY = "retry"  # defer with the given text


@dataclass(frozen=True, slots=True)
class Gateway:
    """One host of a nexthop: ``host`` is a name or an IP literal.

    ``mx``: look up the host's MX records (a bare name with smtp).
    ``port``: 0 means the transport's default port.
    """

    host: str
    port: int = 0
    mx: bool = False

    @property
    def is_ip(self) -> bool:
        """Whether the gateway's host is an IP address rather than a name."""
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            return False
        return True

    def __str__(self) -> str:
        host = f"[{self.host}]" if not self.mx else self.host
        return f"{host}:{self.port}" if self.port else host


@dataclass(frozen=True, slots=True)
class TransportEntry:
    """A parsed transport map value.

    ``gateways`` is empty when the recipient domain itself is the nexthop
    (MX lookup).  ``text`` is the message of error: and retry: values.
    """

    service: Service
    gateways: tuple[Gateway, ...] = ()
    text: str = ""

    @classmethod
    def parse(cls, value: str) -> TransportEntry:
        """Parse ``transport:nexthop``; TransportMapError says what is wrong."""
        text = value.strip()
        name, sep, rest = text.partition(":")
        if not sep:
            raise TransportMapError(f"{value!r} is not transport:nexthop (e.g. smtp:[host]:25)")
        name = name.strip().lower() or "smtp"
        try:
            service = Service(name)
        except ValueError:
            raise TransportMapError(
                f"unknown transport {name!r} in {value!r} (smtp, lmtp, error, retry)") from None
        rest = rest.strip()
        if service in (Service.ERROR, Service.RETRY):
            return cls(service, (), rest)
        if not rest:
            if service is Service.LMTP:
                raise TransportMapError(f"{value!r}: lmtp needs a host (lmtp:host:port)")
            return cls(service)
        gateways = tuple(
            _parse_gateway(part.strip(), service, value)
            for part in rest.replace(" ", ",").split(",") if part.strip()
        )
        return cls(service, gateways)

    def __str__(self) -> str:
        if self.service in (Service.ERROR, Service.RETRY):
            return f"{self.service}:{self.text}"
        return f"{self.service}:" + ",".join(str(g) for g in self.gateways)


def _parse_gateway(part: str, service: Service, value: str) -> Gateway:
    if service is Service.LMTP and part.startswith("inet:"):
        part = part[5:]
    if part.startswith("unix:") or part.startswith("/"):
        raise TransportMapError(f"{value!r}: UNIX-domain sockets are not supported")
    port = 0
    if part.startswith("["):
        host, sep, tail = part[1:].partition("]")
        if not sep:
            raise TransportMapError(f"{value!r}: missing ']'")
        if host.lower().startswith("ipv6:"):
            host = host[5:]
        bracketed = True
        if tail:
            if not tail.startswith(":"):
                raise TransportMapError(f"{value!r}: expected ':port' after ']'")
            port = _port(tail[1:], value)
    else:
        bracketed = False
        host, sep, tail = part.rpartition(":")
        if not sep:
            host = tail
        elif ":" in host:
            raise TransportMapError(f"{value!r}: write IPv6 addresses in brackets")
        else:
            port = _port(tail, value)
    host = host.strip().rstrip(".").lower()
    if not host:
        raise TransportMapError(f"{value!r}: empty host")
    if service is Service.LMTP and not port:
        port = DEFAULT_LMTP_PORT
    gw = Gateway(host, port, mx=False)
    # smtp without brackets looks up MX records, unless the host is an IP.
    mx = service is Service.SMTP and not bracketed and not gw.is_ip
    return Gateway(host, port, mx=mx)


def _port(text: str, value: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise TransportMapError(f"{value!r}: {text!r} is not a port number") from None
    if not 0 < port < 65536:
        raise TransportMapError(f"{value!r}: port {port} is out of range")
    return port


@dataclass(frozen=True, slots=True)
class TransportMap:
    """A parsed ``delivery.transport``; empty maps route everything by MX."""

    entries: Mapping[str, TransportEntry]

    @classmethod
    def parse(cls, mapping: Mapping[str, str]) -> TransportMap:
        """Parse every entry; TransportMapError names the first bad key."""
        entries: dict[str, TransportEntry] = {}
        for key, value in mapping.items():
            norm = key.strip().lower().rstrip(".")
            if not norm or (norm != "*" and norm.endswith("/")):
                raise TransportMapError(f"key {key!r}: not a domain, .domain or *")
            try:
                entries[norm] = TransportEntry.parse(str(value))
            except TransportMapError as exc:
                raise TransportMapError(f"key {key!r}: {exc}") from None
        return cls(entries)

    def lookup(self, domain: str, transportid: str = "") -> TransportEntry | None:
        """The most specific entry for ``domain`` (see STRATEGIES), or None."""
        if not self.entries:
            return None
        domain = domain.lower().rstrip(".")
        prefixes = (f"{transportid}/", "") if transportid else ("",)
        for prefix in prefixes:
            found = self.entries.get(prefix + domain)
            if found is not None:
                return found
            labels = domain.split(".")
            for i in range(1, len(labels)):
                found = self.entries.get(prefix + "." + ".".join(labels[i:]))
                if found is not None:
                    return found
            found = self.entries.get(prefix + "*")
            if found is not None:
                return found
        return None
