"""The transport map (Postfix transport(5) meaning) and the reply parser, without I/O."""

from __future__ import annotations

import pytest

from sluice.delivery.client import ServerReply, _extensions
from sluice.delivery.replies import ReplyReader
from sluice.delivery.transport import (
    Gateway,
    Service,
    TransportEntry,
    TransportMap,
    TransportMapError,
)
from sluice.model import Reply

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("value", "entry"),
    [
        ("smtp:[127.0.0.1]:2526", TransportEntry(Service.SMTP, (Gateway("127.0.0.1", 2526),))),
        ("smtp:[relay.example]", TransportEntry(Service.SMTP, (Gateway("relay.example"),))),
        ("smtp:relay.example:2525",
         TransportEntry(Service.SMTP, (Gateway("relay.example", 2525, mx=True),))),
        ("smtp:Relay.Example.", TransportEntry(Service.SMTP, (Gateway("relay.example", mx=True),))),
        ("smtp:", TransportEntry(Service.SMTP)),
        (":[10.0.0.1]", TransportEntry(Service.SMTP, (Gateway("10.0.0.1"),))),
        ("smtp:10.0.0.1:25", TransportEntry(Service.SMTP, (Gateway("10.0.0.1", 25),))),
        ("lmtp:127.0.0.1:24", TransportEntry(Service.LMTP, (Gateway("127.0.0.1", 24),))),
        ("lmtp:inet:localhost", TransportEntry(Service.LMTP, (Gateway("localhost", 24),))),
        ("lmtp:[::1]:2424", TransportEntry(Service.LMTP, (Gateway("::1", 2424),))),
        ("smtp:[ipv6:::1]:25", TransportEntry(Service.SMTP, (Gateway("::1", 25),))),
        ("smtp:[127.0.0.1]:2526, [127.0.0.2]:2527",
         TransportEntry(Service.SMTP, (Gateway("127.0.0.1", 2526), Gateway("127.0.0.2", 2527)))),
        ("error:5.1.1 mailbox unavailable",
         TransportEntry(Service.ERROR, (), "5.1.1 mailbox unavailable")),
        ("retry:maintenance", TransportEntry(Service.RETRY, (), "maintenance")),
    ],
)
def test_values_parse_as_postfix_reads_them(value: str, entry: TransportEntry) -> None:
    assert TransportEntry.parse(value) == entry


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("127.0.0.1", "is not transport:nexthop"),
        ("uucp:host", "unknown transport 'uucp'"),
        ("smtp:[127.0.0.1", "missing ']'"),
        ("smtp:[127.0.0.1]x", "expected ':port'"),
        ("smtp:host:port", "is not a port number"),
        ("smtp:host:70000", "out of range"),
        ("smtp:::1:25", "write IPv6 addresses in brackets"),
        ("lmtp:", "lmtp needs a host"),
        ("lmtp:unix:/var/run/lmtp", "UNIX-domain sockets are not supported"),
    ],
)
def test_bad_values_say_what_is_wrong(value: str, message: str) -> None:
    with pytest.raises(TransportMapError, match=message):
        TransportEntry.parse(value)


def test_lookup_order_is_most_specific_first() -> None:
    tm = TransportMap.parse({
        "example.com": "smtp:[10.0.0.1]",
        ".example.com": "smtp:[10.0.0.2]",
        ".deep.example.com": "smtp:[10.0.0.3]",
        "*": "lmtp:127.0.0.1:24",
        "bulk/example.com": "smtp:[10.0.0.9]",
        "bulk/*": "error:5.7.1 bulk is not allowed here",
    })
    hop = {k: str(tm.lookup(*k)) for k in [
        ("example.com", ""), ("EXAMPLE.COM.", ""), ("a.example.com", ""),
        ("x.deep.example.com", ""), ("deep.example.com", ""), ("other.org", ""),
        ("example.com", "bulk"), ("a.example.com", "bulk"), ("other.org", "bulk"),
        ("other.org", "transactional"),
    ]}
    assert hop == {
        ("example.com", ""): "smtp:[10.0.0.1]",
        ("EXAMPLE.COM.", ""): "smtp:[10.0.0.1]",
        ("a.example.com", ""): "smtp:[10.0.0.2]",
        ("x.deep.example.com", ""): "smtp:[10.0.0.3]",
        ("deep.example.com", ""): "smtp:[10.0.0.2]",  # .deep matches subdomains only
        ("other.org", ""): "lmtp:[127.0.0.1]:24",
        ("example.com", "bulk"): "smtp:[10.0.0.9]",
        ("a.example.com", "bulk"): "error:5.7.1 bulk is not allowed here",
        ("other.org", "bulk"): "error:5.7.1 bulk is not allowed here",
        ("other.org", "transactional"): "lmtp:[127.0.0.1]:24",
    }


