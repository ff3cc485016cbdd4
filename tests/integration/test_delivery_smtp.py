"""The delivery agent against real SMTP and LMTP servers on loopback (aiosmtpd, raw peers)."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sluice._loopback import free_port
from sluice.config import config_from_dict
from sluice.delivery.agent import DeliveryAgent, DeliveryRequest, DeliveryResult
from sluice.delivery.router import Host, NextHop
from sluice.model import Delivered, PermFail, QueueEntry, QueueState, Reply, TempFail
from sluice.scheduler.events import Transport
from tests.integration.test_delivery_peers import (
    SinkHandler,
    mini_smtp,
    raw_server,
    run,
    self_signed,
    server_context,
    sink,
)

pytestmark = pytest.mark.integration

SPID = "0123456789ABCDEF"


def entries(*rcpts: str, sender: str = "sender@src.test", spid: str = SPID, size: int = 0
            ) -> tuple[QueueEntry, ...]:
    return tuple(QueueEntry(spid=spid, idx=i, sender=sender, recipient=r,
                            state=QueueState.DELIVERING, arrival_at=0.0, next_attempt_at=0.0,
                            size=size)
                 for i, r in enumerate(rcpts))


def make_agent(**delivery: Any) -> DeliveryAgent:
    delivery.setdefault("starttls", "none")
    timeouts = {"connect": "2s", "greeting": "2s", "helo": "2s", "mail": "2s", "rcpt": "2s",
                "data_init": "2s", "data_block": "2s", "data_done": "2s", "idle": "5s",
                **delivery.pop("timeouts", {})}
    cfg = config_from_dict({"node": {"hostname": "client.test"},
                            "delivery": {**delivery, "timeouts": timeouts}})
    return DeliveryAgent.from_config(cfg)


def hop(*ports: int, lmtp: bool = False, ip: str = "127.0.0.1", dest: str = "dest") -> NextHop:
    return NextHop(Transport.LMTP if lmtp else Transport.SMTP,
                   tuple(Host(f"mx{i}.test", ip, p) for i, p in enumerate(ports)), dest)


def content(data: bytes) -> Callable[[], io.BytesIO]:
    return lambda: io.BytesIO(data)


def request(route: NextHop, *rcpts: str, data: bytes = b"Subject: t\r\n\r\nhello\r\n",
            **kw: Any) -> DeliveryRequest:
    sender = kw.pop("sender", "sender@src.test")
    size = kw.pop("size", len(data))
    return DeliveryRequest(route, entries(*rcpts, sender=sender, size=size), content(data), **kw)


def outcomes(result: DeliveryResult) -> list[tuple[str, type, int, str]]:
    return [(e.recipient, type(o), o.reply.code, o.reply.enhanced) for e, o in result.outcomes]


# -- content -----------------------------------------------------------------------------

BODIES = {
    "dots": b"Subject: dots\r\n\r\n.\r\n..\r\n.leading dot\r\nmid.dle\r\n. \r\n...\r\nend\r\n",
    "long lines": (b"Subject: long\r\n\r\n" + b"x" * 998 + b"\r\n." + b"y" * 997 + b"\r\n"
                   + b"z" * 150_000 + b"\r\n.after a line that crossed chunk boundaries\r\n"),
    "8-bit": b"Subject: latin-1 \xe9t\xe9\r\n\r\nna\xefve caf\xe9 \xff\x80\r\n.\xe9\r\n",
    "utf-8 headers": ("From: Jöran <j@src.test>\r\nSubject: Grüße ☃\r\n\r\n"
                      "Ünïcödé body\r\n.☃ leading dot\r\n").encode(),
    "no final newline": b"Subject: x\r\n\r\nlast line has no CRLF",
    "big": b"Subject: big\r\n\r\n" + b"".join(
        b".%06d line of a big message with a leading dot\r\n" % i for i in range(40_000)),
}


@pytest.mark.parametrize("pipelining", [False, True], ids=["lockstep", "pipelined"])
def test_bodies_round_trip_byte_exact(pipelining: bool) -> None:
    async def scenario() -> None:
        handler = SinkHandler(pipelining=pipelining)
        async with sink(handler) as s:
            agent = make_agent(smtp_line_length_limit=0)  # long lines unchanged
            for name, body in BODIES.items():
                res = await agent.deliver(request(hop(s.port), "rcpt@dest.test", data=body,
                                                  smtputf8=name == "utf-8 headers"))
                assert outcomes(res) == [("rcpt@dest.test", Delivered, 250, "2.0.0")], name
            await agent.close()
        assert len(handler.messages) == len(BODIES)
        for (name, body), got in zip(BODIES.items(), handler.messages, strict=True):
            want = body if body.endswith(b"\r\n") else body + b"\r\n"
            assert got.data == want, name
        opts = {name: got.mail_options for name, got in zip(BODIES, handler.messages,
                                                             strict=True)}
        assert "BODY=8BITMIME" not in opts["dots"]  # 7-bit content needs no declaration
        assert "BODY=8BITMIME" in opts["8-bit"]
        assert "BODY=8BITMIME" in opts["big"]  # too big to look at first: declared
        assert "SMTPUTF8" in opts["utf-8 headers"]
        assert f"SIZE={len(BODIES['dots'])}" in opts["dots"]
        assert len(handler.connections) == 1  # one connection carried them all

    run(scenario())


def test_the_content_is_closed_before_the_outcome_settles(tmp_path: Path) -> None:
    """The store may unlink a delivered message's spool file once its outcome is
    durable; a descriptor still open then would make the loop's close free the blocks."""
    spool = tmp_path / "spool-file"
    spool.write_bytes(b"Subject: t\r\n\r\n" + b"line of the body\r\n" * 6000)
    opened: list[Any] = []

    def open_content() -> Any:
        f = spool.open("rb")
        opened.append(f)
        return f

    closed_at_settle: list[bool] = []

    async def settle(result: DeliveryResult) -> None:
        closed_at_settle.append(all(f.closed for f in opened))

    async def scenario() -> None:
        async with sink(SinkHandler()) as s:
            agent = make_agent()
            res = await agent.deliver(DeliveryRequest(hop(s.port), entries("rcpt@dest.test"),
                                                      open_content, settle=settle))
            assert outcomes(res) == [("rcpt@dest.test", Delivered, 250, "2.0.0")]
            await agent.close()

    run(scenario())
    assert opened and closed_at_settle == [True]


