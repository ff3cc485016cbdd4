"""Routing: which hosts receive a domain's mail, by transport map or DNS.

SUMMARY
    Router(DeliveryConfig) -> await .route(domain, transportid="", nexthop=None)
        -> NextHop | TempFail | PermFail

DESCRIPTION
    A NextHop names the transport (smtp or lmtp), the hosts to try in order
    (MX name, IP, port) and the *destination*: the key under which the
    scheduler counts slow start and remembers dead destinations.  Mail for
    several domains relayed to one gateway shares that gateway's
    destination, as Postfix's queues are per nexthop.

    Order of decisions, first match wins:

    1. ``nexthop`` given by the pre-delivery hook (transport(5) syntax);
    2. the transport map (``delivery.transport``), see sluice.delivery.transport;
    3. DNS: the domain's MX records (RFC 5321 5.1).

    DNS rules:
    - MX records by preference, lowest first; hosts of equal preference in
      random order, so load spreads as the domain intends.
    - No MX records: the domain itself is the one host (implicit MX).
    - Null MX (RFC 7505, "0 ."): the domain accepts no mail; PermFail
      556 5.1.10 without a connection attempt.
    - NXDOMAIN: PermFail 550 5.1.2.  SERVFAIL or a timeout: TempFail
      451 4.4.3, so the entry is retried when DNS works again.
    - Each MX host's A and AAAA records, in ``resolver.inet_protocols``
      order; hosts that do not resolve are skipped; at most
      ``mx_address_limit`` addresses in all.  If no host resolves, the
      failure is temporary if any lookup failed temporarily.

STRATEGIES
    Parse once.  Transport map values are parsed when the router is built;
    a value that names IP literals yields a NextHop built once and shared.

    Cache the resolved hosts.  A domain's MX hosts with their addresses are
    kept until the shortest TTL among the records used (bounded, least
    recently used out, by ``resolver.cache_size``), so a routed domain
    costs a dictionary lookup and a shuffle, not seven resolver calls.  A
    result in which some MX host failed only for now is not kept, so that
    host is asked again on the next route.  Negative answers are left to
    the resolver's own cache (sluice.delivery.resolver).

INVARIANTS
    A NextHop has at least one host.  Its destination is the domain for
    DNS routes and the transport map value (``smtp:[192.0.2.1]:25``) for
    mapped ones.

SEE ALSO
    sluice.delivery.resolver, sluice.delivery.transport, RFC 7505, RFC 5321 5.1
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import OrderedDict
from dataclasses import dataclass

from sluice.config import Config, ConfigError, DeliveryConfig
from sluice.delivery.resolver import NO_RECORDS, Addresses, DnsFailure, MxRecords, Resolver
from sluice.delivery.transport import (
    Gateway,
    Service,
    TransportEntry,
    TransportMap,
    TransportMapError,
)
from sluice.model import PermFail, Reply, TempFail
from sluice.scheduler.events import Transport

__all__ = ["Host", "NextHop", "Router"]

NULL_MX_REPLY_CODE = (556, "5.1.10")


@dataclass(frozen=True, slots=True)
class Host:
    """One address to connect to.

    ``name`` is the MX (or gateway) host name, or the IP itself for an
    address literal.
    """

    name: str
    ip: str
    port: int
    preference: int = 0

    def __str__(self) -> str:
        ip = f"[{self.ip}]" if ":" in self.ip else self.ip
        return f"{self.name}[{ip}]:{self.port}"


@dataclass(frozen=True, slots=True)
class NextHop:
    """Where a delivery goes: transport, hosts in the order to try, destination key."""

    transport: Transport
    hosts: tuple[Host, ...]
    destination: str

    def __post_init__(self) -> None:
        if not self.hosts:
            raise ValueError(f"a route to {self.destination} needs at least one host")

    @property
    def remotemx(self) -> str:
        """The first host's name (what pickup policies call remotemx)."""
        return self.hosts[0].name

    @property
    def remoteip(self) -> str:
        """The address tried first."""
        return self.hosts[0].ip


Routing = NextHop | TempFail | PermFail


#: Next hops given by hooks (not in the map) that a router keeps built, at most.
HOOK_NEXTHOPS = 1024


