"""DNS for delivery: MX and address records as values, through dnspython's asyncio resolver.

SUMMARY
    Resolver(ResolverConfig) -> .mx(domain), .addresses(name, families)
    Each answers records, NO_RECORDS, or a DnsFailure (permanent or not).

DESCRIPTION
    The boundary between dnspython's exceptions and Sluice's outcomes.  A
    lookup ends in one of three ways:

    records          the answer (MX: preference and exchange name;
                     addresses: IP strings), with the smallest TTL seen.
    NO_RECORDS       the name exists but has no records of that type
                     (NOERROR/NODATA): for MX that means "implicit MX".
    DnsFailure       NXDOMAIN or a malformed name (permanent); SERVFAIL,
                     REFUSED, timeouts and lost servers (temporary).

    ``delivery.resolver.nameservers`` and ``.port`` name the servers; with
    no nameservers the system's resolv.conf is used.

STRATEGIES
    Cache with the TTLs.  Answers, NODATA and NXDOMAIN are kept in
    dnspython's LRU cache for their TTL (the SOA minimum for negative
    answers, RFC 2308), bounded by ``delivery.resolver.cache_size``
    entries; SERVFAIL and timeouts are never cached, so a recovered server
    is asked again at once.  A cached lookup does not yield to the loop.

LIMITATIONS
    No DNSSEC validation and hence no DANE; MX names are taken as given.

SEE ALSO
    RFC 5321 5.1 (locating the target host), RFC 2308 (negative caching),
    sluice.delivery.router
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import dns.asyncresolver
import dns.exception
import dns.name
import dns.rdatatype
import dns.resolver

from sluice.config import ResolverConfig

__all__ = ["NO_RECORDS", "Addresses", "DnsFailure", "MxRecords", "Resolver"]


class _NoRecords(Enum):
    NO_RECORDS = "no records"


#: The name exists but has no records of the asked type (NODATA).
NO_RECORDS = _NoRecords.NO_RECORDS


@dataclass(frozen=True, slots=True)
class DnsFailure:
    """A lookup that gave no usable answer; ``reason`` is for the bounce text."""

    permanent: bool
    reason: str


@dataclass(frozen=True, slots=True)
class MxRecords:
    """MX records as (preference, exchange) with the exchange lower case, no final dot.

    A null MX (RFC 7505) appears as the exchange "".  ``expires_at``: when
    the answer's TTL runs out (POSIX time).
    """

    records: tuple[tuple[int, str], ...]
    expires_at: float


@dataclass(frozen=True, slots=True)
class Addresses:
    """A host's IP addresses and when the answer expires."""
    ips: tuple[str, ...]
    expires_at: float


_TYPE = {"ipv4": dns.rdatatype.A, "ipv6": dns.rdatatype.AAAA}


class Resolver:
    """MX and address lookups with negative answers as values."""

    def __init__(self, config: ResolverConfig) -> None:
        configure = not config.nameservers
        res = dns.asyncresolver.Resolver(configure=configure)
        if not configure:
            for ns in config.nameservers:
                ipaddress.ip_address(ns)  # ValueError: the config check names the key
            res.nameservers = list(config.nameservers)
        res.port = config.port
        # Leave room for a second server (or a TCP retry) within the lifetime.
        res.lifetime = config.timeout
        res.timeout = config.timeout / 2 if len(res.nameservers) > 1 else config.timeout
        res.cache = dns.resolver.LRUCache(config.cache_size) if config.cache_size else None
        self._res = res

    @property
    def cache(self) -> dns.resolver.LRUCache | None:
        """The resolver's answer cache; None when ``cache_size`` is 0."""
        cache = self._res.cache
        return cache if isinstance(cache, dns.resolver.LRUCache) else None

    async def _query(self, name: str, rdtype: dns.rdatatype.RdataType
                     ) -> dns.resolver.Answer | _NoRecords | DnsFailure:
        what = f"{name} type={dns.rdatatype.to_text(rdtype)}"
        try:
            return await self._res.resolve(name + ".", rdtype, search=False)
        except dns.resolver.NXDOMAIN:
            return DnsFailure(True, f"{what}: name does not exist (NXDOMAIN)")
        except dns.resolver.NoAnswer:
            return NO_RECORDS
        except dns.resolver.LifetimeTimeout:
            return DnsFailure(False, f"{what}: no answer from the name servers (timeout)")
        except dns.resolver.NoNameservers as exc:
            return DnsFailure(False, f"{what}: name servers failed ({_first_error(exc)})")
        except dns.resolver.YXDOMAIN:
            return DnsFailure(False, f"{what}: name too long after DNAME substitution")
        except (dns.name.NameTooLong, dns.name.LabelTooLong, dns.name.EmptyLabel,
                dns.exception.SyntaxError) as exc:
            return DnsFailure(True, f"{what}: malformed name ({exc})")
        except dns.exception.DNSException as exc:
            return DnsFailure(False, f"{what}: {exc}")
        except OSError as exc:  # no route to the name server, socket limits
            return DnsFailure(False, f"{what}: {exc.strerror or exc}")

    async def mx(self, domain: str) -> MxRecords | _NoRecords | DnsFailure:
        """The domain's MX records, NO_RECORDS (implicit MX), or a failure."""
        answer = await self._query(domain, dns.rdatatype.MX)
        if not isinstance(answer, dns.resolver.Answer):
            return answer
        rrset = answer.rrset
        if rrset is None:
            return NO_RECORDS
        records = tuple(
            (int(rr.preference), rr.exchange.to_text(omit_final_dot=True).lower()
             if rr.exchange != dns.name.root else "")
            for rr in rrset
        )
        return MxRecords(records, answer.expiration)

    async def addresses(self, name: str, families: Sequence[str]
                        ) -> Addresses | _NoRecords | DnsFailure:
        """A and/or AAAA records of ``name`` in the order of ``families``.

        A failure of one family does not hide the other's addresses; when
        no family gives an address, the most telling failure is returned
        (temporary before permanent: "try again" beats "no such host").
        """
        ips: list[str] = []
        expires_at = float("inf")
        failures: list[DnsFailure] = []
        for family in families:
            answer = await self._query(name, _TYPE[family])
            if isinstance(answer, DnsFailure):
                failures.append(answer)
                if answer.permanent:  # NXDOMAIN holds for every type
                    break
                continue
            if answer is NO_RECORDS or answer.rrset is None:
                continue
            ips.extend(rr.address for rr in answer.rrset)
            expires_at = min(expires_at, answer.expiration)
        if ips:
            return Addresses(tuple(ips), expires_at)
        if failures:
            temporary = [f for f in failures if not f.permanent]
            return (temporary or failures)[0]
        return NO_RECORDS


def _first_error(exc: dns.resolver.NoNameservers) -> str:
    errors = exc.kwargs.get("errors") or []
    for _server, _tcp, _port, err, _response in errors:
        text = str(err)
        if text:
            return text
    return "no server answered"