def test_bare_line_ends_become_crlf() -> None:
    async def scenario() -> None:
        handler = SinkHandler()
        async with sink(handler) as s:
            res = await make_agent().deliver(request(
                hop(s.port), "r@dest.test", data=b"Subject: x\n\nbare LF\nbare CR\rmixed\r\r\n."))
            assert isinstance(res.outcomes[0][1], Delivered)
        assert handler.messages[0].data == (
            b"Subject: x\r\n\r\nbare LF\r\nbare CR\r\nmixed\r\n\r\n.\r\n")

    run(scenario())


# -- per-recipient outcomes -----------------------------------------------------------------


@pytest.mark.parametrize("pipelining", [False, True], ids=["lockstep", "pipelined"])
def test_one_transaction_per_message_with_per_recipient_results(pipelining: bool) -> None:
    async def scenario() -> None:
        handler = SinkHandler(pipelining=pipelining, rcpt_replies={
            "busy@dest.test": "451 4.2.1 mailbox busy, try later",
            "nobody@dest.test": "550 5.1.1 no such user"})
        async with sink(handler) as s:
            res = await make_agent().deliver(request(
                hop(s.port), "ok@dest.test", "busy@dest.test", "nobody@dest.test",
                "ok2@dest.test"))
        assert outcomes(res) == [
            ("ok@dest.test", Delivered, 250, "2.0.0"),
            ("busy@dest.test", TempFail, 451, "4.2.1"),
            ("nobody@dest.test", PermFail, 550, "5.1.1"),
            ("ok2@dest.test", Delivered, 250, "2.0.0"),
        ]
        busy = res.outcomes[1][1].reply
        # The server's words alone, and who said them (the NDR's Remote-MTA).
        assert (busy.text, busy.remote_mta) == ("mailbox busy, try later", "mx0.test")
        assert busy.describe() == "host mx0.test said: 451 4.2.1 mailbox busy, try later"
        assert [m.recipients for m in handler.messages] == [("ok@dest.test", "ok2@dest.test")]
        assert (res.remotemx, res.remoteip, res.port) == ("mx0.test", "127.0.0.1", s.port)
        assert res.new_connection and not res.connection_failed

    run(scenario())


@pytest.mark.parametrize("pipelining", [False, True], ids=["lockstep", "pipelined"])
def test_all_recipients_refused_then_the_connection_is_reused(pipelining: bool) -> None:
    async def scenario() -> None:
        handler = SinkHandler(pipelining=pipelining, rcpt_replies={
            "a@dest.test": "550 5.1.1 no", "b@dest.test": "452 4.5.3 too many"})
        async with sink(handler) as s:
            agent = make_agent()
            res = await agent.deliver(request(hop(s.port), "a@dest.test", "b@dest.test"))
            assert outcomes(res) == [("a@dest.test", PermFail, 550, "5.1.1"),
                                     ("b@dest.test", TempFail, 452, "4.5.3")]
            res = await agent.deliver(request(hop(s.port), "c@dest.test"))
            assert outcomes(res) == [("c@dest.test", Delivered, 250, "2.0.0")]
            assert not res.new_connection
        assert len(handler.connections) == 1
        assert [m.recipients for m in handler.messages] == [("c@dest.test",)]

    run(scenario())


