"""The delivery agent: one message to one next hop, with connection reuse.

SUMMARY
    agent = DeliveryAgent.from_config(config)
    result = await agent.deliver(DeliveryRequest(route, entries, content, localip))
    await agent.close()

DESCRIPTION
    deliver() hands one message to one next hop (a NextHop from the
    Router) for one or more of its recipient entries, in one transaction,
    from one source IP, and returns a DeliveryResult: an Outcome per
    entry (Delivered, TempFail, PermFail, each with its Reply) and what
    the attempt did (host, source IP, duration, new connection or not,
    whether no session could be had at all).

    deliver() never raises for a network or peer failure; those are
    outcomes.  It raises only for misuse and lets cancellation through
    (the connection is then dropped; the entries' fate is unknown, and the
    queue's recovery retries them).

    Hosts are tried in the route's order.  The next host is tried when a
    connection cannot be made or times out, or when the server refuses to
    talk (4xx or 5xx greeting, EHLO/HELO refused, TLS required but not
    offered).  Once a session is up, its replies are final for this
    attempt: a 4xx to RCPT defers that recipient; it does not send the
    message to the next MX.

    Outcomes without a reply from the peer (RFC 3463 codes):
    4.4.1  no connection could be made (refused, unreachable, timed out)
    4.4.2  the connection broke or timed out during the conversation
    4.3.0  the queued content could not be read
    5.3.4  larger than the SIZE the server announced (552)
    5.6.7  non-ASCII addresses, server without SMTPUTF8 (553)
    5.6.9  received with SMTPUTF8, UTF-8 in the header block, server
           without SMTPUTF8 (550)

STRATEGIES
    Connection cache.  A session that ends a transaction cleanly goes back
    to an idle pool (sluice.delivery.pool) keyed by (transport,
    destination, source IP) and is reused by the next message for that
    destination, up to ``max_messages_per_connection`` transactions; it is
    closed after ``timeouts.idle`` unused.  A reused session that turns
    out to be dead before the server answered anything is replaced by a
    new connection once, with the content read again from the start.

    Durable before reuse.  Once the replies to a message are in, the
    request's ``settle`` runs (the queue manager records the outcomes and
    waits for the store's group commit, or with a success journal for
    its sync, which precedes the store's: sluice.journal) before the
    session goes back to the pool: a connection never carries the next
    message while the previous one's success could still be forgotten by
    a crash (with queue.success_sync "write", by a crash of Sluice; a
    power cut may still forget it, as in Postfix).  Its
    ``started`` runs after 354, before the first byte of the message, so
    an attempt that may have delivered is always known as one in flight
    (a line of the mark log, or the store's mark: sluice.marks).

    Bounded connections.  When ``max_connections`` sessions are open, a new
    one first closes the longest-idle session of any destination.  The
    number in flight is the scheduler's to limit.

    Source IP and HELO.  A connection is bound to the request's localip;
    its HELO name is ``helo[localip]``, else ``helo["*"]``, else the node's
    host name.  Hosts of the other address family than localip are skipped.

    Opportunistic TLS.  With ``starttls: opportunistic`` a failed TLS
    handshake is retried once on the same host without STARTTLS, as
    Postfix's "may" level does; ``require`` defers instead.

    SMTPUTF8 only where it is used (Postfix).  A message received with
    SMTPUTF8 goes to a server without SMTPUTF8 unless it really uses
    UTF-8 there: its addresses, or a header block (the top one, or a MIME
    part's).  So the first piece of the content (what the client sends
    first anyway) is read before MAIL; only when it does not settle the
    question, for such a message and such a server, is the content read
    through once more; see smtputf8_refusal() and sluice.mime.

INVARIANTS
    Every entry of a request gets exactly one outcome.  A session is in
    the idle pool or in one delivery, never both.

LIMITATIONS
    Content is read from the spool on the event loop thread (small reads
    from the page cache; a slow disk slows the loop).

SEE ALSO
    sluice.delivery.client (the protocol), sluice.delivery.pool (the
    connection cache), sluice.delivery.request (what it takes and gives
    back), sluice.delivery.router, sluice.hooks (the post-delivery hook
    is the runtime's to call)
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import ipaddress
import re
import ssl
import time
from collections.abc import Callable, Sequence
from typing import IO

from sluice import faults
from sluice.config import Config, DeliveryConfig
from sluice.delivery.client import (
    READ_SIZE,
    Envelope,
    Session,
    SessionError,
    StartTls,
    default_ssl_context,
)
from sluice.delivery.pool import PoolKey, SessionPool
from sluice.delivery.replies import ServerReply
from sluice.delivery.request import AgentStats, DeliveryRequest, DeliveryResult
from sluice.delivery.router import Host
from sluice.mime import HeaderScan, utf8_headers
from sluice.model import (
    Delivered,
    Outcome,
    PermFail,
    Reply,
    TempFail,
    ascii_envelope,
)
from sluice.scheduler.events import Transport

# AgentStats, DeliveryRequest and DeliveryResult live in sluice.delivery.request; they are
# named here too, as callers import them with the agent.
__all__ = ["AgentStats", "DeliveryAgent", "DeliveryRequest", "DeliveryResult", "outcome_of",
           "smtputf8_refusal"]


def outcome_of(reply: Reply) -> Outcome:
    """The outcome a reply means: 2xx delivered, 4xx temporary, 5xx permanent.

    Anything else is a protocol error, retried later.
    """
    if 200 <= reply.code < 300:
        return Delivered(reply)
    if 500 <= reply.code < 600:
        return PermFail(reply)
    if 400 <= reply.code < 500:
        return TempFail(reply)
    return TempFail(Reply(451, "4.5.0", f"unexpected reply {reply.code}: {reply.text}"))


def smtputf8_refusal(env: Envelope, utf8_headers: Callable[[], bool], offered: bool,
                     host: Host) -> PermFail | None:
    """Why the message cannot go to ``host`` for want of SMTPUTF8, or None.

    ``utf8_headers()`` says whether a header block of the message (the
    top one or a MIME part's, see sluice.mime) is UTF-8; it is
    called only when the answer matters.  ``offered``: the host announced
    SMTPUTF8.  Without it, non-ASCII addresses cannot be sent at all
    (RFC 6531 3.4: 553 5.6.7), and a message received with SMTPUTF8 with
    a UTF-8 header would reach a server that does not expect it (550
    5.6.9).  A message received with SMTPUTF8 but ASCII in its envelope
    and headers goes as it is, as Postfix delivers it: the client allowed
    UTF-8, the message does not use it.  One received without SMTPUTF8
    goes as it is too (see sluice.model.utf8_header).
    """
    if offered:
        return None
    if not ascii_envelope(env.sender, env.recipients):
        return PermFail(Reply(553, "5.6.7", f"SMTPUTF8 is required for non-ASCII "
                              f"addresses, but host {host} does not support it"))
    if env.smtputf8 and utf8_headers():
        return PermFail(Reply(550, "5.6.9", f"SMTPUTF8 is required for the UTF-8 header "
                              f"of this message, but host {host} does not support it"))
    return None


def _peer_outcome(reply: ServerReply, host: Host) -> Outcome:
    """What the server said, marked as its own.

    That is, the NDR's Remote-MTA and "smtp;" Diagnostic-Code;
    Reply.describe() adds "host X said:".
    """
    return outcome_of(reply.to_reply(remote_mta=host.name))


def _peer_outcomes(replies: Sequence[ServerReply], host: Host) -> list[Outcome]:
    """Give _peer_outcome of each reply, made once per distinct reply.

    After DATA every accepted recipient of a transaction shares the one
    final reply.
    """
    made: dict[int, Outcome] = {}
    out = []
    for r in replies:
        outcome = made.get(id(r))
        if outcome is None:
            outcome = made[id(r)] = _peer_outcome(r, host)
        out.append(outcome)
    return out


_UNSAFE_ON_WIRE = re.compile(r"[\r\n\0<>]")


def _wire_safe(address: str) -> bool:
    """Whether ``address`` can go in MAIL FROM or RCPT TO as it is."""
    return _UNSAFE_ON_WIRE.search(address) is None


def _utf8_headers(request: DeliveryRequest, head: bytes) -> bool:
    """Whether the message has a UTF-8 header block, MIME parts included.

    The head (first READ_SIZE bytes) often settles it; otherwise the
    content is read through once more, in a second handle, so the one
    that will be sent keeps its place.
    """
    scan = HeaderScan()
    scan.feed(head)
    if scan.settled or len(head) < READ_SIZE:  # the head is all there is
        return scan.close()
    with request.content() as content:
        return utf8_headers(iter(lambda: content.read(READ_SIZE), b""))


def _unreadable(request: DeliveryRequest, exc: Exception) -> Reply:
    return Reply(451, "4.3.0", f"cannot read the queued message {request.spid}: {exc}")


def _open(request: DeliveryRequest) -> tuple[IO[bytes], bytes] | Reply:
    """The queued content and its first READ_SIZE bytes, or why they cannot be read.

    The head is what session.send() sends first.
    """
    try:
        content = request.content()
    except Exception as exc:  # StorageError, OSError: the spool's fault, not the peer's
        return _unreadable(request, exc)
    try:
        return content, content.read(READ_SIZE)
    except Exception as exc:
        content.close()
        return _unreadable(request, exc)


class DeliveryAgent:
    """Delivers DeliveryRequests; one per process, shared by all deliveries."""

    def __init__(self, config: DeliveryConfig, *, hostname: str,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.config = config
        self.hostname = hostname
        self.timeouts = config.timeouts
        self.starttls = StartTls(config.starttls)
        # One context for every session: building one per STARTTLS is costly.
        self.ssl_context = ssl_context or default_ssl_context()
        self._pool = SessionPool(config.max_messages_per_connection, config.timeouts.idle,
                                 config.max_connections)
        self._opened = 0
        self._reused = 0
        self._connect_failures = 0
        self._transactions = 0

    @classmethod
    def from_config(cls, config: Config, *, ssl_context: ssl.SSLContext | None = None
                    ) -> DeliveryAgent:
        """The agent the delivery section of a configuration describes."""
        return cls(config.delivery, hostname=config.node.hostname or "localhost",
                   ssl_context=ssl_context)

    @property
    def stats(self) -> AgentStats:
        """Connections open and idle, and the counts since start."""
        return AgentStats(open=len(self._pool.sessions), idle=self._pool.idle_count,
                          connections_opened=self._opened, connections_reused=self._reused,
                          connect_failures=self._connect_failures,
                          transactions=self._transactions)

    def helo_name(self, localip: str) -> str:
        """The name to say in EHLO from ``localip``: its own, the ``*`` one, or the host name."""
        helo = self.config.helo
        return helo.get(localip) or helo.get("*") or self.hostname

    async def close(self) -> None:
        """Say QUIT on every idle connection.

        Later deliveries still work but their connections are not kept.  Call
        it before the event loop closes: uvloop waits for connections left open.
        """
        self._pool.close()
        await asyncio.sleep(0)  # let the transports flush QUIT

    # -- delivering ---------------------------------------------------------------

    async def deliver(self, request: DeliveryRequest) -> DeliveryResult:
        """Deliver ``request``; every entry gets an outcome (see DESCRIPTION)."""
        if not all(_wire_safe(e.recipient) for e in request.entries) \
                or not _wire_safe(request.entries[0].sender):
            return await self._deliver_safe_part(request)
        started = time.monotonic()
        route = request.route
        key: PoolKey = (route.transport, route.destination, request.localip)
        count = len(request.entries)
        opened = _open(request)
        if isinstance(opened, Reply):
            return self._result(request, [TempFail(opened)] * count, route.hosts[0],
                                started, new=False, failed=False)
        content, head = opened
        # Asked only when it decides something (a host without SMTPUTF8): no
        # cache, which cost more per delivery than the rare second asking.
        utf8 = functools.partial(_utf8_headers, request, head)
        try:
            for attempt in (1, 2):
                session = self._pool.take(key)
                new = session is None
                if session is None:
                    got, host = await self._connect(request)
                    if isinstance(got, Reply):
                        return self._result(request, [TempFail(got)] * count, host, started,
                                            new=True, failed=True)
                    session = got
                else:
                    self._reused += 1
                refusal = self._refuse_before_mail(session, request, env := request.envelope(),
                                                   utf8)
                if refusal is not None:
                    self._pool.give(key, session)
                    return self._result(request, [refusal] * count, session.host, started,
                                        new=new, failed=False, tls=session.tls)
                try:
                    replies = await session.send(env, content, head, request.started)
                except SessionError as exc:
                    self._pool.drop(session)
                    if exc.stale and not new and attempt == 1:
                        # A cached connection died while idle: one fresh try,
                        # with the content from the start.
                        content.close()
                        opened = _open(request)
                        if isinstance(opened, Reply):
                            return self._result(request, [TempFail(opened)] * count,
                                                session.host, started, new=False, failed=False)
                        content, head = opened
                        continue
                    return self._result(request, [TempFail(exc.reply)] * count, session.host,
                                        started, new=new, failed=False, tls=session.tls)
                except BaseException:  # cancelled mid-transaction: the session is in limbo
                    self._pool.drop(session)
                    raise
                self._transactions += 1
                # Closed before the outcome settles: the spool file may be
                # unlinked once it is durable, and the last close of an
                # unlinked 100 KB file frees its blocks, 0.3 ms of the loop.
                content.close()
                faults.point("after_reply", (e.spid for e in request.entries))
                outcomes = _peer_outcomes(replies, session.host)
                result = self._result(request, outcomes, session.host, started, new=new,
                                      failed=False, tls=session.tls)
                if request.settle is not None:
                    try:
                        await request.settle(result)
                    except BaseException:
                        self._pool.drop(session)
                        raise
                self._pool.give(key, session)
                return result
            raise AssertionError("unreachable: the second attempt always returns")
        finally:
            content.close()

    async def _deliver_safe_part(self, request: DeliveryRequest) -> DeliveryResult:
        """Fail for good the addresses that could smuggle in commands; deliver the rest.

        Addresses with CR, LF, NUL or angle brackets never reach the wire.
        """
        started = time.monotonic()
        host = request.route.hosts[0]
        if not _wire_safe(request.entries[0].sender):
            reply = Reply(553, "5.1.7", "the sender address cannot be sent over SMTP")
            return self._result(request, [PermFail(reply)] * len(request.entries), host,
                                started, new=False, failed=False)
        good = tuple(e for e in request.entries if _wire_safe(e.recipient))
        bad = PermFail(Reply(553, "5.1.3", "the recipient address cannot be sent over SMTP"))
        if not good:
            return self._result(request, [bad] * len(request.entries), host, started,
                                new=False, failed=False)
        part = await self.deliver(dataclasses.replace(request, entries=good))
        done = dict(part.outcomes)
        return dataclasses.replace(part, outcomes=tuple(
            (e, done.get(e, bad)) for e in request.entries))

    def _refuse_before_mail(self, session: Session, request: DeliveryRequest, env: Envelope,
                            utf8: Callable[[], bool]) -> Outcome | None:
        """Outcomes known from the EHLO reply and the headers of the content.

        RFC 6531 (SMTPUTF8) and RFC 1870 (SIZE).
        """
        try:
            refusal = smtputf8_refusal(env, utf8, "SMTPUTF8" in session.extensions,
                                       session.host)
        except Exception as exc:  # StorageError, OSError: reading the content again
            return TempFail(_unreadable(request, exc))
        if refusal is not None:
            return refusal
        limit = session.max_size
        if limit and env.size > limit:
            return PermFail(Reply(552, "5.3.4", f"message size {env.size} exceeds the limit "
                                  f"of {limit} bytes of host {session.host}"))
        return None

    async def _connect(self, request: DeliveryRequest) -> tuple[Session | Reply, Host]:
        """A new session with the first host that will talk, or why none would.

        The reply that explains it comes with the last host tried.
        """
        route = request.route
        localip = request.localip
        family = ipaddress.ip_address(localip).version if localip else 0
        lmtp = route.transport is Transport.LMTP
        helo = self.helo_name(localip)
        errors: list[SessionError] = []
        for host in route.hosts:
            if family and ipaddress.ip_address(host.ip).version != family:
                errors.append(SessionError(Reply(451, "4.4.1", f"cannot reach {host} from "
                                                 f"{localip}: other address family"),
                                           connected=False))
                continue
            starttls = self.starttls
            for _ in (1, 2):
                try:
                    session = await Session.open(
                        host, helo=helo, localip=localip, lmtp=lmtp, starttls=starttls,
                        timeouts=self.timeouts, ssl_context=self.ssl_context,
                        line_length_limit=self.config.smtp_line_length_limit)
                except SessionError as exc:
                    errors.append(exc)
                    if exc.tls_failed and starttls == StartTls.OPPORTUNISTIC:
                        starttls = StartTls.NONE  # Postfix "may": plain text next
                        continue
                    break
                self._opened += 1
                self._pool.add(session)
                return session, host
            self._connect_failures += 1
        # Prefer what a server said over a bare connect error: it explains more.
        said = [e for e in errors if e.connected]
        return (said or errors)[-1].reply, route.hosts[-1]

    def _result(self, request: DeliveryRequest, outcomes: list[Outcome], host: Host,
                started: float, *, new: bool, failed: bool, tls: bool = False
                ) -> DeliveryResult:
        return DeliveryResult(
            outcomes=tuple(zip(request.entries, outcomes, strict=True)),
            localip=request.localip, remotemx=host.name, remoteip=host.ip, port=host.port,
            duration_s=time.monotonic() - started, new_connection=new,
            connection_failed=failed, tls=tls)