class Router:
    """Routes domains to next hops; one per process, shared by all deliveries."""

    @classmethod
    def from_config(cls, config: Config, *, rng: random.Random | None = None) -> Router:
        """The router for ``config``; ConfigError names the bad key."""
        try:
            return cls(config.delivery, rng=rng)
        except TransportMapError as exc:
            raise ConfigError(config.source, "delivery.transport", str(exc)) from None
        except ValueError as exc:
            raise ConfigError(config.source, "delivery.resolver.nameservers",
                              str(exc)) from None

    def __init__(self, config: DeliveryConfig, *, rng: random.Random | None = None) -> None:
        self.config = config
        self.port = config.port
        self.families = tuple(config.resolver.inet_protocols)
        self.address_limit = config.mx_address_limit
        self.transport_map = TransportMap.parse(config.transport)
        self.resolver = Resolver(config.resolver)
        self._rng = rng or random.Random()
        # Values whose hosts are all IP literals need no DNS: each NextHop is
        # built once, for the map's values and the hooks' nexthops alike.
        # Room for every value of the map (a map of 10,000 domains each to
        # its own address rebuilt most routes with room for 1,024) and for
        # HOOK_NEXTHOPS more.
        self._static: dict[TransportEntry, NextHop] = {}
        self._static_max = len(set(self.transport_map.entries.values())) + HOOK_NEXTHOPS
        self._parsed: dict[str, TransportEntry] = {}
        self._cache = _HostCache(config.resolver.cache_size)

    async def route(self, domain: str, transportid: str = "",
                    nexthop: str | None = None) -> Routing:
        """Route ``domain``; ``nexthop`` (transport(5) syntax) overrides the map.

        Raises ValueError for a malformed ``nexthop`` (the caller's misuse:
        hooks' values are checked where they are returned).
        """
        domain = domain.lower().rstrip(".")
        if nexthop is not None:
            entry = self._parsed.get(nexthop)
            if entry is None:
                entry = TransportEntry.parse(nexthop)
                if len(self._parsed) < HOOK_NEXTHOPS:  # hooks tend to reuse a few values
                    self._parsed[nexthop] = entry
        else:
            found = self.transport_map.lookup(domain, transportid)
            if found is None:
                return await self._route_mx(domain, domain, Transport.SMTP, self.port)
            entry = found
        return await self._route_entry(domain, entry)

    async def _route_entry(self, domain: str, entry: TransportEntry) -> Routing:
        if entry.service is Service.ERROR:
            return PermFail(_reply_from_text(entry.text, 550, "5.0.0", "mail for this domain "
                                             "is refused by the transport map"))
        if entry.service is Service.RETRY:
            return TempFail(_reply_from_text(entry.text, 450, "4.3.0", "mail for this domain "
                                             "is deferred by the transport map"))
        static = self._static.get(entry)
        if static is not None:
            return static
        transport = Transport(entry.service.value)
        destination = str(entry)
        if not entry.gateways:  # "smtp:" -- the recipient domain, by MX
            return await self._route_mx(domain, domain, transport, self.port)
        if all(g.is_ip for g in entry.gateways):
            hop = NextHop(transport, tuple(Host(g.host, g.host, g.port or self.port)
                                           for g in entry.gateways), destination)
            if len(self._static) < self._static_max:
                self._static[entry] = hop
            return hop
        hosts: list[Host] = []
        failures: list[DnsFailure] = []
        for gw in entry.gateways:
            got = await self._gateway_hosts(gw, transport)
            if isinstance(got, DnsFailure):
                failures.append(got)
            else:
                hosts.extend(got)
        if hosts:
            return NextHop(transport, tuple(hosts[: max(self.address_limit, 1)]), destination)
        return _lookup_failed(failures, f"nexthop {destination}")

    async def _gateway_hosts(self, gw: Gateway, transport: Transport
                             ) -> list[Host] | DnsFailure:
        port = gw.port or self.port
        if gw.is_ip:
            return [Host(gw.host, gw.host, port)]
        if gw.mx:
            routed = await self._route_mx(gw.host, gw.host, transport, port)
            if isinstance(routed, NextHop):
                return list(routed.hosts)
            return DnsFailure(isinstance(routed, PermFail), routed.reply.text)
        key = f"[{gw.host}]"
        levels = self._cache.get(key, time.time())
        if levels is None:
            got = await self.resolver.addresses(gw.host, self.families)
            if isinstance(got, DnsFailure):
                return got
            if got is NO_RECORDS:
                return DnsFailure(True, f"{gw.host}: host has no address record")
            assert isinstance(got, Addresses)
            levels = ((0, ((gw.host, got.ips),)),)
            self._cache.put(key, got.expires_at, levels)
        return self._hosts(levels, port)

    async def _route_mx(self, domain: str, destination: str, transport: Transport,
                        port: int) -> Routing:
        levels = self._cache.get(domain, time.time())
        if levels is None:
            resolved = await self._resolve_mx(domain)
            if not isinstance(resolved, tuple):
                return resolved
            levels, expires_at = resolved
            self._cache.put(domain, expires_at, levels)
        return NextHop(transport, tuple(self._hosts(levels, port)), destination)

    async def _resolve_mx(self, domain: str) -> tuple[_Levels, float] | TempFail | PermFail:
        """The domain's MX hosts with their addresses, grouped by preference; or why none.

        With the hosts, when that answer expires.
        """
        mx = await self.resolver.mx(domain)
        if isinstance(mx, DnsFailure):
            if mx.permanent:
                return PermFail(Reply(550, "5.1.2", f"domain {domain} not found: {mx.reason}"))
            return TempFail(Reply(451, "4.4.3", f"DNS lookup of {domain} failed: {mx.reason}"))
        if mx is NO_RECORDS:
            records: tuple[tuple[int, str], ...] = ((0, domain),)  # implicit MX, RFC 5321 5.1
            expires_at = float("inf")
        else:
            assert isinstance(mx, MxRecords)
            if any(name == "" for _, name in mx.records):
                code, enhanced = NULL_MX_REPLY_CODE
                return PermFail(Reply(code, enhanced,
                                      f"domain {domain} accepts no mail (null MX, RFC 7505)"))
            records = tuple(sorted(set(mx.records)))
            expires_at = mx.expires_at
        names = list(dict.fromkeys(name for _, name in records))
        lookups = dict(zip(names, await asyncio.gather(
            *(self.resolver.addresses(name, self.families) for name in names)), strict=True))
        levels: dict[int, list[tuple[str, tuple[str, ...]]]] = {}
        failures: list[DnsFailure] = []
        placed: set[str] = set()
        for pref, name in records:
            got = lookups[name]
            if isinstance(got, DnsFailure):
                failures.append(got)
            elif isinstance(got, Addresses):
                if name not in placed:  # listed twice: keep the better preference
                    placed.add(name)
                    levels.setdefault(pref, []).append((name, got.ips))
                    expires_at = min(expires_at, got.expires_at)
            else:
                failures.append(DnsFailure(True, f"{name}: host has no address record"))
        if levels:
            if any(not f.permanent for f in failures):
                # A host that failed for now must be tried again soon: don't
                # let the cache hide it for the whole TTL.
                expires_at = 0.0
            return tuple((pref, tuple(hosts)) for pref, hosts in sorted(levels.items())), \
                expires_at
        if mx is NO_RECORDS and all(f.permanent for f in failures):
            return PermFail(Reply(550, "5.1.2",
                                  f"domain {domain} has no MX and no address record"))
        return _lookup_failed(failures, f"MX hosts of {domain}")

    def _hosts(self, levels: _Levels, port: int) -> list[Host]:
        """Hosts by preference, at most mx_address_limit addresses.

        Equal preferences come in random order (RFC 5321 5.1).
        """
        out: list[Host] = []
        limit = max(self.address_limit, 1)
        for pref, names in levels:
            if len(names) > 1:
                shuffled = list(names)
                self._rng.shuffle(shuffled)
                names = tuple(shuffled)
            for name, ips in names:
                out.extend(Host(name, ip, port, pref) for ip in ips)
                if len(out) >= limit:
                    return out[:limit]
        return out


