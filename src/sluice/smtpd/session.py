"""One SMTP server session: an asyncio.Protocol speaking ESMTP, with Sluice's receive policy.

SUMMARY
    SmtpSession(settings, registry, loop)    one per connection (server.py makes them)
    session.shutdown() / session.abort()     a graceful stop's two steps

DESCRIPTION
    The session is Sluice's own SMTP server (RFC 5321); no SMTP library
    runs underneath.  data_received feeds an Inbox (sluice.smtpd.inbox);
    one task per connection, the command loop, reads lines from it, asks
    the state machine (sluice.smtpd.protocol) whether the command may come
    now, runs its handler and moves to the phase the table names.

    EHLO        one write with PIPELINING, SIZE, 8BITMIME, SMTPUTF8,
                ENHANCEDSTATUSCODES, STARTTLS (when a certificate is
                configured and the session is not yet encrypted) and AUTH
                PLAIN LOGIN (only once encrypted, and only with users).
    STARTTLS    loop.start_tls on the same protocol object; input buffered
                before the handshake is thrown away (RFC 3207 5).
    AUTH        PLAIN and LOGIN (RFC 4954, 4616), with or without an
                initial response; Credentials.check runs off the loop.
    MAIL, RCPT  parsed by sluice.smtpd.envelope; every decision comes from
                sluice.smtpd.policy as a Reply.
    DATA        read in pieces, not lines (sluice.smtpd.content), then the
                end-of-DATA hook (sluice.hooks), the Received header
                (sluice.smtpd.trace) and the queue.  The 250 is sent only
                when the queue says content and meta are durable; a
                StorageError or OSError answers 451 4.3.0.

STRATEGIES
    Bytes and time are the Connection's (sluice.smtpd.connection): the
    buffered input, replies held until the session would wait (RFC 2920),
    flow control, and the idle timer.  The end of DATA is
    sluice.smtpd.submission's (durable before 250).

    Graceful stop.  A session knows when it waits for a command (idle).
    On stop, idle sessions get 421 4.3.2 at once; busy ones (in DATA,
    waiting for the queue) get it right after the reply of what they are
    doing, so a message in flight is either answered 250 or not queued.

    Client errors are one line.  A failed TLS handshake, a reset
    connection or garbage ends the session with one INFO line, no
    traceback, so a client cannot flood the log; an error of ours is
    logged with its traceback and answered 451 4.3.0.

SEE ALSO
    sluice.smtpd.protocol, sluice.smtpd.inbox, sluice.smtpd.envelope,
    sluice.smtpd.policy, RFC 5321, RFC 1870, RFC 2920, RFC 3207, RFC 4954, RFC 6531
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import ssl
from collections.abc import Awaitable, Callable
from typing import cast

from sluice.model import Reply
from sluice.smtpd.connection import Connection
from sluice.smtpd.content import MessageBuffer, Unstuffer
from sluice.smtpd.envelope import Transaction, parse_mail_params, parse_path, undecodable
from sluice.smtpd.inbox import TOO_LONG
from sluice.smtpd.policy import (
    SHUTTING_DOWN,
    TIMED_OUT,
    Client,
    RcptAction,
    normalise_ip,
)
from sluice.smtpd.protocol import (
    LINE_TOO_LONG,
    Outcome,
    Phase,
    Verb,
    parse_command,
    render,
    rule,
)
from sluice.smtpd.settings import Registry, Settings
from sluice.smtpd.submission import Peer, finish_message, log_suppressed
from sluice.smtpd.tally import SessionTally

__all__ = ["CLIENT_CAUSED", "MAX_AUTH_FAILURES", "MAX_UNKNOWN_COMMANDS", "SmtpSession"]

log = logging.getLogger("sluice.smtpd")

#: Failed AUTH attempts before the session is closed (421 4.7.0).
MAX_AUTH_FAILURES = 3
#: Unknown commands before the session is closed (502 5.5.1): not an SMTP client.
MAX_UNKNOWN_COMMANDS = 5

# Errors a client causes (a failed TLS handshake, garbage, a dropped
# connection); anything else is ours and keeps its traceback.
CLIENT_CAUSED: tuple[type[BaseException], ...] = (
    ssl.SSLError, ConnectionError, EOFError, UnicodeError, TimeoutError)

_OK = Reply(250, "2.0.0", "OK")
_BYE = Reply(221, "2.0.0", "Bye")
_LOCAL_ERROR = Reply(451, "4.3.0", "Local error in processing, try again later")
_READY_TLS = Reply(220, "", "Ready to start TLS")
_GO_AHEAD = b"354 End data with <CR><LF>.<CR><LF>\r\n"
_AUTH_OK = Reply(235, "2.7.0", "Authentication successful")
_AUTH_INVALID = Reply(535, "5.7.8", "Authentication credentials invalid")
_AUTH_TOO_MANY = Reply(421, "4.7.0", "Too many failed authentications")
_BAD_BASE64 = Reply(501, "5.5.2", "Cannot decode base64")
_HELP = Reply(214, "2.0.0", "Commands: " + " ".join(sorted(v.value for v in Verb)))

Handler = Callable[["SmtpSession", "str | None"], Awaitable[Outcome]]


class SmtpSession(Connection):
    """One connection's ESMTP server; see the module doc."""

    def __init__(self, settings: Settings, registry: Registry,
                 loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop, settings.timeout_s)
        self._settings = settings
        self._registry = registry
        self._policy = settings.policy
        self._phase = Phase.CONNECTED
        self._esmtp = False  # the client said EHLO (not HELO)
        self._helo = ""
        self._tls = False
        self._txn: Transaction | None = None
        self._ip = ""
        self._port = 0
        self._client: Client | None = None
        self._auth_user: str | None = None
        self._auth_failures = 0
        self._unknown = 0
        self._admitted = False
        self._idle = False
        self._closing = False
        self._tally = SessionTally("", 0.0)  # what the connection did (sluice.smtpd.tally)

    # -- connection life (asyncio.Protocol) -------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Admit the client and greet it, or refuse it with a reply and close.

        Refused while shutting down or over the connection limits of the policy.
        """
        wire = cast(asyncio.Transport, transport)
        peer = wire.get_extra_info("peername")
        ip = normalise_ip(str(peer[0])) if peer else "unknown"
        self._ip, self._port = ip, int(peer[1]) if peer else 0
        self._tally = SessionTally(ip, self._settings.queue.clock())
        registry = self._registry
        refusal = SHUTTING_DOWN if registry.closing else self._policy.admit(
            registry.per_ip.get(ip, 0), len(registry.sessions))
        if refusal is not None:
            registry.bump("connections_refused")
            log.info("refused connection from %s: %s", ip, refusal)
            self._tally.replied(refusal)
            self._tally.write(self._settings.queue, "", None, 0)
            wire.write(f"{refusal.code} {refusal.enhanced} {self._settings.hostname} "
                       f"{refusal.text}\r\n".encode("ascii"))
            wire.close()
            return
        self._transport = wire
        self._admitted = True
        registry.enter(self, ip)
        self._client = self._policy.client(ip)
        wire.write(self._settings.greeting())
        self._idle = True
        self._reset_timeout()
        registry.own(self._loop.create_task(self._run()))

    def connection_lost(self, exc: Exception | None) -> None:
        """End the input (see Connection) and leave the registry if the session was admitted."""
        super().connection_lost(exc)
        if self._admitted:
            self._registry.leave(self, self._ip)

    def _timeout_cb(self) -> None:
        log.info("%s: timeout, closing", self._ip)
        self._close_with(TIMED_OUT)

    # -- stopping -------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Part of a graceful stop: 421 now if idle, else after the current reply."""
        self._closing = True
        if self._idle:
            self._close_with(SHUTTING_DOWN)

    def abort(self) -> None:
        """The end of the grace period: close whatever the session is doing."""
        self._hang_up()

    def _close_with(self, reply: Reply) -> None:
        transport = self._transport
        if transport is not None and not transport.is_closing():
            self._flush()
            self._tally.replied(reply)
            transport.write(render(reply, self._esmtp))
        self._hang_up()
        # Done from our side.  A TLS transport is lost only after the client
        # answers close_notify (or a timeout); a stop must not wait for it.
        self._registry.leave(self, self._ip)

    # -- replies --------------------------------------------------------------------------

    async def _send(self, data: bytes, final: bool = True) -> None:
        """Queue ``data`` (CRLF included); ``final``: the command is answered, idle again."""
        self._hold(data)
        if final:
            self._idle = True
            if self._closing and not data.startswith(b"221"):
                self._close_with(SHUTTING_DOWN)
                return
        await self._drain()

    async def reply(self, reply: Reply) -> None:
        """Send the reply to the current command (counted if it refuses)."""
        self._tally.replied(reply)
        await self._send(render(reply, self._esmtp))

    # -- the command loop -----------------------------------------------------------------

    async def _run(self) -> None:
        try:
            await self._serve()
        except CLIENT_CAUSED as exc:
            # the client broke the protocol or the connection: one line, no traceback
            cause = exc.__cause__ or exc
            log.info("%s: session ended by a client error: %s: %s", self._ip,
                     type(cause).__name__, cause)
        except Exception as exc:
            log.error("%s: session error: %s: %s", self._ip, type(exc).__name__, exc,
                      exc_info=exc)
        finally:
            self._flush()
            if self._transport is not None:
                self._transport.close()
            self._tally.write(self._settings.queue, self._helo, self._auth_user,
                              self._auth_failures)

    async def _serve(self) -> None:
        inbox = self._inbox
        while not self._closed:
            line = await inbox.readline()
            if line is None or self._closed:
                return
            if line is TOO_LONG:
                await self.reply(LINE_TOO_LONG)
                continue
            command = parse_command(line, self._esmtp)
            if command.error is not None:
                await self.reply(command.error)
                continue
            verb = command.verb
            if verb is None:
                await self._unknown_command(command.name)
                continue
            self._idle = False
            self._reset_timeout()
            phase = self._phase
            step = rule(phase, verb)
            if step.refusal is not None:
                await self.reply(step.refusal)
                continue
            try:
                outcome = await _HANDLERS[verb](self, command.arg)
            except CLIENT_CAUSED:
                raise
            except Exception as exc:
                log.error("%s: error in %s: %s: %s", self._ip, verb.value, type(exc).__name__,
                          exc, exc_info=exc)
                self._set_phase(Phase.READY if phase is not Phase.CONNECTED else phase)
                await self.reply(_LOCAL_ERROR)
                continue
            after = step.after(outcome)
            if after is not None:
                self._set_phase(after)

    def _set_phase(self, phase: Phase) -> None:
        self._phase = phase
        if not phase.in_transaction:
            self._txn = None

    async def _unknown_command(self, name: str) -> None:
        self._unknown += 1
        if self._unknown >= MAX_UNKNOWN_COMMANDS:
            log.info("%s: too many unknown commands, closing", self._ip)
            self._close_with(Reply(502, "5.5.1", "Too many unrecognized commands, goodbye"))
            return
        shown = name if name.isprintable() else repr(name)
        await self.reply(Reply(500, "5.5.2", f"Command {shown[:20]} not recognized"))

    # -- session commands -----------------------------------------------------------------

    async def _ehlo(self, arg: str | None) -> Outcome:
        if not arg:
            await self.reply(Reply(501, "5.5.4", "Syntax: EHLO hostname"))
            return Outcome.MALFORMED
        self._esmtp = True
        self._helo = arg
        await self._send(self._settings.ehlo_reply(self._tls))
        return Outcome.DONE

    async def _helo_cmd(self, arg: str | None) -> Outcome:
        if not arg:
            await self.reply(Reply(501, "5.5.4", "Syntax: HELO hostname"))
            return Outcome.MALFORMED
        self._esmtp = False
        self._helo = arg
        await self.reply(Reply(250, "2.0.0", self._settings.hostname))
        return Outcome.DONE

    async def _rset(self, arg: str | None) -> Outcome:
        if arg:
            await self.reply(Reply(501, "5.5.4", "Syntax: RSET"))
            return Outcome.MALFORMED
        await self.reply(_OK)
        return Outcome.DONE

    async def _noop(self, arg: str | None) -> Outcome:
        await self.reply(_OK)
        return Outcome.DONE

    async def _vrfy(self, arg: str | None) -> Outcome:
        if not arg:
            await self.reply(Reply(501, "5.5.4", "Syntax: VRFY <address>"))
            return Outcome.MALFORMED
        await self.reply(Reply(252, "2.5.0", "Cannot VRFY user, but will accept message "
                                             "and attempt delivery"))
        return Outcome.DONE

    async def _help(self, arg: str | None) -> Outcome:
        await self.reply(_HELP)
        return Outcome.DONE

    async def _quit(self, arg: str | None) -> Outcome:
        if arg:
            await self.reply(Reply(501, "5.5.4", "Syntax: QUIT"))
            return Outcome.MALFORMED
        await self.reply(_BYE)
        self._hang_up()
        return Outcome.DONE

    async def _starttls(self, arg: str | None) -> Outcome:
        if arg:
            await self.reply(Reply(501, "5.5.4", "Syntax: STARTTLS"))
            return Outcome.MALFORMED
        context = self._settings.tls_context
        if self._tls:
            await self.reply(Reply(503, "5.5.1", "TLS already active"))
            return Outcome.MALFORMED
        if context is None:
            await self.reply(Reply(454, "4.7.0", "TLS not available"))
            return Outcome.REFUSED
        await self._send(render(_READY_TLS, self._esmtp), final=False)
        self._flush()
        self._inbox.discard()  # RFC 3207 5: nothing sent before the handshake counts
        transport = self._transport
        assert transport is not None
        try:
            secure = await self._loop.start_tls(transport, self, context, server_side=True,
                                                ssl_handshake_timeout=self._timeout_s)
        except (OSError, ssl.SSLError, TimeoutError, EOFError) as exc:
            secure, failure = None, exc
        else:  # None: the connection went away during the handshake
            failure = ConnectionResetError()
        if secure is None:
            log.info("%s: TLS handshake failed: %s", self._ip, self._tally.tls_failed(failure))
            transport.close()
            return Outcome.REFUSED
        self._tally.tls_up(secure.get_extra_info("ssl_object"))
        self._transport = secure
        self._tls = True
        self._esmtp = False  # RFC 3207 4.2: forget what the client said before
        self._helo = ""
        self._idle = True  # waiting for the new EHLO
        if self._closing:
            self._close_with(SHUTTING_DOWN)
        return Outcome.DONE

    # -- AUTH (RFC 4954) --------------------------------------------------------------------

    async def _auth(self, arg: str | None) -> Outcome:
        if not self._esmtp:
            await self.reply(Reply(503, "5.5.1", "AUTH needs EHLO"))
            return Outcome.MALFORMED
        if not self._tls:
            await self.reply(Reply(538, "5.7.11", "Encryption required for requested "
                                                  "authentication mechanism"))
            return Outcome.REFUSED
        if self._auth_user is not None:
            await self.reply(Reply(503, "5.5.1", "Already authenticated"))
            return Outcome.REFUSED
        args = arg.split() if arg else []
        if not 1 <= len(args) <= 2:
            await self.reply(Reply(501, "5.5.4", "Syntax: AUTH mechanism [initial-response]"))
            return Outcome.MALFORMED
        mechanism = args[0].upper()
        if mechanism not in ("PLAIN", "LOGIN") or not self._settings.credentials:
            await self.reply(Reply(504, "5.5.4", "Unrecognized authentication type"))
            return Outcome.REFUSED
        initial = args[1] if len(args) == 2 else None
        if mechanism == "PLAIN":
            blob = await self._initial_or_challenge(initial, b"")
            if blob is None:
                return Outcome.REFUSED
            parts = blob.split(b"\x00")
            if len(parts) != 3:  # authzid NUL authcid NUL passwd (RFC 4616 2)
                await self.reply(Reply(501, "5.5.2", "Cannot split auth value"))
                return Outcome.REFUSED
            login, password = parts[1], parts[2]
        else:
            user = await self._initial_or_challenge(initial, b"Username:")
            if user is None:
                return Outcome.REFUSED
            secret = await self._challenge(b"Password:")
            if secret is None:
                return Outcome.REFUSED
            login, password = user, secret
        return await self._authenticate(mechanism, login, password)

    async def _initial_or_challenge(self, initial: str | None, prompt: bytes) -> bytes | None:
        if initial is None:
            return await self._challenge(prompt)
        if initial == "=":  # RFC 4954 4: an empty initial response
            return b""
        return await self._decode(initial.encode("utf-8", "surrogateescape"))

    async def _challenge(self, prompt: bytes) -> bytes | None:
        """Send a 334 challenge and read the answer; None (and a reply sent) if there is none."""
        await self._send(b"334 " + base64.b64encode(prompt) + b"\r\n", final=False)
        line = await self._inbox.readline()
        if line is None:
            return None
        if line is TOO_LONG:
            await self.reply(LINE_TOO_LONG)
            return None
        answer = line.strip()
        if answer == b"*":
            await self.reply(Reply(501, "5.7.0", "Authentication aborted"))
            return None
        return await self._decode(answer)

    async def _decode(self, data: bytes) -> bytes | None:
        try:
            return base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            await self.reply(_BAD_BASE64)
            return None

    async def _authenticate(self, mechanism: str, login: bytes, password: bytes) -> Outcome:
        self._flush()
        # Off the loop (Credentials.check runs it on its own small pool):
        # password hashes are slow on purpose.
        ok = await self._settings.credentials.check(login, password)
        user = login.decode("utf-8", "replace")
        if ok:
            self._auth_user = user
            assert self._client is not None
            self._client = Client(self._client.ip, self._client.trusted, user)
            log.info("%s: authenticated as %s (%s)", self._ip, user, mechanism)
            await self.reply(_AUTH_OK)
            return Outcome.DONE
        self._auth_failures += 1
        log.info("%s: AUTH %s failed for %r", self._ip, mechanism, user)
        await self.reply(_AUTH_INVALID)
        if self._auth_failures >= MAX_AUTH_FAILURES:
            self._close_with(_AUTH_TOO_MANY)
        return Outcome.REFUSED

    # -- the mail transaction -------------------------------------------------------------

    async def _mail(self, arg: str | None) -> Outcome:
        assert self._client is not None
        if not arg or arg[:5].upper() != "FROM:":
            await self.reply(Reply(501, "5.5.4", "Syntax: MAIL FROM:<address>"))
            return Outcome.MALFORMED
        address, params = parse_path(arg[5:])
        if address is None or undecodable(address):
            await self.reply(Reply(553, "5.1.3", "Malformed sender address"))
            return Outcome.REFUSED
        if params and not self._esmtp:
            await self.reply(Reply(555, "5.5.4", "MAIL parameters need EHLO"))
            return Outcome.REFUSED
        parsed = parse_mail_params(params)
        if isinstance(parsed, Reply):
            await self.reply(parsed)
            return Outcome.REFUSED
        if not parsed.smtputf8 and not address.isascii():
            await self.reply(Reply(553, "5.6.7", "Non-ASCII sender address needs SMTPUTF8"))
            return Outcome.REFUSED
        verdict = self._policy.sender(self._client, parsed.size)
        await self.reply(verdict)
        if verdict.code != 250:
            return Outcome.REFUSED
        self._txn = Transaction(sender=address, smtputf8=parsed.smtputf8)
        return Outcome.DONE

    async def _rcpt(self, arg: str | None) -> Outcome:
        txn = self._txn
        assert txn is not None  # the table: after MAIL only
        assert self._client is not None
        if not arg or arg[:3].upper() != "TO:":
            await self.reply(Reply(501, "5.5.4", "Syntax: RCPT TO:<address>"))
            return Outcome.MALFORMED
        registry = self._registry
        address, params = parse_path(arg[3:])
        refusal: Reply | None = None
        if not address or undecodable(address):
            refusal = Reply(553, "5.1.3", "Malformed recipient address")
        elif params:
            refusal = Reply(555, "5.5.4", "RCPT parameters not supported")
        elif not txn.smtputf8 and not address.isascii():
            refusal = Reply(553, "5.6.7", "Non-ASCII recipient address needs SMTPUTF8")
        if refusal is not None:
            registry.bump("recipients_refused")
            await self.reply(refusal)
            return Outcome.REFUSED
        assert address is not None
        verdict = self._policy.recipient(
            self._client, address, len(txn.recipients) + len(txn.dropped))
        if verdict.action is RcptAction.ACCEPT:
            txn.recipients.append(address)
            registry.bump("recipients_accepted")
        elif verdict.action is RcptAction.DROP:
            assert verdict.suppressed is not None
            txn.dropped.append((address, verdict.suppressed))
            registry.bump("recipients_dropped")
        else:
            registry.bump("recipients_refused")
            if verdict.suppressed is not None:
                log_suppressed(self._settings.queue, txn, [(address, verdict.suppressed)],
                               None, 0)
            log.info("%s: RCPT <%s> refused: %s", self._ip, address, verdict.reply)
            await self.reply(verdict.reply)
            return Outcome.REFUSED
        await self.reply(verdict.reply)
        return Outcome.DONE

    async def _data(self, arg: str | None) -> Outcome:
        txn = self._txn
        assert txn is not None  # the table: after an accepted RCPT only
        if arg:
            await self.reply(Reply(501, "5.5.4", "Syntax: DATA"))
            return Outcome.MALFORMED
        await self._send(_GO_AHEAD, final=False)
        buf = await self._read_data()
        if buf is None:
            return Outcome.DONE  # the client went away mid-DATA
        try:
            self._flush()  # earlier replies need not wait for the hook and the disk
            peer = Peer(self._ip, self._port, self._helo, self._esmtp, self._tls,
                        self._auth_user, self._tally.client(self._helo, self._auth_user))
            answer = await finish_message(self._settings, self._registry, peer, txn, buf)
        finally:
            buf.close()
        await self.reply(answer)
        return Outcome.DONE

    async def _read_data(self) -> MessageBuffer | None:
        settings = self._settings
        policy = self._policy
        buf = MessageBuffer(policy.max_message_size, policy.line_limit,
                            settings.spill_size, settings.spill_dir)
        unstuffer = Unstuffer()
        inbox = self._inbox
        while True:
            raw = await inbox.read_data_piece()
            if raw is None:
                buf.close()
                if self._transport is not None:
                    self._transport.close()
                return None
            text, ended = unstuffer.feed(raw)
            if text:
                buf.write(text)
            if ended:
                return buf
            self._reset_timeout()  # a slow, big message is not an idle client

#: The handler of each command; the table in sluice.smtpd.protocol says when it may run.
_HANDLERS: dict[Verb, Handler] = {
    Verb.EHLO: SmtpSession._ehlo,
    Verb.HELO: SmtpSession._helo_cmd,
    Verb.MAIL: SmtpSession._mail,
    Verb.RCPT: SmtpSession._rcpt,
    Verb.DATA: SmtpSession._data,
    Verb.RSET: SmtpSession._rset,
    Verb.NOOP: SmtpSession._noop,
    Verb.VRFY: SmtpSession._vrfy,
    Verb.HELP: SmtpSession._help,
    Verb.QUIT: SmtpSession._quit,
    Verb.STARTTLS: SmtpSession._starttls,
    Verb.AUTH: SmtpSession._auth,
}