def test_5xx_after_data_fails_every_recipient() -> None:
    async def scenario() -> None:
        handler = SinkHandler(data_reply="554 5.6.0 content rejected")
        async with sink(handler) as s:
            res = await make_agent().deliver(request(hop(s.port), "a@dest.test", "b@dest.test"))
        assert outcomes(res) == [("a@dest.test", PermFail, 554, "5.6.0"),
                                 ("b@dest.test", PermFail, 554, "5.6.0")]

    run(scenario())


def test_mail_from_refused() -> None:
    def refuse_mail(line: bytes) -> bytes | None:
        return b"553 5.7.1 sender rejected\r\n" if line.startswith(b"MAIL") else None

    async def scenario() -> None:
        async with raw_server(mini_smtp(on_command=refuse_mail)) as port:
            res = await make_agent().deliver(request(hop(port), "a@dest.test", "b@dest.test"))
        assert outcomes(res) == [("a@dest.test", PermFail, 553, "5.7.1"),
                                 ("b@dest.test", PermFail, 553, "5.7.1")]

    run(scenario())


def test_421_in_the_middle_ends_the_session() -> None:
    def shut(line: bytes) -> bytes | None:
        if line.startswith(b"RCPT TO:<b@"):
            return b"421 4.3.2 shutting down\r\n"
        return None

    async def scenario() -> None:
        async with raw_server(mini_smtp(on_command=shut)) as port:
            agent = make_agent()
            res = await agent.deliver(request(hop(port), "a@dest.test", "b@dest.test",
                                              "c@dest.test"))
            assert outcomes(res) == [("a@dest.test", TempFail, 421, "4.3.2"),
                                     ("b@dest.test", TempFail, 421, "4.3.2"),
                                     ("c@dest.test", TempFail, 421, "4.3.2")]
            assert agent.stats.open == 0  # a 421 session is never reused

    run(scenario())


# -- hosts, fallback, connection failures -----------------------------------------------------


def test_greeting_421_falls_back_to_the_next_mx() -> None:
    async def scenario() -> None:
        async with raw_server(mini_smtp(greeting=b"421 4.3.2 too busy\r\n")) as busy, \
                sink() as s:
            agent = make_agent()
            res = await agent.deliver(request(hop(busy, s.port), "a@dest.test"))
            assert outcomes(res) == [("a@dest.test", Delivered, 250, "2.0.0")]
            assert (res.remotemx, res.port, res.connection_failed) == ("mx1.test", s.port, False)
            only_busy = await agent.deliver(request(hop(busy, dest="other"), "a@dest.test"))
        assert only_busy.connection_failed
        reply = only_busy.outcomes[0][1]
        assert isinstance(reply, TempFail)
        assert (reply.reply.code, reply.reply.enhanced) == (421, "4.3.2")
        assert f"mx0.test[127.0.0.1]:{busy} greeted us with: 421 too busy" in reply.reply.text

    run(scenario())


def test_5xx_greeting_is_skipped_and_deferred_not_bounced() -> None:
    async def scenario() -> None:
        async with raw_server(mini_smtp(greeting=b"554 5.7.1 go away\r\n")) as port:
            res = await make_agent().deliver(request(hop(port), "a@dest.test"))
        assert res.connection_failed
        assert outcomes(res) == [("a@dest.test", TempFail, 451, "4.4.2")]

    run(scenario())


def test_connection_refused_falls_back_to_the_next_mx() -> None:
    async def scenario() -> None:
        dead = free_port()
        async with sink() as s:
            agent = make_agent()
            res = await agent.deliver(request(hop(dead, s.port), "a@dest.test"))
            assert outcomes(res) == [("a@dest.test", Delivered, 250, "2.0.0")]
            assert res.port == s.port
            res = await agent.deliver(request(hop(dead, dest="dead"), "a@dest.test"))
        assert res.connection_failed and res.new_connection
        out = res.outcomes[0][1]
        assert isinstance(out, TempFail) and out.reply.enhanced == "4.4.1"
        assert out.reply.text == f"connect to mx0.test[127.0.0.1]:{dead}: Connection refused"
        assert agent.stats.connect_failures == 2

    run(scenario())


def test_source_ip_binding_and_helo_per_ip() -> None:
    async def scenario() -> None:
        handler = SinkHandler()
        async with sink(handler) as s:
            agent = make_agent(helo={"127.0.0.2": "out2.client.test"})
            for localip in ("127.0.0.2", "", "127.0.0.3"):
                res = await agent.deliver(request(hop(s.port), "a@dest.test", localip=localip))
                assert isinstance(res.outcomes[0][1], Delivered)
                assert res.localip == localip
        peers = [m.peer[0] for m in handler.messages]
        helos = [m.helo for m in handler.messages]
        assert peers == ["127.0.0.2", "127.0.0.1", "127.0.0.3"]
        assert helos == ["out2.client.test", "client.test", "client.test"]
        assert len(handler.connections) == 3  # one per source IP, never shared

    run(scenario())