#: MX hosts with their addresses, grouped by preference, best first.
_Levels = tuple[tuple[int, tuple[tuple[str, tuple[str, ...]], ...]], ...]


class _HostCache:
    """Resolved MX hosts per domain until the shortest TTL among the records used.

    Least recently used first out beyond ``size`` domains.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.data: OrderedDict[str, tuple[float, _Levels]] = OrderedDict()

    def get(self, key: str, now: float) -> _Levels | None:
        item = self.data.get(key)
        if item is None:
            return None
        if item[0] <= now:
            del self.data[key]
            return None
        self.data.move_to_end(key)
        return item[1]

    def put(self, key: str, expires_at: float, levels: _Levels) -> None:
        if self.size <= 0:
            return
        self.data[key] = (expires_at, levels)
        self.data.move_to_end(key)
        while len(self.data) > self.size:
            self.data.popitem(last=False)


def _lookup_failed(failures: list[DnsFailure], what: str) -> TempFail | PermFail:
    reasons = "; ".join(f.reason for f in failures[:3]) or "no addresses"
    if any(not f.permanent for f in failures):
        return TempFail(Reply(451, "4.4.3", f"cannot resolve {what}: {reasons}"))
    return PermFail(Reply(550, "5.4.4", f"cannot resolve {what}: {reasons}"))


def _reply_from_text(text: str, code: int, enhanced: str, default: str) -> Reply:
    """A reply from an error:/retry: text that may start with an enhanced code."""
    head, _, rest = text.strip().partition(" ")
    parts = head.split(".")
    if len(parts) == 3 and all(p.isdigit() for p in parts) and head[0] == enhanced[0]:
        return Reply(code, head, rest.strip() or default)
    return Reply(code, enhanced, text.strip() or default)