def test_no_entry_means_mx_routing() -> None:
    tm = TransportMap.parse({"example.com": "smtp:[10.0.0.1]"})
    assert tm.lookup("example.org") is None
    assert tm.lookup("sub.example.com") is None  # no ".example.com" key
    assert TransportMap.parse({}).lookup("example.com") is None


def test_a_bad_entry_names_its_key() -> None:
    with pytest.raises(TransportMapError, match=r"key 'example\.com': .*unknown transport"):
        TransportMap.parse({"ok.example": "smtp:", "example.com": "bogus:x"})


# -- replies ---------------------------------------------------------------------


class _Transport:
    aborted = False

    def abort(self) -> None:
        self.aborted = True


def reader() -> ReplyReader:
    r = ReplyReader(loop=None)  # type: ignore[arg-type]  # parsing needs no loop
    r.transport = _Transport()  # type: ignore[assignment]
    return r


def test_replies_are_assembled_across_arbitrary_splits() -> None:
    wire = (b"250-mx.example.test Hello\r\n250-PIPELINING\r\n250-SIZE 1000\r\n250 8BITMIME\r\n"
            b"550 5.1.1 <a@x> no such user\r\n250 2.0.0 Ok: queued as X\n")
    for step in (1, 2, 7, len(wire)):
        r = reader()
        for i in range(0, len(wire), step):
            r.data_received(wire[i : i + step])
        got = [(x.code, x.lines) for x in r.replies]
        assert got == [
            (250, ["mx.example.test Hello", "PIPELINING", "SIZE 1000", "8BITMIME"]),
            (550, ["5.1.1 <a@x> no such user"]),
            (250, ["2.0.0 Ok: queued as X"]),
        ]
        assert r.lost is None


@pytest.mark.parametrize("junk", [b"hello there\r\n", b"25 short\r\n", b"250x1\r\n",
                                  b"2" * 9000])
def test_a_malformed_reply_breaks_the_connection(junk: bytes) -> None:
    r = reader()
    r.data_received(junk)
    assert r.lost is not None and r.lost.startswith("protocol error")
    assert r.transport.aborted  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("code", "lines", "reply"),
    [
        (250, ["2.1.5 Ok"], Reply(250, "2.1.5", "Ok")),
        (550, ["5.1.1 no such", "5.1.1 user here"], Reply(550, "5.1.1", "no such user here")),
        (451, ["try again later"], Reply(451, "4.0.0", "try again later")),
        (451, ["5.1.1 mismatched class"], Reply(451, "4.0.0", "5.1.1 mismatched class")),
        (554, [""], Reply(554, "5.0.0", "")),
    ],
)
def test_server_replies_become_replies(code: int, lines: list[str], reply: Reply) -> None:
    assert ServerReply(code, lines).to_reply() == reply


def test_ehlo_keywords() -> None:
    assert _extensions(["PIPELINING", "size 35882577", "8BITMIME", "AUTH PLAIN LOGIN", ""]) == {
        "PIPELINING": "", "SIZE": "35882577", "8BITMIME": "", "AUTH": "PLAIN LOGIN"}


def test_every_value_of_a_large_map_is_routed_once_and_hooks_are_bounded() -> None:
    import asyncio

    from sluice.config import config_from_dict
    from sluice.delivery.router import HOOK_NEXTHOPS, Router

    # Each domain its own loopback address, as bench/e2e.py's many config
    # routes 10,000: more values than the hooks' room.
    n = HOOK_NEXTHOPS * 3
    addr = [f"127.10.{k >> 8}.{k & 255}" for k in range(n)]
    cfg = config_from_dict({"delivery": {"transport": {
        f"d{k}.test": f"smtp:[{addr[k]}]:2526" for k in range(n)}}}, source="<test>")
    router = Router(cfg.delivery)

    async def routes() -> list[object]:
        return [await router.route(f"d{k}.test") for k in range(n)]

    first, second = asyncio.run(routes()), asyncio.run(routes())
    assert [hop.hosts[0].ip for hop in first] == addr  # type: ignore[attr-defined]
    assert all(a is b for a, b in zip(first, second, strict=True))  # built once each

    async def hooks(start: int) -> list[object]:
        return [await router.route("x.test", nexthop=f"smtp:[127.20.{k >> 8}.{k & 255}]:25")
                for k in range(start, start + HOOK_NEXTHOPS)]

    # Hooks' next hops: the first HOOK_NEXTHOPS are kept, any more are built each time.
    kept, again = asyncio.run(hooks(0)), asyncio.run(hooks(0))
    assert all(a is b for a, b in zip(kept, again, strict=True))
    more, more_again = asyncio.run(hooks(HOOK_NEXTHOPS)), asyncio.run(hooks(HOOK_NEXTHOPS))
    assert more == more_again and not any(a is b for a, b in zip(more, more_again, strict=True))