def test_source_ip_that_cannot_reach_an_ipv6_host() -> None:
    async def scenario() -> None:
        async with sink() as s:
            route = NextHop(Transport.SMTP, (Host("v6.test", "::1", s.port),
                                             Host("v4.test", "127.0.0.1", s.port)), "d")
            res = await make_agent().deliver(request(route, "a@dest.test", localip="127.0.0.2"))
        assert res.remotemx == "v4.test" and isinstance(res.outcomes[0][1], Delivered)

    run(scenario())


# -- connection reuse -----------------------------------------------------------------------


def test_connections_are_reused_up_to_the_bound() -> None:
    async def scenario() -> None:
        handler = SinkHandler()
        async with sink(handler) as s:
            agent = make_agent(max_messages_per_connection=3)
            news = []
            for i in range(7):
                res = await agent.deliver(request(hop(s.port), f"r{i}@dest.test"))
                assert isinstance(res.outcomes[0][1], Delivered)
                news.append(res.new_connection)
            await agent.close()
            await asyncio.sleep(0.05)
        assert news == [True, False, False, True, False, False, True]
        assert len(handler.connections) == 3
        assert [len(set(m.peer for m in handler.messages[i:i + 3])) for i in (0, 3)] == [1, 1]
        assert agent.stats.connections_opened == 3 and agent.stats.connections_reused == 4

    run(scenario())


def test_concurrent_deliveries_use_separate_connections_then_share_them() -> None:
    async def scenario() -> None:
        handler = SinkHandler()
        async with sink(handler) as s:
            agent = make_agent()
            first = await asyncio.gather(*(agent.deliver(request(hop(s.port), f"a{i}@d.test"))
                                           for i in range(3)))
            assert all(r.new_connection for r in first)
            assert agent.stats.idle == 3
            again = await asyncio.gather(*(agent.deliver(request(hop(s.port), f"b{i}@d.test"))
                                           for i in range(3)))
            assert not any(r.new_connection for r in again)
        assert len(handler.connections) == 3 and len(handler.messages) == 6

    run(scenario())


def test_idle_connections_are_closed() -> None:
    async def scenario() -> None:
        handler = SinkHandler()
        async with sink(handler) as s:
            agent = make_agent(timeouts={"idle": "0.2s"})
            await agent.deliver(request(hop(s.port), "a@dest.test"))
            assert agent.stats.idle == 1
            await asyncio.sleep(0.5)
            assert agent.stats.open == 0 and handler.closed == 1
            res = await agent.deliver(request(hop(s.port), "b@dest.test"))
            assert res.new_connection

    run(scenario())


def test_max_connections_closes_the_longest_idle() -> None:
    async def scenario() -> None:
        a, b, c = SinkHandler(), SinkHandler(), SinkHandler()
        async with sink(a) as sa, sink(b) as sb, sink(c) as sc:
            agent = make_agent(max_connections=2)
            await agent.deliver(request(hop(sa.port, dest="a"), "x@dest.test"))
            await agent.deliver(request(hop(sb.port, dest="b"), "x@dest.test"))
            again = await agent.deliver(request(hop(sa.port, dest="a"), "y@dest.test"))
            assert not again.new_connection  # a was opened first but used last
            await agent.deliver(request(hop(sc.port, dest="c"), "x@dest.test"))
            await asyncio.sleep(0.05)
            assert agent.stats.open == 2
            assert (a.closed, b.closed, c.closed) == (0, 1, 0)

    run(scenario())


def test_a_cached_connection_that_died_is_replaced_once() -> None:
    dropped = []

    def drop_second_mail(line: bytes) -> bytes | None:
        if line.startswith(b"MAIL"):
            dropped.append(line)
            if len(dropped) == 2:
                return b""  # hang up without a word, as a server's idle timeout does
        return None

    async def scenario() -> None:
        async with raw_server(mini_smtp(on_command=drop_second_mail)) as port:
            agent = make_agent()
            first = await agent.deliver(request(hop(port), "a@dest.test"))
            second = await agent.deliver(request(hop(port), "b@dest.test",
                                                 data=b"Subject: again\r\n\r\nbody\r\n"))
        assert isinstance(first.outcomes[0][1], Delivered)
        assert outcomes(second) == [("b@dest.test", Delivered, 250, "2.0.0")]
        assert second.new_connection
        assert len(dropped) == 3

    run(scenario())


# -- LMTP ----------------------------------------------------------------------------------


