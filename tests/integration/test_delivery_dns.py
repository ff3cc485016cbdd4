"""Routing against a real authoritative DNS server on 127.0.0.1 (UDP and TCP)."""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Iterator

import pytest

from sluice.config import config_from_dict
from sluice.delivery.router import Host, NextHop, Router
from sluice.model import PermFail, Reply, TempFail
from sluice.scheduler.events import Transport
from tests.integration.test_delivery_peers import SOA, AuthoritativeDns, dns_server, run

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def dns() -> Iterator[AuthoritativeDns]:
    with dns_server() as server:
        z = server
        z.add("example.test", "SOA", SOA)
        # MX by preference, two hosts share preference 10.
        z.add("pref.example.test", "MX", "20 backup.example.test.", "10 mx-a.example.test.",
              "10 mx-b.example.test.")
        z.add("mx-a.example.test", "A", "127.0.0.11")
        z.add("mx-b.example.test", "A", "127.0.0.12")
        z.add("backup.example.test", "A", "127.0.0.13")
        z.add("backup.example.test", "AAAA", "::1")
        # Implicit MX: no MX, but an address.
        z.add("implicit.example.test", "A", "127.0.0.21")
        # Null MX (RFC 7505).
        z.add("nullmx.example.test", "MX", "0 .")
        z.add("nullmx.example.test", "A", "127.0.0.22")
        # Exists with a TXT record only: no MX, no address.
        z.add("noaddr.example.test", "TXT", '"hello"')
        # MX hosts that do not resolve, one of them temporarily.
        z.add("badmx.example.test", "MX", "10 gone.example.test.")
        z.add("flaky.example.test", "MX", "10 gone.example.test.", "20 broken.example.test.")
        z.servfail.add("broken.example.test")
        z.servfail.add("servfail.example.test")
        z.silent.add("silent.example.test")
        # One MX fails for now, the other works.
        z.add("partial.example.test", "MX", "10 broken.example.test.", "20 mx-b.example.test.")
        # One MX good, one missing: skip the missing one.
        z.add("half.example.test", "MX", "10 gone.example.test.", "20 mx-a.example.test.")
        # Short TTL for the cache test.
        z.add("ttl.example.test", "MX", "10 mx-a.example.test.", ttl=1)
        # Too many addresses for UDP: the answer comes over TCP.
        z.add("big.example.test", "MX", "10 big-mx.example.test.")
        z.add("big-mx.example.test", "A", *(f"127.1.{i // 250}.{i % 250 + 1}" for i in range(120)))
        yield server


def router(dns: AuthoritativeDns, seed: int = 1, **delivery: object) -> Router:
    cfg = config_from_dict({"delivery": {
        "port": 2525,
        "resolver": {"nameservers": ["127.0.0.1"], "port": dns.port, "timeout": "1s",
                     **delivery.pop("resolver", {})},  # type: ignore[dict-item]
        **delivery}})
    return Router(cfg.delivery, rng=random.Random(seed))


def test_mx_by_preference_with_addresses(dns: AuthoritativeDns) -> None:
    hop = run(router(dns).route("pref.example.test"))
    assert isinstance(hop, NextHop)
    assert hop.transport is Transport.SMTP
    assert hop.destination == "pref.example.test"
    names = [h.name for h in hop.hosts]
    assert sorted(names[:2]) == ["mx-a.example.test", "mx-b.example.test"]
    assert hop.hosts[2:] == (Host("backup.example.test", "127.0.0.13", 2525, 20),
                             Host("backup.example.test", "::1", 2525, 20))
    assert hop.remotemx == names[0] and hop.remoteip == hop.hosts[0].ip


def test_equal_preferences_are_shuffled(dns: AuthoritativeDns) -> None:
    r = router(dns, seed=7)
    firsts = Counter()
    for _ in range(60):
        hop = run(r.route("pref.example.test"))
        assert isinstance(hop, NextHop)
        firsts[hop.remotemx] += 1
        assert hop.hosts[-1].name == "backup.example.test"  # never ahead of preference 10
    assert set(firsts) == {"mx-a.example.test", "mx-b.example.test"}
    assert min(firsts.values()) >= 10


