"""One SMTP session: the adapter between aiosmtpd and our typed receive policy.

SUMMARY
    Settings (what every session of a receiver shares), Registry (open
    sessions and counters), SmtpSession(settings, registry): an
    aiosmtpd.smtp.SMTP protocol object, one per connection.

DESCRIPTION
    aiosmtpd does the protocol plumbing that it does well: reading command
    lines, STARTTLS, the AUTH PLAIN/LOGIN exchanges, HELO, RSET, NOOP,
    QUIT, VRFY, HELP.  This class replaces the parts where Sluice has
    rules of its own:

    EHLO        one write with PIPELINING, SIZE, 8BITMIME, SMTPUTF8,
                ENHANCEDSTATUSCODES, STARTTLS (when a certificate is
                configured and the session is not yet encrypted) and AUTH
                PLAIN LOGIN (only once encrypted, and only with users).
    MAIL, RCPT  parsed here; every decision comes from
                sluice.smtpd.policy as a Reply.
    DATA        read in pieces, not lines (sluice.smtpd.content), then the
                end-of-DATA hook (sluice.hooks), the Received header
                (sluice.smtpd.trace) and Queue.submit_future.  The 250 is
                sent only when the future says content and meta are
                durable; any StorageError or OSError answers 451 4.3.0.

    Replies that aiosmtpd words itself ("250 OK", "503 Error: send HELO
    first") get an RFC 3463 code added on their way out when the client
    said EHLO, so ENHANCEDSTATUSCODES holds for every reply (RFC 2034),
    except the greeting and the 334/354 continuations.

STRATEGIES
    Idle timeout without a timer per command.  aiosmtpd cancels and
    schedules a loop timer for every command; a session here only moves
    its deadline forward, and its one timer, when it fires before the
    deadline, sets itself again for the deadline.

    Lean connections.  aiosmtpd's constructor inspects the handler and the
    class with inspect.getmembers on every connection; with a connection
    per message that was an eighth of the accept path's CPU.  SmtpSession
    sets the same attributes from tables computed once per class
    (tests/unit/test_smtpd_session.py compares them with aiosmtpd's own).

    Durable before 250.  The queue's future is awaited one way only: a
    session that goes away never cancels it, because the committer thread
    owns it and the message may already be committed (the client then
    retries; a duplicate is allowed, a loss is not).

    Spool writes off the loop.  Creating a spool file waits while the file
    system commits other messages' fsyncs; on the event loop that stalled
    every session.  Submissions that write a file go through a Handoff
    thread (sluice.smtpd.handoff); small ones that the store keeps in its
    own commit need no file and go to the store's committer directly.

    Graceful stop.  A session knows when it waits for a command (idle).
    On stop, idle sessions get 421 4.3.2 at once; busy ones (in DATA,
    waiting for the queue) get it right after the reply of what they are
    doing, so a message in flight is either answered 250 or not queued.

INVARIANTS
    Only this module touches aiosmtpd's Session and Envelope objects; the
    transaction itself is kept in a _Transaction.

SEE ALSO
    sluice.smtpd.policy, sluice.smtpd.content, sluice.smtpd.server,
    RFC 5321, RFC 1870, RFC 2920, RFC 3207, RFC 4954, RFC 6531
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import aiosmtpd.smtp
from aiosmtpd.smtp import (
    SMTP,
    AuthResult,
    Envelope,
    LoginPassword,
    Session,
    _AuthMechAttr,
    syntax,
)

from sluice.accounting import EventKind, make_event
from sluice.hooks import Accept, EndOfData, Hooks, Reject
from sluice.model import Accepted, QueueEntry, QueueState, Reply, Submission
from sluice.queue import Queue
from sluice.smtpd.content import MessageBuffer, Unstuffer
from sluice.smtpd.credentials import Credentials
from sluice.smtpd.dedupe import Origin
from sluice.smtpd.handoff import Handoff, await_durable
from sluice.smtpd.policy import (
    NO_VALID_RECIPIENTS,
    QUEUE_FAILED,
    SHUTTING_DOWN,
    TIMED_OUT,
    Client,
    ContentState,
    RcptAction,
    ReceivePolicy,
    normalise_ip,
)
from sluice.smtpd.trace import protocol_name, received_header
from sluice.spool import new_spid
from sluice.store import StorageError
from sluice.suppression import SuppressionEntry

__all__ = ["ReceiverStats", "Registry", "Settings", "SmtpSession"]

log = logging.getLogger("sluice.smtpd")

_sanitized_log = aiosmtpd.smtp.sanitized_log


def _sanitized_log_if_enabled(func: Callable[..., None], msg: Any, *args: Any,
                              **kwargs: Any) -> None:
    """aiosmtpd.smtp.sanitized_log, skipped when its logger would drop the line.

    aiosmtpd sanitises (AUTH secrets masked by a regular expression) every
    command line twice, for a debug and an info line, before the logger
    decides to drop both; that cost a few per cent of a receiver's CPU.
    """
    level = _LEVELS.get(getattr(func, "__func__", None))
    if level is not None and not func.__self__.isEnabledFor(level):  # type: ignore[attr-defined]
        return
    _sanitized_log(func, msg, *args, **kwargs)


#: The level of each Logger method aiosmtpd logs with (bound methods are new
#: objects on every access; their function is not).
_LEVELS: dict[object, int] = {
    logging.Logger.debug: logging.DEBUG, logging.Logger.info: logging.INFO,
    logging.Logger.warning: logging.WARNING, logging.Logger.error: logging.ERROR,
    logging.Logger.critical: logging.CRITICAL,
}


aiosmtpd.smtp.sanitized_log = _sanitized_log_if_enabled

#: aiosmtpd reads commands with this limit; DATA is read in pieces up to it.
READ_LIMIT = 65536
#: Failed AUTH attempts before the session is closed (421 4.7.0).
MAX_AUTH_FAILURES = 3

_CRLF = b"\r\n"
_END_MARK = b".\r\n"
#: aiosmtpd's handler hooks and AUTH mechanisms when there are none; never mutated.
_NO_HOOKS: dict[str, Callable[..., Any]] = {}
_NO_AUTH: dict[str, _AuthMechAttr] = {}
#: Codes aiosmtpd sends without an enhanced code, and the one to add (RFC 3463).
_ENHANCED = {
    b"221": b"2.0.0", b"250": b"2.0.0", b"252": b"2.5.0",
    b"421": b"4.7.0", b"451": b"4.3.0", b"454": b"4.7.0",
    b"500": b"5.5.2", b"501": b"5.5.4", b"502": b"5.5.1", b"503": b"5.5.1",
    b"504": b"5.5.4", b"530": b"5.7.0", b"535": b"5.7.8", b"538": b"5.7.11",
    b"552": b"5.3.4", b"553": b"5.1.3", b"554": b"5.7.0", b"555": b"5.5.4",
}
_ENHANCED_RE = re.compile(rb"[245]\.\d{1,3}\.\d{1,3}(?: |$)")
_UNCODED = frozenset((b"220", b"334", b"354"))

# Envelope syntax.  Addresses are parsed here rather than with aiosmtpd's
# email-header parser, which was a tenth of the accept path's CPU.
_ATOM_LOCAL = r'[^\s@<>()\\,;:"\[\]]+'
_QUOTED_LOCAL = r'"(?:[^"\\\r\n]|\\.)*"'
_DOMAIN = r'(?:\[[^\[\]\s\\]+\]|[^\s@<>()\\,;:"\[\]]+)'
_MAILBOX_RE = re.compile(rf"^(?:{_ATOM_LOCAL}|{_QUOTED_LOCAL})@{_DOMAIN}$")
_ROUTE_RE = re.compile(r"^@[^:]*:")  # RFC 5321 4.1.2 obsolete source route, ignored
_MAX_PATH = 256  # RFC 5321 4.5.3.1.3


class _Limits(dict[str, int]):
    """Command line limits: a missing command gets the default, without being added."""

    def __missing__(self, key: str) -> int:
        return SMTP.command_size_limit


#: RFC 1870 4 and RFC 6531 3.4: MAIL may be longer by SIZE= and SMTPUTF8.
_ESMTP_LIMITS = _Limits({"MAIL": SMTP.command_size_limit + 26 + 10})
_SMTP_LIMITS = _Limits()


@dataclass(frozen=True, slots=True)
class ReceiverStats:
    """Counters of one receiver since it started."""

    connections: int = 0  # open now
    connections_total: int = 0
    connections_refused: int = 0  # 421 at connect
    messages_accepted: int = 0
    messages_refused: int = 0  # refused after DATA (size, lines, hook, queue)
    queue_failures: int = 0  # of which: the store failed (451 4.3.0)
    recipients_accepted: int = 0
    recipients_refused: int = 0
    recipients_dropped: int = 0  # suppressed in drop mode
    bytes_accepted: int = 0


@dataclass(frozen=True, slots=True)
class Settings:
    """What every session of one receiver shares; built by sluice.smtpd.server."""

    hostname: str
    queue: Queue
    policy: ReceivePolicy
    credentials: Credentials = field(default_factory=Credentials)
    hooks: Hooks = field(default_factory=Hooks)
    tls_context: ssl.SSLContext | None = None
    timeout_s: float = 300.0
    spill_size: int = 1 << 20
    spill_dir: str | None = None
    on_accepted: Callable[[Accepted, Submission], None] | None = None
    ident: str = "ESMTP Sluice"
    #: Runs Queue.submit_future off the event loop (sluice.smtpd.handoff);
    #: None runs it on the loop.
    handoff: Handoff | None = None
    _ehlo: tuple[bytes, bytes] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Built once: with a connection per message, EHLO is on the hot path.
        object.__setattr__(self, "_ehlo", (self._build_ehlo(False), self._build_ehlo(True)))

    def ehlo_reply(self, tls_active: bool) -> bytes:
        """The whole multi-line EHLO reply, as one write."""
        return self._ehlo[tls_active]

    def _build_ehlo(self, tls_active: bool) -> bytes:
        lines = [
            self.hostname, "PIPELINING", f"SIZE {self.policy.max_message_size}", "8BITMIME",
            "SMTPUTF8", "ENHANCEDSTATUSCODES",
        ]
        if self.tls_context is not None and not tls_active:
            lines.append("STARTTLS")
        if tls_active and self.credentials:
            lines.append("AUTH PLAIN LOGIN")
        out = [f"250-{line}" for line in lines[:-1]] + [f"250 {lines[-1]}"]
        return ("\r\n".join(out) + "\r\n").encode("ascii")


class Registry:
    """Open sessions and counters of one receiver (event loop thread only)."""

    def __init__(self) -> None:
        self.sessions: set[SmtpSession] = set()
        self.per_ip: dict[str, int] = {}
        self.closing = False
        self.counts: dict[str, int] = dict.fromkeys(ReceiverStats.__slots__, 0)
        self.idle_changed = asyncio.Event()

    def bump(self, name: str, n: int = 1) -> None:
        self.counts[name] += n

    def snapshot(self) -> ReceiverStats:
        counts = dict(self.counts)
        counts["connections"] = len(self.sessions)
        return ReceiverStats(**counts)

    def enter(self, session: SmtpSession, ip: str) -> None:
        self.sessions.add(session)
        self.per_ip[ip] = self.per_ip.get(ip, 0) + 1
        self.counts["connections_total"] += 1

    def leave(self, session: SmtpSession, ip: str) -> None:
        if session not in self.sessions:
            return
        self.sessions.discard(session)
        left = self.per_ip.get(ip, 1) - 1
        if left > 0:
            self.per_ip[ip] = left
        else:
            self.per_ip.pop(ip, None)
        self.idle_changed.set()


class _Session(Session):
    # aiosmtpd logs a deprecation warning whenever smtp_AUTH sets
    # login_data; a plain attribute shadows that property.
    login_data: Any = None


@dataclass(slots=True)
class _Transaction:
    """One mail transaction, from MAIL FROM to the end of DATA or RSET."""

    sender: str
    smtputf8: bool = False
    recipients: list[str] = field(default_factory=list)
    dropped: list[tuple[str, SuppressionEntry]] = field(default_factory=list)
    attempts: int = 0  # RCPT commands, also the refused ones


def _parse_path(arg: str) -> tuple[str | None, str]:
    """'<a@b> SIZE=10' -> ('a@b', 'SIZE=10'); '<>' -> ('', ...); None if malformed."""
    text = arg.strip()
    if text.startswith("<"):
        end = text.find(">")
        if end < 0:
            return None, ""
        address, rest = text[1:end].strip(), text[end + 1 :]
    else:
        address, _, rest = text.partition(" ")
    if address.startswith("@"):
        address = _ROUTE_RE.sub("", address)
    if len(address) > _MAX_PATH or any(ord(ch) < 32 or ord(ch) == 127 for ch in address):
        return None, ""
    if address and not _MAILBOX_RE.match(address):
        return None, ""
    return address, rest.strip()


def _surrogates(text: str) -> bool:
    # aiosmtpd decodes arguments as UTF-8 with surrogateescape: a surrogate
    # means the client sent bytes that are not UTF-8.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


class SmtpSession(SMTP):
    """aiosmtpd's protocol object with Sluice's policy; see the module doc."""

    line_length_limit = READ_LIMIT
    AuthLoginUsernameChallenge = "Username:"
    AuthLoginPasswordChallenge = "Password:"
    _COMMANDS: tuple[str, ...] = ()  # filled in below the class

    # -- construction -------------------------------------------------------------

    def __init__(self, settings: Settings, registry: Registry,
                 loop: asyncio.AbstractEventLoop) -> None:
        # What SMTP.__init__ sets, without its per-connection introspection.
        # Keep in step with aiosmtpd (tests/unit/test_smtpd_session.py).
        self.__ident__ = settings.ident
        self.loop = loop
        asyncio.StreamReaderProtocol.__init__(
            self, asyncio.StreamReader(loop=loop, limit=self.line_length_limit),
            client_connected_cb=self._cb_client_connected, loop=loop)
        self.event_handler = None
        self.data_size_limit = settings.policy.max_message_size
        self.enable_SMTPUTF8 = True
        self._decode_data = False
        self.command_size_limits = _SMTP_LIMITS
        self.hostname = settings.hostname
        self.tls_context = settings.tls_context
        self.require_starttls = False
        self._timeout_duration = settings.timeout_s
        self._timeout_handle: asyncio.TimerHandle | None = None
        self._deadline = 0.0  # loop time after which an idle session is closed
        self._timer_at = math.inf  # when the armed timer fires (inf: none armed)
        self._tls_handshake_okay = True
        self._tls_protocol: Any = None
        self._original_transport: asyncio.BaseTransport | None = None
        self.session: Session | None = None
        self.envelope: Envelope | None = None
        self.transport: asyncio.BaseTransport | None = None
        self._handler_coroutine: asyncio.Task[None] | None = None
        self._auth_require_tls = True
        self._proxy_timeout = None
        self._authenticator = None
        self._auth_callback = None
        self._auth_required = False
        self._handle_hooks = _NO_HOOKS
        self._ehlo_hook_ver = None
        self._smtp_methods = {name: getattr(self, "smtp_" + name) for name in self._COMMANDS}
        self._enforce_call_limit = False
        self._auth_methods = (
            {"LOGIN": _AuthMechAttr(self.auth_LOGIN, True),
             "PLAIN": _AuthMechAttr(self.auth_PLAIN, True)}
            if settings.credentials else _NO_AUTH)
        # Ours.
        self._settings = settings
        self._registry = registry
        self._policy = settings.policy
        self._ip = ""
        self._port = 0
        self._client: Client | None = None
        self._txn: _Transaction | None = None
        self._auth_user: str | None = None
        self._auth_failures = 0
        self._offered: LoginPassword | None = None  # AUTH credentials awaiting their check
        self._admitted = False
        self._idle = False
        self._closing = False

    def _create_session(self) -> Session:
        return _Session(self.loop)

    # -- connection life ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self._original_transport is not None:  # the TLS layer after STARTTLS
            super().connection_made(transport)
            self._idle = True  # waiting for the new EHLO
            return
        peer = transport.get_extra_info("peername")
        ip = normalise_ip(str(peer[0])) if peer else "unknown"
        self._ip, self._port = ip, int(peer[1]) if peer else 0
        registry = self._registry
        refusal = SHUTTING_DOWN if registry.closing else self._policy.admit(
            registry.per_ip.get(ip, 0), len(registry.sessions))
        if refusal is not None:
            registry.bump("connections_refused")
            log.info("refused connection from %s: %s", ip, refusal)
            cast(asyncio.WriteTransport, transport).write(
                f"{refusal.code} {refusal.enhanced} {self.hostname} {refusal.text}\r\n"
                .encode("ascii"))
            transport.close()
            return
        self._admitted = True
        registry.enter(self, ip)
        self._client = self._policy.client(ip)
        super().connection_made(transport)
        assert self._handler_coroutine is not None
        self._handler_coroutine.add_done_callback(_retrieve)

    def connection_lost(self, error: Exception | None) -> None:
        if not self._admitted:
            return
        self._registry.leave(self, self._ip)
        super().connection_lost(error)

    def eof_received(self) -> bool | None:
        # aiosmtpd cancels its command loop and keeps the transport half
        # open; a loop cancelled before it ever ran never closes it, so a
        # client that connects and leaves at once would hold its session until
        # the idle timeout.  The client will send nothing more: close.
        if self._admitted:
            super().eof_received()
        return False

    def _reset_timeout(self, duration: float | None = None) -> None:
        # aiosmtpd calls this when a command starts: the session is busy.
        self._idle = False
        loop = self.loop
        deadline = loop.time() + (duration or self._timeout_duration)
        self._deadline = deadline
        if self._timer_at > deadline:  # none armed, or armed for later than this
            if self._timeout_handle is not None:
                self._timeout_handle.cancel()
            self._timer_at = deadline
            self._timeout_handle = loop.call_at(deadline, self._timeout_check)

    def _timeout_check(self) -> None:
        deadline = self._deadline
        if self.loop.time() < deadline:  # the session was busy meanwhile
            self._timer_at = deadline
            self._timeout_handle = self.loop.call_at(deadline, self._timeout_check)
            return
        self._timer_at = math.inf
        self._timeout_cb()

    def _timeout_cb(self) -> None:
        log.info("%s: timeout, closing", self._ip)
        self._close_with(TIMED_OUT)

    def shutdown(self) -> None:
        """Part of a graceful stop: 421 now if idle, else after the current reply."""
        self._closing = True
        if self._idle:
            self._close_with(SHUTTING_DOWN)

    def _close_with(self, reply: Reply) -> None:
        transport = self.transport
        if transport is not None and not transport.is_closing():
            cast(asyncio.WriteTransport, transport).write(self._render(reply))
            transport.close()
        # Done from our side.  A TLS transport is lost only after the client
        # answers close_notify (or a 30 s timeout); a stop must not wait for it.
        self._registry.leave(self, self._ip)

    def abort(self) -> None:
        """The end of the grace period: close whatever the session is doing."""
        if self.transport is not None:
            self.transport.close()

    # -- replies -------------------------------------------------------------------

    def _render(self, reply: Reply) -> bytes:
        session = self.session
        if reply.enhanced and (session is None or session.extended_smtp
                               or reply.code == 421):
            line = f"{reply.code} {reply.enhanced} {reply.text}"
        else:
            line = f"{reply.code} {reply.text}"
        return line.encode("utf-8", "surrogateescape") + _CRLF

    async def reply(self, reply: Reply) -> None:
        await self._send(self._render(reply), final=True)

    async def push(self, status: str | bytes) -> None:
        """aiosmtpd's replies, with an enhanced code added (see the module doc)."""
        data = status.encode("utf-8", "surrogateescape") if isinstance(status, str) else status
        code = data[:3]
        final = data[3:4] != b"-" and code not in (b"334", b"354")
        session = self.session
        if (session is not None and session.extended_smtp and code not in _UNCODED
                and not _ENHANCED_RE.match(data, 4)):
            enhanced = _ENHANCED.get(code)
            if enhanced is None:
                enhanced = code[:1] + b".0.0"
            data = code + data[3:4] + enhanced + b" " + data[4:]
        await self._send(data + _CRLF, final=final)

    async def _send(self, data: bytes, final: bool) -> None:
        writer = self._writer
        writer.write(data)
        if final:
            self._idle = True
            if self._closing and not data.startswith(b"221"):
                self._close_with(SHUTTING_DOWN)
                return
        await writer.drain()

    async def handle_exception(self, error: Exception) -> str:
        if isinstance(error, CLIENT_CAUSED):
            # the client broke the protocol or the connection: one line, no
            # traceback, so an attacker cannot flood the log with them
            cause = error.__cause__ or error
            log.info("%s: session ended by a client error: %s: %s", self._ip,
                     type(cause).__name__, cause)
        else:
            log.error("%s: session error: %s: %s", self._ip, type(error).__name__, error,
                      exc_info=error)
        return "451 4.3.0 Local error in processing, try again later"

    # -- session commands -----------------------------------------------------------

    @syntax("EHLO hostname")
    async def smtp_EHLO(self, hostname: str | None) -> None:
        if not hostname:
            await self.push("501 5.5.4 Syntax: EHLO hostname")
            return
        self._set_rset_state()
        assert self.session is not None
        self.session.extended_smtp = True
        self.session.host_name = hostname
        self.command_size_limits = _ESMTP_LIMITS
        await self._send(self._settings.ehlo_reply(self._tls_protocol is not None), final=True)

    def _set_post_data_state(self) -> None:
        self._txn = None
        self.envelope = None

    def _set_rset_state(self) -> None:
        self._txn = None
        self.envelope = None

    def _authenticate(self, mechanism: str, auth_data: LoginPassword) -> AuthResult:
        # aiosmtpd calls this synchronously from auth_PLAIN/auth_LOGIN, but a
        # slow hash must not run on the loop: only note what to check, and
        # let _checked (awaited by our auth_* methods) do the check.
        self._offered = auth_data
        return AuthResult(success=False, handled=False)

    async def auth_PLAIN(self, server: Any, args: list[str]) -> AuthResult:
        return await self._checked("PLAIN", await super().auth_PLAIN(server, args))

    async def auth_LOGIN(self, server: Any, args: list[str]) -> AuthResult:
        return await self._checked("LOGIN", await super().auth_LOGIN(server, args))

    async def _checked(self, mechanism: str, parsed: AuthResult) -> AuthResult:
        offered, self._offered = self._offered, None
        if offered is None:
            return parsed  # aiosmtpd answered already (bad base64, cancelled)
        login = offered.login.decode("utf-8", "replace")
        if await self._settings.credentials.check(offered.login, offered.password):
            self._auth_user = login
            assert self._client is not None
            self._client = Client(self._client.ip, self._client.trusted, login)
            log.info("%s: authenticated as %s (%s)", self._ip, login, mechanism)
            return AuthResult(success=True, handled=True, auth_data=login)
        self._auth_failures += 1
        log.info("%s: AUTH %s failed for %r", self._ip, mechanism, login)
        return AuthResult(success=False, handled=False)

    @syntax("AUTH <mechanism>")
    async def smtp_AUTH(self, arg: str | None) -> None:
        # aiosmtpd's AUTH wants an Envelope to hand to authenticators.
        self.envelope = self.envelope or Envelope()
        await super().smtp_AUTH(arg)
        if self._auth_failures >= MAX_AUTH_FAILURES and self.transport is not None:
            await self.reply(Reply(421, "4.7.0", "Too many failed authentications"))
            self.transport.close()

    # -- the mail transaction ---------------------------------------------------------

    @syntax("MAIL FROM: <address>", extended=" [SP <mail-parameters>]")
    async def smtp_MAIL(self, arg: str | None) -> None:
        if await self.check_helo_needed():
            return
        session = self.session
        assert session is not None
        assert self._client is not None
        if self._txn is not None:
            await self.reply(Reply(503, "5.5.1", "Nested MAIL command"))
            return
        if not arg or arg[:5].upper() != "FROM:":
            await self.reply(Reply(501, "5.5.4", "Syntax: MAIL FROM:<address>"))
            return
        address, params = _parse_path(arg[5:])
        if address is None or _surrogates(address):
            await self.reply(Reply(553, "5.1.3", "Malformed sender address"))
            return
        size: int | None = None
        smtputf8 = False
        if params and not session.extended_smtp:
            await self.reply(Reply(555, "5.5.4", "MAIL parameters need EHLO"))
            return
        for param in params.split():
            key, eq, value = param.partition("=")
            key = key.upper()
            if key == "SIZE" and value.isdigit() and value.isascii():
                size = int(value)
            elif key == "BODY" and value.upper() in ("7BIT", "8BITMIME"):
                pass
            elif key == "SMTPUTF8" and not eq:
                smtputf8 = True
            elif key == "AUTH" and value:
                pass  # RFC 4954 5: we need not trust it, and do not
            elif key in ("SIZE", "BODY", "SMTPUTF8"):
                await self.reply(Reply(501, "5.5.4", f"Bad {key} parameter"))
                return
            else:
                await self.reply(Reply(555, "5.5.4", f"MAIL parameter {key} not supported"))
                return
        if not smtputf8 and not address.isascii():
            await self.reply(Reply(553, "5.6.7", "Non-ASCII sender address needs SMTPUTF8"))
            return
        verdict = self._policy.sender(self._client, size)
        if verdict.code == 250:
            self._txn = _Transaction(sender=address, smtputf8=smtputf8)
        await self.reply(verdict)

    @syntax("RCPT TO: <address>", extended=" [SP <mail-parameters>]")
    async def smtp_RCPT(self, arg: str | None) -> None:
        if await self.check_helo_needed():
            return
        txn = self._txn
        if txn is None:
            await self.reply(Reply(503, "5.5.1", "Need MAIL command"))
            return
        assert self._client is not None
        if not arg or arg[:3].upper() != "TO:":
            await self.reply(Reply(501, "5.5.4", "Syntax: RCPT TO:<address>"))
            return
        txn.attempts += 1
        address, params = _parse_path(arg[3:])
        if not address or _surrogates(address):
            self._registry.bump("recipients_refused")
            await self.reply(Reply(553, "5.1.3", "Malformed recipient address"))
            return
        if params:
            self._registry.bump("recipients_refused")
            await self.reply(Reply(555, "5.5.4", "RCPT parameters not supported"))
            return
        if not txn.smtputf8 and not address.isascii():
            self._registry.bump("recipients_refused")
            await self.reply(Reply(553, "5.6.7", "Non-ASCII recipient address needs SMTPUTF8"))
            return
        verdict = self._policy.recipient(
            self._client, address, len(txn.recipients) + len(txn.dropped))
        if verdict.action is RcptAction.ACCEPT:
            txn.recipients.append(address)
            self._registry.bump("recipients_accepted")
        elif verdict.action is RcptAction.DROP:
            assert verdict.suppressed is not None
            txn.dropped.append((address, verdict.suppressed))
            self._registry.bump("recipients_dropped")
        else:
            self._registry.bump("recipients_refused")
            if verdict.suppressed is not None:
                self._log_suppressed(txn, [(address, verdict.suppressed)], None, 0)
            log.info("%s: RCPT <%s> refused: %s", self._ip, address, verdict.reply)
        await self.reply(verdict.reply)

    @syntax("DATA")
    async def smtp_DATA(self, arg: str | None) -> None:
        if await self.check_helo_needed():
            return
        txn = self._txn
        if txn is None:
            await self.reply(Reply(503, "5.5.1", "Need MAIL command"))
            return
        if not txn.recipients and not txn.dropped:
            await self.reply(NO_VALID_RECIPIENTS if txn.attempts else
                             Reply(503, "5.5.1", "Need RCPT command"))
            return
        if arg:
            await self.reply(Reply(501, "5.5.4", "Syntax: DATA"))
            return
        await self._send(b"354 End data with <CR><LF>.<CR><LF>\r\n", final=False)
        buf = await self._read_data()
        if buf is None:
            return  # the client went away mid-DATA
        try:
            answer = await self._finish(txn, buf)
        finally:
            buf.close()
            self._txn = None
        await self.reply(answer)

    async def _read_data(self) -> MessageBuffer | None:
        settings = self._settings
        policy = self._policy
        buf = MessageBuffer(policy.max_message_size, policy.line_limit,
                            settings.spill_size, settings.spill_dir)
        unstuffer = Unstuffer()
        reader = self._reader
        while True:
            try:
                raw = await reader.readuntil(_END_MARK)
            except asyncio.LimitOverrunError as exc:
                raw = await reader.readexactly(exc.consumed)
            except asyncio.IncompleteReadError:
                buf.close()
                if self.transport is not None:
                    self.transport.close()
                return None
            text, ended = unstuffer.feed(raw)
            if text:
                buf.write(text)
            if ended:
                return buf
            self._reset_timeout()  # a slow, big message is not an idle client

    async def _finish(self, txn: _Transaction, buf: MessageBuffer) -> Reply:
        """Everything after the final dot; returns the reply to send."""
        registry = self._registry
        refusal = self._policy.content(buf.state)
        if buf.state is ContentState.FAILED:
            registry.bump("queue_failures")
        if refusal is not None:
            registry.bump("messages_refused")
            log.info("%s: message from <%s> refused: %s", self._ip, txn.sender, refusal)
            return refusal
        settings = self._settings
        session = self.session
        assert session is not None
        helo = session.host_name or ""
        tls = self._tls_protocol is not None
        if not txn.recipients:  # every recipient was suppressed (drop mode)
            self._log_suppressed(txn, txn.dropped, None, buf.size)
            return Reply(250, "2.0.0", "Ok: dropped, no deliverable recipients")
        # The SPID is drawn now so that the Received header can name it.
        # SMTPUTF8 goes with the message: delivery must know it may hold UTF-8.
        submission = Submission(sender=txn.sender, recipients=tuple(txn.recipients),
                                spid=new_spid(), smtputf8=txn.smtputf8)
        accept: Accept | None = None
        hooks = settings.hooks
        if hooks.end_of_data is not None:
            decision = await hooks.run_end_of_data(EndOfData(
                submission=submission, client_ip=self._ip, client_port=self._port, helo=helo,
                auth_user=self._auth_user, tls=tls, size=buf.size,
                header=buf.header_block(), smtputf8=txn.smtputf8))
            if isinstance(decision, Reject):
                registry.bump("messages_refused")
                log.info("%s: message from <%s> rejected by hook: %s", self._ip, txn.sender,
                         decision.reply)
                return decision.reply
            accept = decision
            submission = decision.apply(submission)
        queue = settings.queue
        spid = submission.spid
        header = received_header(
            helo=helo, client_ip=self._ip, hostname=settings.hostname,
            protocol=protocol_name(session.extended_smtp, tls, self._auth_user is not None,
                                   txn.smtputf8),
            spid=spid,
            recipient=txn.recipients[0] if len(txn.recipients) == 1 else None,
            at=queue.clock())
        content = buf.content(header)
        try:
            if settings.handoff is not None:
                accepted = await settings.handoff.submit(
                    submission, content, big=buf.spilled, size=buf.size + len(header),
                    origin=Origin(self._auth_user, self._ip))
            else:
                accepted = await await_durable(queue.submit_future(submission, content))
        except (StorageError, OSError) as exc:
            registry.bump("queue_failures")
            registry.bump("messages_refused")
            log.warning("%s: message %s from <%s> not queued: %s", self._ip, spid,
                        txn.sender, exc)
            return QUEUE_FAILED
        registry.bump("messages_accepted")
        registry.bump("bytes_accepted", buf.size)
        if txn.dropped:
            self._log_suppressed(txn, txn.dropped, accepted.spid, accepted.size)
        if settings.on_accepted is not None:
            settings.on_accepted(accepted, submission)
        if accepted.spid != spid and not accepted.duplicate:  # another process drew it first
            log.info("%s: SPID %s (named in the Received header) was taken; queued as %s",
                     self._ip, spid, accepted.spid)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s: queued as %s from <%s> to %d recipient(s), %d bytes", self._ip,
                      accepted.spid, txn.sender, len(submission.recipients), accepted.size)
        if accept is not None and accept.reply is not None:
            return accept.reply
        return Reply(250, "2.0.0", f"Ok: queued as {accepted.spid}")

    def _log_suppressed(self, txn: _Transaction, items: list[tuple[str, SuppressionEntry]],
                        spid: str | None, size: int) -> None:
        """One accounting line per suppressed recipient (refused or dropped)."""
        queue = self._settings.queue
        if queue.accounting is None:
            return
        now = queue.clock()
        events = []
        for address, entry in items:
            row = QueueEntry(spid=spid or "", idx=0, sender=txn.sender, recipient=address,
                             state=QueueState.INCOMING, arrival_at=now, next_attempt_at=now,
                             size=size)
            event = make_event(EventKind.SUPPRESSED, row, now, node=queue.node,
                               reply=entry.reply(address), attempt=0)
            event["qid"] = None  # no queue entry exists for this recipient
            event["spid"] = spid
            events.append(event)
        queue.accounting.record(events, now)


# Errors a client causes (a failed TLS handshake, garbage, a dropped
# connection); anything else is ours and keeps its traceback.
CLIENT_CAUSED: tuple[type[BaseException], ...] = (
    aiosmtpd.smtp.TLSSetupException, ssl.SSLError, ConnectionError, EOFError,
    asyncio.IncompleteReadError, asyncio.LimitOverrunError, UnicodeError, TimeoutError)


def _retrieve(task: asyncio.Task[None]) -> None:
    # aiosmtpd's command loop ends with ConnectionResetError when a client
    # vanishes; fetch it so asyncio does not report it as never retrieved.
    if not task.cancelled():
        task.exception()


SmtpSession._COMMANDS = tuple(
    sorted(name[5:] for name in dir(SmtpSession) if name.startswith("smtp_")))