def test_lmtp_gives_one_reply_per_recipient_after_data() -> None:
    async def scenario() -> None:
        handler = SinkHandler(rcpt_replies={"nobody@dest.test": "550 5.1.1 unknown"},
                              lmtp_replies={"full@dest.test": "452 4.2.2 mailbox full",
                                            "bad@dest.test": "554 5.6.0 rejected"})
        async with sink(handler, lmtp=True) as s:
            res = await make_agent().deliver(request(
                hop(s.port, lmtp=True), "ok@dest.test", "full@dest.test", "nobody@dest.test",
                "bad@dest.test", "ok2@dest.test"))
        assert outcomes(res) == [
            ("ok@dest.test", Delivered, 250, "2.0.0"),
            ("full@dest.test", TempFail, 452, "4.2.2"),
            ("nobody@dest.test", PermFail, 550, "5.1.1"),
            ("bad@dest.test", PermFail, 554, "5.6.0"),
            ("ok2@dest.test", Delivered, 250, "2.0.0"),
        ]
        assert res.outcomes[0][1].reply.text == "delivered to ok@dest.test"
        assert res.outcomes[4][1].reply.text == "delivered to ok2@dest.test"
        assert len(handler.messages) == 1  # one transaction; LHLO accepted by aiosmtpd's LMTP

    run(scenario())


# -- TLS -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return self_signed(tmp_path_factory.mktemp("tls"))


def test_opportunistic_starttls(cert: tuple[Path, Path]) -> None:
    async def scenario() -> None:
        handler = SinkHandler()
        async with sink(handler, tls=server_context(*cert)) as s:
            agent = make_agent(starttls="opportunistic")
            res = await agent.deliver(request(hop(s.port), "a@dest.test",
                                              data=BODIES["dots"]))
            assert res.tls and isinstance(res.outcomes[0][1], Delivered)
            again = await agent.deliver(request(hop(s.port), "b@dest.test"))
            assert again.tls and not again.new_connection
            plain = await make_agent(starttls="none").deliver(request(hop(s.port), "c@d.test"))
            assert not plain.tls
        assert [m.tls for m in handler.messages] == [True, True, False]
        assert handler.messages[0].data == BODIES["dots"]

    run(scenario())


def test_starttls_required_but_not_offered() -> None:
    async def scenario() -> None:
        handler = SinkHandler()
        async with sink(handler) as s:
            res = await make_agent(starttls="require").deliver(request(hop(s.port), "a@d.test"))
            opp = await make_agent(starttls="opportunistic").deliver(
                request(hop(s.port), "a@d.test"))
        assert res.connection_failed
        assert outcomes(res) == [("a@d.test", TempFail, 451, "4.7.4")]
        assert "did not offer STARTTLS" in res.outcomes[0][1].reply.text
        assert isinstance(opp.outcomes[0][1], Delivered) and not opp.tls

    run(scenario())