def test_inet_protocols_order_and_filter(dns: AuthoritativeDns) -> None:
    hop = run(router(dns, resolver={"inet_protocols": ["ipv6", "ipv4"]}).route(
        "pref.example.test"))
    assert isinstance(hop, NextHop)
    assert [h.ip for h in hop.hosts if h.name == "backup.example.test"] == ["::1", "127.0.0.13"]
    hop = run(router(dns, resolver={"inet_protocols": ["ipv4"]}).route("pref.example.test"))
    assert isinstance(hop, NextHop)
    assert "::1" not in [h.ip for h in hop.hosts]


def test_implicit_mx(dns: AuthoritativeDns) -> None:
    hop = run(router(dns).route("implicit.example.test"))
    assert hop == NextHop(Transport.SMTP, (Host("implicit.example.test", "127.0.0.21", 2525),),
                          "implicit.example.test")


def test_null_mx_bounces_without_trying(dns: AuthoritativeDns) -> None:
    got = run(router(dns).route("nullmx.example.test"))
    assert isinstance(got, PermFail)
    assert (got.reply.code, got.reply.enhanced) == (556, "5.1.10")
    assert "null MX" in got.reply.text
    assert dns.count("nullmx.example.test", "A") == 0  # no address lookup after a null MX


def test_nxdomain_is_permanent(dns: AuthoritativeDns) -> None:
    got = run(router(dns).route("nowhere.example.test"))
    assert isinstance(got, PermFail)
    assert (got.reply.code, got.reply.enhanced) == (550, "5.1.2")
    assert "nowhere.example.test" in got.reply.text and "NXDOMAIN" in got.reply.text


def test_no_mx_and_no_address_is_permanent(dns: AuthoritativeDns) -> None:
    got = run(router(dns).route("noaddr.example.test"))
    assert got == PermFail(Reply(550, "5.1.2",
                                 "domain noaddr.example.test has no MX and no address record"))


def test_servfail_and_timeout_are_temporary(dns: AuthoritativeDns) -> None:
    got = run(router(dns).route("servfail.example.test"))
    assert isinstance(got, TempFail)
    assert (got.reply.code, got.reply.enhanced) == (451, "4.4.3")
    assert "SERVFAIL" in got.reply.text
    started = time.monotonic()
    got = run(router(dns, resolver={"timeout": "0.3s"}).route("silent.example.test"))
    assert isinstance(got, TempFail) and got.reply.enhanced == "4.4.3"
    assert "timeout" in got.reply.text
    assert time.monotonic() - started < 2


def test_unresolvable_mx_hosts(dns: AuthoritativeDns) -> None:
    got = run(router(dns).route("badmx.example.test"))
    assert isinstance(got, PermFail) and got.reply.enhanced == "5.4.4"
    assert "gone.example.test" in got.reply.text
    # One permanent and one temporary failure: try again later.
    got = run(router(dns).route("flaky.example.test"))
    assert isinstance(got, TempFail) and got.reply.enhanced == "4.4.3"
    # A host that does not resolve is skipped when another does.
    hop = run(router(dns).route("half.example.test"))
    assert isinstance(hop, NextHop) and [h.name for h in hop.hosts] == ["mx-a.example.test"]


def test_answers_are_cached_for_their_ttl(dns: AuthoritativeDns) -> None:
    r = router(dns)

    async def twice() -> None:
        for _ in range(2):
            assert isinstance(await r.route("ttl.example.test"), NextHop)
            assert isinstance(await r.route("nowhere2.example.test"), PermFail)

    before_mx = dns.count("ttl.example.test", "MX")
    before_nx = dns.count("nowhere2.example.test", "MX")
    run(twice())
    assert dns.count("ttl.example.test", "MX") == before_mx + 1
    assert dns.count("nowhere2.example.test", "MX") == before_nx + 1  # NXDOMAIN cached too
    time.sleep(1.1)  # the MX record's TTL is 1 s; the SOA minimum (60 s) keeps NXDOMAIN
    run(twice())
    assert dns.count("ttl.example.test", "MX") == before_mx + 2
    assert dns.count("nowhere2.example.test", "MX") == before_nx + 1


