"""The SMTP and LMTP client: one session on one connection, on asyncio's Protocol API.

SUMMARY
    await Session.open(host, ...) -> Session, or SessionError
    await session.send(Envelope, content, head) -> tuple[ServerReply, ...] per recipient
    session.close()

DESCRIPTION
    A Session is a connection that has been greeted and has said EHLO (or
    LHLO for LMTP, RFC 2033), possibly after STARTTLS, and can carry one
    mail transaction after another:

        MAIL FROM (SIZE, BODY=8BITMIME, SMTPUTF8 when offered and the
                  addresses or the header block have UTF-8)
        RCPT TO ...             one reply per recipient
        DATA, content, "."      SMTP: one reply for the message;
                                LMTP: one reply per accepted recipient

    send() returns one reply per recipient, in envelope order: the RCPT
    reply for a refused recipient, otherwise the reply to the final dot
    (or to DATA, or to MAIL, whichever ended the transaction).

    Every reply read is marked with the SMTP phase it answers
    (ServerReply.phase, then Reply.phase: connect for the greeting, helo
    for EHLO/HELO/LHLO and STARTTLS, mail, rcpt, data for DATA's 354,
    end-of-data for the final dot), and so is the reply of a SessionError
    (the phase the connection broke in), for traffic shaping rules that
    name a phase (sluice.shaping.rules).

    Phase timeouts are RFC 5321 4.5.3.2's: connect, greeting, helo (EHLO,
    HELO, LHLO), starttls, mail, rcpt, data_init (DATA to 354),
    data_block (each wait for the socket to take more content), data_done
    (after the final dot), rset.  A timeout or a lost connection raises
    SessionError and leaves the session closed.

STRATEGIES
    Pipelining (RFC 2920).  When the server offers PIPELINING, MAIL, every
    RCPT and DATA go out in one write and the replies are read after; a
    transaction costs two round trips (MAIL..DATA, content..dot) instead
    of 3 + recipients.

    Buffered writes.  Commands are joined before they are written; small
    content goes out with the final dot in the same write, so a 1 KB
    message is two writes and two reads on a reused connection.

    Replies parsed as they arrive.  The connection's protocol object is a
    ReplyReader (sluice.delivery.replies): reading a reply that is
    already there does not yield to the loop, and a phase timeout is a
    plain loop timer (ReplyTimeout), not a task.

    EHLO, then HELO.  A 5xx to EHLO falls back to HELO (RFC 5321 3.2);
    LMTP has no fallback.  After STARTTLS the server is asked again
    (RFC 3207: forget what was learnt before).

INVARIANTS
    At most one transaction per session at a time.  A session whose
    connection failed, timed out or said 421 is closed and never used
    again (``usable`` is False).

LIMITATIONS
    No BDAT/CHUNKING, no DSN parameters, no AUTH.  Content with 8-bit
    bytes goes to a server without 8BITMIME as it is (as Postfix does by
    default), not converted to quoted-printable.

SEE ALSO
    RFC 5321, RFC 2033 (LMTP), RFC 2920 (pipelining), RFC 3207 (STARTTLS),
    RFC 6152 (8BITMIME), RFC 6531 (SMTPUTF8), RFC 1870 (SIZE),
    sluice.delivery.replies (the server's side), sluice.delivery.encoder,
    sluice.delivery.agent
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import IO

from sluice import faults
from sluice.config import DeliveryTimeouts
from sluice.delivery.encoder import DataEncoder
from sluice.delivery.replies import ReplyReader, ReplyTimeout, ServerReply
from sluice.delivery.router import Host
from sluice.model import Reply, ascii_envelope, utf8_header

# ServerReply lives in sluice.delivery.replies; it is named here too, as callers import it.
__all__ = ["Envelope", "ServerReply", "Session", "SessionError", "StartTls"]

#: Read size for content from the spool.
READ_SIZE = 65536


class StartTls(StrEnum):
    """delivery.starttls: when to ask for TLS."""

    OPPORTUNISTIC = "opportunistic"
    NONE = "none"
    REQUIRE = "require"


class SessionError(Exception):
    """The session is unusable.

    Connect failed, timed out, connection lost, or the server refused to
    talk.  ``reply`` is the TempFail reply to record for recipients without
    an answer; ``connected`` says whether a TCP connection was made;
    ``tls_failed`` that the TLS handshake failed; ``stale`` that a
    transaction broke before the server answered anything (a cached
    connection that died while idle).
    """

    def __init__(self, reply: Reply, *, connected: bool = True, tls_failed: bool = False
                 ) -> None:
        super().__init__(str(reply))
        self.reply = reply
        self.connected = connected
        self.tls_failed = tls_failed
        self.stale = False


@dataclass(frozen=True, slots=True)
class Envelope:
    """One transaction: sender, recipients and what the content needs.

    ``size`` 0 means unknown (no SIZE parameter).  ``smtputf8``: the
    message was received with SMTPUTF8 (RFC 6531), and asks for it where
    the server offers it even if it is all ASCII; where it is not
    offered, it fails only if it uses UTF-8 (see
    sluice.delivery.agent.smtputf8_refusal).  Without it, a message whose
    header block has UTF-8 still asks for SMTPUTF8 where the server
    offers it (see sluice.model.utf8_header), but does not fail where it is not offered.
    """

    sender: str
    recipients: tuple[str, ...]
    size: int = 0
    smtputf8: bool = False

    def __init__(self, sender: str, recipients: tuple[str, ...], size: int = 0,
                 smtputf8: bool = False) -> None:
        object.__setattr__(self, "sender", sender)
        object.__setattr__(self, "recipients", recipients)
        object.__setattr__(self, "size", size)
        object.__setattr__(self, "smtputf8", smtputf8)

    @property
    def needs_smtputf8(self) -> bool:
        """Whether the message needs SMTPUTF8: received with it, or an address is not ASCII."""
        return self.smtputf8 or not ascii_envelope(self.sender, self.recipients)


def default_ssl_context() -> ssl.SSLContext:
    """The client TLS context delivery uses unless given another.

    Opportunistic TLS (Postfix's "may" and "encrypt" levels): it protects
    against passive listeners; MX names are not authenticated (there is no
    DANE here), so no CA store is loaded.
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def _soft(reply: Reply, host: Host, what: str) -> Reply:
    """A refusal to talk, recorded as temporary whatever its code.

    Another MX, or the same one later, may well accept (Postfix's
    smtp_skip_5xx_greeting).
    """
    enhanced = reply.enhanced if reply.enhanced.startswith("4") else "4.4.2"
    code = reply.code if reply.is_transient else 451
    return Reply(code, enhanced, f"host {host} {what}: {reply.code} {reply.text}",
                 phase=reply.phase)


class Session:
    """A greeted, EHLO'd connection to one host; carries transactions in turn."""

    def __init__(self, host: Host, localip: str, lmtp: bool, reader: ReplyReader,
                 timeouts: DeliveryTimeouts, line_length_limit: int = 998) -> None:
        self.host = host
        #: Lines longer than this are folded on the wire (0: sent as they are).
        self.line_length_limit = line_length_limit
        self.localip = localip
        self.lmtp = lmtp
        self.timeouts = timeouts
        self._reader = reader
        self.extensions: dict[str, str] = {}
        self.tls = False
        self.messages = 0
        self.answers = 0  # replies read in the current transaction
        self.usable = True
        self.idle_since = 0.0  # loop time when it last went back to the idle pool
        self.idle_handle: asyncio.TimerHandle | None = None

    # -- opening -------------------------------------------------------------------

    @classmethod
    async def open(cls, host: Host, *, helo: str, localip: str = "", lmtp: bool = False,
                   starttls: StartTls = StartTls.OPPORTUNISTIC, timeouts: DeliveryTimeouts,
                   ssl_context: ssl.SSLContext | None = None,
                   line_length_limit: int = 998) -> Session:
        """Connect, read the greeting, EHLO/LHLO, STARTTLS per policy.

        Raises SessionError with a 4xx reply naming the host.
        """
        loop = asyncio.get_running_loop()
        reader = ReplyReader(loop)
        local_addr = (localip, 0) if localip else None
        try:
            # asyncio.timeout, not wait_for: no task of its own for each connection.
            async with asyncio.timeout(timeouts.connect):
                transport, _ = await loop.create_connection(lambda: reader, host.ip, host.port,
                                                            local_addr=local_addr)
        except TimeoutError:
            raise SessionError(Reply(451, "4.4.1", f"connect to {host}: timed out after "
                                     f"{timeouts.connect:g}s", phase="connect"),
                               connected=False) from None
        except OSError as exc:
            why = os.strerror(exc.errno) if exc.errno else str(exc)
            src = f" from {localip}" if localip else ""
            raise SessionError(Reply(451, "4.4.1", f"connect to {host}{src}: {why}",
                                     phase="connect"), connected=False) from None
        # uvloop calls connection_made after create_connection returns.
        reader.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            # Commands are written whole; don't let Nagle hold the last one back.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self = cls(host, localip, lmtp, reader, timeouts, line_length_limit)
        try:
            await self._handshake(helo, starttls, ssl_context)
        except BaseException:
            self.abort()
            raise
        return self

    async def _handshake(self, helo: str, starttls: StartTls,
                         ssl_context: ssl.SSLContext | None) -> None:
        greeting = await self._read(self.timeouts.greeting, "the initial server greeting",
                                    "connect")
        if greeting.code != 220:
            self._refused(greeting, "greeted us with")
        await self._hello(helo)
        if starttls == StartTls.NONE:
            return
        if "STARTTLS" not in self.extensions:
            if starttls == StartTls.REQUIRE:
                self.quit()
                raise SessionError(Reply(451, "4.7.4", f"TLS is required, but host {self.host} "
                                         "did not offer STARTTLS", phase="helo"))
            return
        self.write(b"STARTTLS\r\n")
        reply = await self._read(self.timeouts.starttls, "STARTTLS", "helo")
        if reply.code != 220:
            if starttls == StartTls.REQUIRE:
                self.quit()
                raise SessionError(_soft(reply.to_reply(), self.host,
                                         "refused STARTTLS, which is required, with"))
            # Opportunistic: carry on in plain text (RFC 3207 allows it).
            return
        reader = self._reader
        loop = reader.loop
        transport = reader.transport
        assert transport is not None
        try:
            new = await loop.start_tls(
                transport, reader, ssl_context or default_ssl_context(),
                server_hostname=None if self.host.name == self.host.ip else self.host.name,
                ssl_handshake_timeout=self.timeouts.starttls)
        except (OSError, ssl.SSLError, TimeoutError, ConnectionError) as exc:
            raise SessionError(Reply(451, "4.7.5", f"TLS handshake with {self.host} failed: "
                                     f"{exc}", phase="helo"), tls_failed=True) from None
        if new is None:
            raise SessionError(Reply(451, "4.4.2", f"lost connection with {self.host} "
                                     "during the TLS handshake", phase="helo"))
        reader.transport = new
        self.tls = True
        await self._hello(helo)  # RFC 3207 4.2: discard what was learnt before TLS

    async def _hello(self, helo: str) -> None:
        verb = b"LHLO " if self.lmtp else b"EHLO "
        self.write(verb + helo.encode("ascii", "replace") + b"\r\n")
        reply = await self._read(self.timeouts.helo, verb.decode().strip(), "helo")
        if reply.code == 250:
            self.extensions = _extensions(reply.lines[1:])
            return
        if self.lmtp or reply.code < 500:
            self._refused(reply, "refused " + verb.decode().strip() + " with")
        self.write(b"HELO " + helo.encode("ascii", "replace") + b"\r\n")
        reply = await self._read(self.timeouts.helo, "HELO", "helo")
        if reply.code != 250:
            self._refused(reply, "refused HELO with")
        self.extensions = {}

    def _refused(self, reply: ServerReply, what: str) -> None:
        """The server will not talk to us: try the next host (SessionError)."""
        self.quit()
        raise SessionError(_soft(reply.to_reply(), self.host, what))

    # -- I/O ---------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        """Write ``data`` to the server; nothing if the connection is gone.

        The read that follows reports the loss.
        """
        transport = self._reader.transport
        if transport is None or self._reader.lost is not None:
            return  # the read that follows reports the loss
        transport.write(data)

    async def _read(self, wait_s: float, what: str, phase: str) -> ServerReply:
        """The next reply, marked with the SMTP ``phase`` it answers (sluice.model.PHASES).

        A timeout or a lost connection is a SessionError whose reply has
        that phase too.
        """
        try:
            reply = await self._reader.reply(wait_s)
        except ReplyTimeout:
            self.abort()
            raise SessionError(Reply(451, "4.4.2", f"conversation with {self.host} timed out "
                                     f"while waiting for the reply to {what}",
                                     phase=phase)) from None
        except ConnectionError as exc:
            self.abort()
            raise SessionError(Reply(451, "4.4.2", f"lost connection with {self.host} while "
                                     f"waiting for the reply to {what}: {exc}",
                                     phase=phase)) from None
        reply.phase = phase
        self.answers += 1
        if reply.code == 421:
            # The server is closing the channel (RFC 5321 3.8): never reuse.
            self.usable = False
        return reply

    async def _drain(self, what: str) -> None:
        try:
            await self._reader.drain(self.timeouts.data_block)
        except ReplyTimeout:
            self.abort()
            raise SessionError(Reply(451, "4.4.2", f"conversation with {self.host} timed out "
                                     f"while {what}", phase="end-of-data")) from None
        except ConnectionError as exc:
            self.abort()
            raise SessionError(Reply(451, "4.4.2", f"lost connection with {self.host} while "
                                     f"{what}: {exc}", phase="end-of-data")) from None

    @property
    def alive(self) -> bool:
        """Whether the session can carry another transaction.

        It must be open, with no unsolicited reply (a server that timed us out
        sends 421 and hangs up).
        """
        r = self._reader
        return self.usable and r.lost is None and not r.replies and not r.lines

    def quit(self) -> None:
        """Say QUIT and close without waiting for the 221 (nothing depends on it)."""
        self.usable = False
        self.stop_idle_timer()
        transport = self._reader.transport
        if transport is not None and not transport.is_closing():
            if self._reader.lost is None:
                transport.write(b"QUIT\r\n")
            transport.close()

    def abort(self) -> None:
        """Drop the connection at once, without QUIT; the session is not used again."""
        self.usable = False
        self.stop_idle_timer()
        transport = self._reader.transport
        if transport is not None:
            transport.abort()

    def stop_idle_timer(self) -> None:
        """Cancel the timer that closes the session while it waits in the pool."""
        if self.idle_handle is not None:
            self.idle_handle.cancel()
            self.idle_handle = None

    # -- a transaction ------------------------------------------------------------

    @property
    def max_size(self) -> int:
        """The largest message the server takes (EHLO SIZE, RFC 1870); 0 when it set none."""
        value = self.extensions.get("SIZE", "")
        return int(value) if value.isdigit() else 0

    async def send(self, env: Envelope, content: IO[bytes], head: bytes,
                   before_data: Callable[[], Awaitable[None]] | None = None
                   ) -> tuple[ServerReply, ...]:
        """One transaction; one reply per recipient (see DESCRIPTION).

        ``head``: the first READ_SIZE bytes of the message, which the caller
        has read from ``content`` already (the agent looks at the header
        block before MAIL); the rest comes from ``content``.
        ``before_data`` is awaited once the server said 354, before the
        first byte of the message goes out (the queue manager's
        "delivering" mark is written by then).
        The caller checks SMTPUTF8 and SIZE first (these are outcomes, not
        protocol).  Raises SessionError when the session breaks; the
        session is then closed.
        """
        self.answers = 0
        try:
            return await self._transaction(env, content, head, before_data)
        except SessionError as exc:
            exc.stale = self.answers == 0
            raise

    async def _transaction(self, env: Envelope, content: IO[bytes], first: bytes,
                           before_data: Callable[[], Awaitable[None]] | None
                           ) -> tuple[ServerReply, ...]:
        if not self.alive:
            raise SessionError(Reply(451, "4.4.2", f"connection to {self.host} is not usable",
                                     phase="mail"))
        # Two pieces ahead (the caller read the first): when the second is
        # empty the whole message is known, and a 7-bit one is sent without
        # BODY=8BITMIME.
        second = content.read(READ_SIZE) if first else b""
        ext = self.extensions
        params = []
        if env.size and "SIZE" in ext:
            params.append(f" SIZE={env.size}")
        if "8BITMIME" in ext and (second or not first.isascii()):
            params.append(" BODY=8BITMIME")
        if "SMTPUTF8" in ext and (env.needs_smtputf8 or utf8_header(first)):
            params.append(" SMTPUTF8")
        mail = f"MAIL FROM:<{env.sender}>{''.join(params)}\r\n"
        rcpts = [f"RCPT TO:<{r}>\r\n" for r in env.recipients]
        count = len(rcpts)
        self.messages += 1
        pipelining = "PIPELINING" in ext
        if pipelining:
            self.write((mail + "".join(rcpts) + "DATA\r\n").encode("utf-8"))
        else:
            self.write(mail.encode("utf-8"))
        mail_reply = await self._read(self.timeouts.mail, "MAIL FROM", "mail")
        if mail_reply.code == 421:
            return (mail_reply,) * count
        if not mail_reply.is_positive and not pipelining:
            return (mail_reply,) * count
        rcpt_replies: list[ServerReply] = []
        for line in rcpts:
            if not pipelining:
                self.write(line.encode("utf-8"))
            reply = await self._read(self.timeouts.rcpt, "RCPT TO", "rcpt")
            if reply.code == 421:
                return _ended(rcpt_replies, reply, count)
            rcpt_replies.append(reply)
        if not pipelining:
            if not any(r.is_positive for r in rcpt_replies):
                await self._rset()
                return tuple(rcpt_replies)
            self.write(b"DATA\r\n")
        data_reply = await self._read(self.timeouts.data_init, "DATA", "data")
        if data_reply.code == 421:
            return _ended(rcpt_replies, data_reply, count)
        if not mail_reply.is_positive:
            # Pipelined: every RCPT and DATA were refused for want of MAIL.
            if data_reply.code == 354:  # a confused server: end the empty message
                await self._dot_then_rset()
            return (mail_reply,) * count
        accepted = [i for i, r in enumerate(rcpt_replies) if r.is_positive]
        if data_reply.code != 354:
            await self._rset()
            return _ended(rcpt_replies, data_reply, count)
        if not accepted:
            # RFC 2920 3.1: a server should refuse DATA then; this one did not.
            await self._dot_then_rset()
            return tuple(rcpt_replies)
        if before_data is not None:
            await before_data()
        faults.point("before_data")
        finals = await self._data(content, first, second, len(accepted) if self.lmtp else 1)
        out = list(rcpt_replies)
        for n, i in enumerate(accepted):
            out[i] = finals[n] if self.lmtp else finals[0]
        return tuple(out)

    async def _rset(self) -> None:
        """Clear a transaction that did not reach the final dot before reuse."""
        if not self.usable:
            return
        self.write(b"RSET\r\n")
        reply = await self._read(self.timeouts.rset, "RSET", "end-of-data")
        if reply.code != 250:
            self.quit()

    async def _dot_then_rset(self) -> None:
        self.write(b".\r\n")
        await self._read(self.timeouts.data_done, "end of data", "end-of-data")
        await self._rset()

    async def _data(self, content: IO[bytes], first: bytes, second: bytes, replies: int
                    ) -> list[ServerReply]:
        enc = DataEncoder(self.line_length_limit)
        chunk, nxt = first, second
        while True:
            out = enc.feed(chunk)
            if not nxt:
                self.write(out + enc.finish())
                # With nothing buffered, asyncio hands the bytes to the
                # kernel at once: a crash here still sends them.
                faults.point("after_dot")
                break
            self.write(out)
            if self._reader.paused:
                await self._drain("sending message content")
            chunk, nxt = nxt, content.read(READ_SIZE)
        return [await self._read(self.timeouts.data_done, "end of data", "end-of-data")
                for _ in range(replies)]


def _ended(so_far: Sequence[ServerReply], reply: ServerReply, count: int
           ) -> tuple[ServerReply, ...]:
    """Replies when ``reply`` ended the transaction early.

    Recipients already refused keep their refusal; every other one gets
    ``reply``.
    """
    out = [r if not r.is_positive else reply for r in so_far]
    out.extend([reply] * (count - len(out)))
    return tuple(out)


def _extensions(lines: Sequence[str]) -> dict[str, str]:
    """EHLO keywords (upper case) and their parameters."""
    out: dict[str, str] = {}
    for line in lines:
        keyword, _, param = line.strip().partition(" ")
        if keyword:
            out[keyword.upper()] = param.strip()
    return out