def test_a_failed_tls_handshake_falls_back_to_plain_text() -> None:
    tries: list[str] = []
    plain = mini_smtp()

    async def broken_tls(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if "starttls" in tries:  # the second connection: a working plain-text server
            tries.append("plain")
            await plain(reader, writer)
            return
        writer.write(b"220 mini.test ESMTP\r\n")
        await reader.readline()
        tries.append("ehlo")
        writer.write(b"250-mini.test\r\n250-STARTTLS\r\n250 PIPELINING\r\n")
        await reader.readline()
        tries.append("starttls")
        writer.write(b"220 go ahead\r\n")
        await reader.read(1)  # the client's TLS hello: answer with nonsense
        writer.write(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        await writer.drain()

    async def scenario() -> None:
        async with raw_server(broken_tls) as port:
            res = await make_agent(starttls="opportunistic").deliver(
                request(hop(port), "a@dest.test"))
        assert tries == ["ehlo", "starttls", "plain"]
        assert outcomes(res) == [("a@dest.test", Delivered, 250, "2.0.0")] and not res.tls
        tries.clear()
        async with raw_server(broken_tls) as port:
            req = await make_agent(starttls="require").deliver(request(hop(port), "a@dest.test"))
        assert outcomes(req) == [("a@dest.test", TempFail, 451, "4.7.5")]
        assert "TLS handshake with mx0.test" in req.outcomes[0][1].reply.text
        assert tries == ["ehlo", "starttls"]

    run(scenario())


# -- SMTPUTF8, SIZE, content ------------------------------------------------------------------


UTF8_HEADERS = "From: Jöran <j@src.test>\r\nSubject: Grüße\r\n\r\nbody\r\n".encode()
LATIN1_HEADERS = b"Subject: caf\xe9\r\n\r\nbody\r\n"
UTF8_BODY_ONLY = "Subject: plain\r\n\r\nGrüße im Text\r\n".encode()


def test_smtputf8_needed_but_not_offered_is_permanent() -> None:
    """Without SMTPUTF8 at the server: non-ASCII addresses fail (553 5.6.7),
    and so does a message received with SMTPUTF8 whose header block has
    UTF-8 (550 5.6.9); one received with SMTPUTF8 that does not use UTF-8
    there goes as it is, without the parameter (Postfix)."""
    async def scenario() -> None:
        handler = SinkHandler()
        async with sink(handler, smtputf8=False) as s:
            agent = make_agent()
            res = await agent.deliver(request(hop(s.port), "jörg@dest.test"))
            flagged = await agent.deliver(request(hop(s.port), "a@dest.test", smtputf8=True,
                                                  data=UTF8_HEADERS))
            sent = [await agent.deliver(request(hop(s.port), "a@dest.test", smtputf8=True,
                                                data=data))
                    for data in (b"Subject: t\r\n\r\nhello\r\n", LATIN1_HEADERS,
                                 UTF8_BODY_ONLY)]
            plain = await agent.deliver(request(hop(s.port), "a@dest.test"))
        assert outcomes(res) == [("jörg@dest.test", PermFail, 553, "5.6.7")]
        assert "SMTPUTF8" in res.outcomes[0][1].reply.text
        assert outcomes(flagged) == [("a@dest.test", PermFail, 550, "5.6.9")]
        assert "SMTPUTF8 is required" in flagged.outcomes[0][1].reply.text
        assert [outcomes(r) for r in sent] == [[("a@dest.test", Delivered, 250, "2.0.0")]] * 3
        assert isinstance(plain.outcomes[0][1], Delivered) and not plain.new_connection
        assert [m.data for m in handler.messages] == [
            b"Subject: t\r\n\r\nhello\r\n", LATIN1_HEADERS, UTF8_BODY_ONLY,
            b"Subject: t\r\n\r\nhello\r\n"]
        assert all("SMTPUTF8" not in m.mail_options for m in handler.messages)

    run(scenario())


def attachment(name: str, filler: int) -> bytes:
    """A multipart message whose second part's header (``name``) comes
    after ``filler`` bytes of the first part."""
    return (
        'Subject: report\r\nMIME-Version: 1.0\r\n'
        'Content-Type: multipart/mixed; boundary="=_part"\r\n\r\n'
        '--=_part\r\nContent-Type: text/plain\r\n\r\n' + ("x" * 76 + "\r\n") * (filler // 78)
        + f'--=_part\r\nContent-Type: text/plain\r\nContent-Disposition: attachment; '
        f'filename="{name}"\r\n\r\nattached\r\n--=_part--\r\n').encode()


def test_a_utf8_attachment_header_past_the_head_needs_smtputf8() -> None:
    """Received with SMTPUTF8, ASCII top header, a MIME part header with
    UTF-8 after the first 64 KB (what the client reads before MAIL): the
    agent reads the content through once more and refuses it at a server
    without SMTPUTF8 (550 5.6.9), as Postfix, which flags attachment
    headers too, would.  The ASCII twin goes, byte for byte; a content
    that cannot be read the second time defers (451 4.3.0)."""
    utf8 = attachment("Grüße.txt", 200_000)
    ascii_twin = attachment("Gruesse.txt", 200_000)
    opened: list[int] = []

    def fails_second_time() -> io.BytesIO:
        opened.append(1)
        if len(opened) > 1:
            raise OSError("the spool went away")
        return io.BytesIO(utf8)

    async def scenario() -> None:
        handler = SinkHandler()
        async with sink(handler, smtputf8=False) as s:
            agent = make_agent()
            refused = await agent.deliver(request(hop(s.port), "a@dest.test", smtputf8=True,
                                                  data=utf8))
            sent = await agent.deliver(request(hop(s.port), "b@dest.test", smtputf8=True,
                                               data=ascii_twin))
            unread = await agent.deliver(dataclasses.replace(
                request(hop(s.port), "c@dest.test", smtputf8=True, data=utf8),
                content=fails_second_time))
            unflagged = await agent.deliver(request(hop(s.port), "d@dest.test", data=utf8))
        assert outcomes(refused) == [("a@dest.test", PermFail, 550, "5.6.9")]
        assert outcomes(sent) == [("b@dest.test", Delivered, 250, "2.0.0")]
        assert outcomes(unread) == [("c@dest.test", TempFail, 451, "4.3.0")]
        assert "the spool went away" in unread.outcomes[0][1].reply.text
        assert outcomes(unflagged) == [("d@dest.test", Delivered, 250, "2.0.0")]
        assert [(m.recipients, m.data) for m in handler.messages] == [
            (("b@dest.test",), ascii_twin), (("d@dest.test",), utf8)]

    run(scenario())


def test_a_message_received_with_smtputf8_asks_for_it_where_offered() -> None:
    """All ASCII, but received with SMTPUTF8: the next hop is told so."""
    async def scenario() -> None:
        handler = SinkHandler()
        async with sink(handler) as s:
            agent = make_agent()
            for flag in (True, False):
                res = await agent.deliver(request(hop(s.port), "a@dest.test", smtputf8=flag))
                assert isinstance(res.outcomes[0][1], Delivered)
            await agent.close()
        assert ["SMTPUTF8" in m.mail_options for m in handler.messages] == [True, False]

    run(scenario())


def test_utf8_addresses_with_smtputf8() -> None:
    async def scenario() -> None:
        handler = SinkHandler()
        async with sink(handler) as s:
            res = await make_agent().deliver(request(hop(s.port), "jörg@dést.test",
                                                     sender="ünï@src.test"))
        assert isinstance(res.outcomes[0][1], Delivered)
        got = handler.messages[0]
        assert (got.sender, got.recipients) == ("ünï@src.test", ("jörg@dést.test",))
        assert "SMTPUTF8" in got.mail_options

    run(scenario())


def test_utf8_headers_ask_for_smtputf8_where_offered_and_go_as_they_are_elsewhere() -> None:
    """ASCII addresses, UTF-8 in the header block: SMTPUTF8 is asked for when
    the server offers it (RFC 6531 3.4); a server without it still gets the
    message, byte for byte (it was not received as needing SMTPUTF8)."""
    async def scenario() -> None:
        offered, plain = SinkHandler(), SinkHandler()
        async with sink(offered) as s, sink(plain, smtputf8=False) as t:
            agent = make_agent()
            for data in (UTF8_HEADERS, LATIN1_HEADERS, UTF8_BODY_ONLY):
                for port in (s.port, t.port):
                    res = await agent.deliver(request(hop(port, dest=str(port)), "a@dest.test",
                                                      data=data))
                    assert isinstance(res.outcomes[0][1], Delivered), (port, data)
            await agent.close()
        opts = [m.mail_options for m in offered.messages]
        assert "SMTPUTF8" in opts[0]  # UTF-8 headers
        assert "SMTPUTF8" not in opts[1]  # raw Latin-1 headers are not UTF-8
        assert "SMTPUTF8" not in opts[2]  # UTF-8 only in the body: 8BITMIME is enough
        assert all("BODY=8BITMIME" in o for o in opts)
        assert [m.data for m in offered.messages] == [UTF8_HEADERS, LATIN1_HEADERS,
                                                      UTF8_BODY_ONLY]
        assert [m.data for m in plain.messages] == [UTF8_HEADERS, LATIN1_HEADERS,
                                                    UTF8_BODY_ONLY]
        assert all("SMTPUTF8" not in m.mail_options for m in plain.messages)

    run(scenario())


def test_addresses_that_could_smuggle_commands_never_reach_the_wire() -> None:
    async def scenario() -> None:
        handler = SinkHandler()
        async with sink(handler) as s:
            agent = make_agent()
            res = await agent.deliver(request(
                hop(s.port), "ok@dest.test", "x@dest.test>\r\nRCPT TO:<evil@dest.test"))
            assert outcomes(res) == [("ok@dest.test", Delivered, 250, "2.0.0"),
                                     ("x@dest.test>\r\nRCPT TO:<evil@dest.test", PermFail, 553,
                                      "5.1.3")]
            res = await agent.deliver(request(hop(s.port), "ok@dest.test",
                                              sender="a@src.test>\r\nDATA"))
            assert outcomes(res) == [("ok@dest.test", PermFail, 553, "5.1.7")]
        assert [m.recipients for m in handler.messages] == [("ok@dest.test",)]

    run(scenario())


def test_long_lines_are_folded_by_default() -> None:
    body = BODIES["long lines"]

    async def scenario() -> None:
        handler = SinkHandler()
        async with sink(handler) as s:
            agent = make_agent()
            res = await agent.deliver(request(hop(s.port), "rcpt@dest.test", data=body))
            assert outcomes(res) == [("rcpt@dest.test", Delivered, 250, "2.0.0")]
            await agent.close()
        (got,) = handler.messages
        assert max(map(len, got.data.split(b"\r\n"))) == 998
        assert got.data.count(b"\r\n ") == -(-(150_000 - 998) // 997)
        assert got.data.replace(b"\r\n ", b"") == body

    run(scenario())


def test_message_larger_than_the_servers_size() -> None:
    async def scenario() -> None:
        handler = SinkHandler()
        async with sink(handler, data_size_limit=1000) as s:
            res = await make_agent().deliver(request(hop(s.port), "a@dest.test",
                                                     data=b"x" * 5000))
        assert outcomes(res) == [("a@dest.test", PermFail, 552, "5.3.4")]
        assert "exceeds the limit of 1000 bytes" in res.outcomes[0][1].reply.text
        assert handler.messages == []

    run(scenario())


def test_unreadable_content_defers_without_connecting() -> None:
    def missing() -> io.BytesIO:
        raise FileNotFoundError(2, "No such file or directory", "/spool/0123")

    async def scenario() -> None:
        handler = SinkHandler()
        async with sink(handler) as s:
            res = await make_agent().deliver(DeliveryRequest(hop(s.port), entries("a@d.test"),
                                                             missing))
        assert outcomes(res) == [("a@d.test", TempFail, 451, "4.3.0")]
        assert "No such file" in res.outcomes[0][1].reply.text
        assert handler.connections == [] and not res.connection_failed

    run(scenario())


def test_content_is_closed_after_each_attempt() -> None:
    opened: list[io.BytesIO] = []

    def opener() -> io.BytesIO:
        opened.append(io.BytesIO(b"Subject: x\r\n\r\nbody\r\n"))
        return opened[-1]

    async def scenario() -> None:
        async with sink() as s:
            agent = make_agent()
            await agent.deliver(DeliveryRequest(hop(s.port), entries("a@d.test"), opener))
            await agent.deliver(DeliveryRequest(hop(free_port()), entries("a@d.test"), opener))
        assert len(opened) == 2 and all(f.closed for f in opened)

    run(scenario())


# -- timeouts --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("server", "phase", "failed"),
    [
        (dict(greeting=None), "the initial server greeting", True),
        (dict(stall_on=b"EHLO"), "EHLO", True),
        (dict(stall_on=b"MAIL"), "MAIL FROM", False),
        (dict(stall_on=b"RCPT"), "RCPT TO", False),
        (dict(stall_on=b"DATA"), "DATA", False),
        (dict(stall_on=b".\r\n"), "end of data", False),
    ],
    ids=["greeting", "ehlo", "mail", "rcpt", "data", "dot"],
)
def test_a_stalling_server_times_out_per_phase(server: dict[str, Any], phase: str,
                                               failed: bool) -> None:
    timeouts = {k: "0.3s" for k in ("greeting", "helo", "mail", "rcpt", "data_init",
                                     "data_done")}

    async def scenario() -> None:
        async with raw_server(mini_smtp(ehlo=b"250 mini.test\r\n", **server)) as port:
            agent = make_agent(timeouts=timeouts)
            started = time.monotonic()
            res = await agent.deliver(request(hop(port), "a@dest.test"))
            elapsed = time.monotonic() - started
            assert agent.stats.open == 0
        out = res.outcomes[0][1]
        assert isinstance(out, TempFail)
        assert (out.reply.code, out.reply.enhanced) == (451, "4.4.2")
        assert out.reply.text == (f"conversation with mx0.test[127.0.0.1]:{port} timed out "
                                  f"while waiting for the reply to {phase}")
        assert res.connection_failed is failed
        assert 0.25 < elapsed < 1.5

    run(scenario())


def test_a_server_that_stops_reading_times_out_in_data_block() -> None:
    async def scenario() -> None:
        serve = mini_smtp(ehlo=b"250 mini.test\r\n", stop_reading_after_354=True)
        async with raw_server(serve) as port:
            agent = make_agent(timeouts={"data_block": "0.3s"})
            big = b"Subject: big\r\n\r\n" + (b"y" * 1000 + b"\r\n") * 48_000
            started = time.monotonic()
            res = await agent.deliver(request(hop(port), "a@dest.test", data=big))
            elapsed = time.monotonic() - started
        out = res.outcomes[0][1]
        assert isinstance(out, TempFail) and out.reply.enhanced == "4.4.2"
        assert "timed out while sending message content" in out.reply.text
        assert elapsed < 3

    run(scenario())


def test_connect_timeout_then_the_next_host() -> None:
    async def scenario() -> None:
        async with sink() as s:
            # 192.0.2.0/24 (TEST-NET-1) is never routed: the connect can only
            # time out or fail at once, both of which move on to the next host.
            route = NextHop(Transport.SMTP, (Host("blackhole.test", "192.0.2.1", 25),
                                             Host("mx.test", "127.0.0.1", s.port)), "d")
            agent = make_agent(timeouts={"connect": "0.3s"})
            started = time.monotonic()
            res = await agent.deliver(request(route, "a@dest.test"))
        assert isinstance(res.outcomes[0][1], Delivered) and res.remotemx == "mx.test"
        assert time.monotonic() - started < 2

    run(scenario())


def test_cancellation_drops_the_connection() -> None:
    async def scenario() -> None:
        async with raw_server(mini_smtp(stall_on=b"MAIL")) as port:
            agent = make_agent()
            task = asyncio.create_task(agent.deliver(request(hop(port), "a@dest.test")))
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert agent.stats.open == 0

    run(scenario())


def test_request_misuse_is_an_error() -> None:
    route = hop(25)
    mixed = entries("a@d.test") + entries("b@d.test", spid="FEDCBA9876543210")
    with pytest.raises(ValueError, match="one message"):
        DeliveryRequest(route, mixed, content(b""))
    with pytest.raises(ValueError, match="at least one entry"):
        DeliveryRequest(route, (), content(b""))
    with pytest.raises(ValueError):
        DeliveryRequest(route, entries("a@d.test"), content(b""), localip="not-an-ip")
    assert Reply(250).code == 250