def test_a_host_that_failed_for_now_is_asked_again(dns: AuthoritativeDns) -> None:
    r = router(dns)
    before = dns.count("broken.example.test", "A")
    for _ in range(2):
        hop = run(r.route("partial.example.test"))
        assert isinstance(hop, NextHop) and [h.name for h in hop.hosts] == ["mx-b.example.test"]
    assert dns.count("broken.example.test", "A") == before + 2


def test_servfail_is_not_cached(dns: AuthoritativeDns) -> None:
    r = router(dns)
    before = dns.count("servfail.example.test", "MX")
    for _ in range(2):
        assert isinstance(run(r.route("servfail.example.test")), TempFail)
    assert dns.count("servfail.example.test", "MX") >= before + 2


def test_cache_size_bounds_the_cache(dns: AuthoritativeDns) -> None:
    r = router(dns, resolver={"cache_size": 2})
    for name in ("pref.example.test", "implicit.example.test", "half.example.test"):
        run(r.route(name))
    cache = r.resolver.cache
    assert cache is not None and len(cache.data) <= 2
    assert len(r._cache.data) <= 2
    assert router(dns, resolver={"cache_size": 0}).resolver.cache is None


def test_truncated_answers_come_over_tcp(dns: AuthoritativeDns) -> None:
    hop = run(router(dns, mx_address_limit=5).route("big.example.test"))
    assert isinstance(hop, NextHop) and len(hop.hosts) == 5
    assert ("big-mx.example.test", "A", "tcp") in dns.queries


def test_transport_map_wins_over_dns(dns: AuthoritativeDns) -> None:
    r = router(dns, transport={
        "pref.example.test": "smtp:[127.0.0.1]:2600",
        ".sub.example.test": "lmtp:127.0.0.5:2424",
        "viamx.example.test": "smtp:pref.example.test:2700",
        "named.example.test": "smtp:[mx-a.example.test]",
        "refused.example.test": "error:5.7.1 we do not deliver there",
        "later.example.test": "retry:maintenance window",
    })
    assert run(r.route("pref.example.test")) == NextHop(
        Transport.SMTP, (Host("127.0.0.1", "127.0.0.1", 2600),), "smtp:[127.0.0.1]:2600")
    assert run(r.route("x.sub.example.test")) == NextHop(
        Transport.LMTP, (Host("127.0.0.5", "127.0.0.5", 2424),), "lmtp:[127.0.0.5]:2424")
    via = run(r.route("viamx.example.test"))
    assert isinstance(via, NextHop) and via.destination == "smtp:pref.example.test:2700"
    assert {h.port for h in via.hosts} == {2700}
    assert via.hosts[-1].name == "backup.example.test"
    assert run(r.route("named.example.test")) == NextHop(
        Transport.SMTP, (Host("mx-a.example.test", "127.0.0.11", 2525),),
        "smtp:[mx-a.example.test]")
    assert run(r.route("refused.example.test")) == PermFail(
        Reply(550, "5.7.1", "we do not deliver there"))
    assert run(r.route("later.example.test")) == TempFail(
        Reply(450, "4.3.0", "maintenance window"))


def test_a_hook_nexthop_overrides_everything(dns: AuthoritativeDns) -> None:
    r = router(dns, transport={"*": "smtp:[127.0.0.1]:2600"})
    hop = run(r.route("pref.example.test", nexthop="lmtp:[127.0.0.9]:24"))
    assert hop == NextHop(Transport.LMTP, (Host("127.0.0.9", "127.0.0.9", 24),),
                          "lmtp:[127.0.0.9]:24")
    with pytest.raises(ValueError, match="unknown transport"):
        run(r.route("pref.example.test", nexthop="bogus:x"))
