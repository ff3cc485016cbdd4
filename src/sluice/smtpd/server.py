"""The receiving SMTP server of one process: listening sockets and their sessions.

SUMMARY
    receiver_parts(config) -> ReceiverParts          # ConfigError if unusable
    bind_listeners([(host, port), ...]) -> [socket]  # ReceiverError if taken
    receiver = Receiver.from_config(config, queue, sockets=None)
    await receiver.start()      # listening; receiver.addresses
    await receiver.stop()       # graceful: see STRATEGIES
    receiver.stats() -> ReceiverStats

DESCRIPTION
    A Receiver listens on ``smtpd.listen`` (``host:port`` or
    ``[v6addr]:port``; port 0 picks a free port, for tests) and runs one
    sluice.smtpd.session.SmtpSession (Sluice's own SMTP server protocol)
    per connection on the running event loop.  Messages go to the Queue it
    was given; the caller owns the queue and closes it after stop().

    Several processes can each run a Receiver on the same listening
    sockets: the parent binds them once (bind_listeners, no SO_REUSEPORT,
    so no other program -- and no second `sluice serve` -- can join the
    port) and hands them to each process, whose event loop accepts from
    them.  ``share`` tells each one how many there are, so that the
    connection limits of the configuration hold for the whole set (each
    process enforces its share, rounded up).  sluice.smtpd.worker starts
    such processes.

STRATEGIES
    Graceful stop.  stop() closes the listening sockets first (no new
    connections), then tells every session to finish: an idle one is
    closed at once with 421 4.3.2, one in the middle of a command (in DATA,
    or waiting for the queue to make a message durable) after it has sent
    that command's reply.  Whatever is still open after the grace period
    (``smtpd.shutdown_timeout``) is closed; a message whose 250 was not
    sent may still have been queued, and is then delivered twice at worst.

LIMITATIONS
    The processes share one accept queue per socket: a new connection
    wakes every process waiting on it and one wins the accept (with the
    default of one receiving process on two cores there is no race).
    Connections still in the accept queue when the last process stops are
    reset; clients retry.
    The connection limits are per process (split as above), not counted
    across processes.

SEE ALSO
    sluice.smtpd.session, sluice.smtpd.worker, docs/smtpd.md
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from sluice.config import Config, ConfigError
from sluice.hooks import Hooks, load_hook
from sluice.model import Accepted, Submission
from sluice.queue import Queue
from sluice.smtpd.credentials import Credentials
from sluice.smtpd.dedupe import Resends
from sluice.smtpd.handoff import Handoff
from sluice.smtpd.policy import ReceivePolicy
from sluice.smtpd.session import SmtpSession
from sluice.smtpd.settings import ReceiverStats, Registry, Settings
from sluice.suppression import SuppressionFileError, SuppressionList

__all__ = [
    "Receiver",
    "ReceiverError",
    "ReceiverParts",
    "ReceiverStats",
    "bind_listeners",
    "listen_addresses",
    "load_tls_context",
    "parse_listen",
    "receiver_parts",
]

log = logging.getLogger("sluice.smtpd")


class ReceiverError(Exception):
    """The receiver could not start (an address in use, no permission)."""


def parse_listen(text: str) -> tuple[str, int]:
    """'127.0.0.1:2525' -> ('127.0.0.1', 2525); '[::1]:25' -> ('::1', 25).

    An empty host or ``*`` means every address.  Raises ValueError.
    """
    value = text.strip()
    if value.startswith("["):
        end = value.find("]")
        if end < 0 or value[end + 1 : end + 2] != ":":
            raise ValueError(f"{text!r} is not [address]:port")
        host, port_text = value[1:end], value[end + 2 :]
    else:
        host, sep, port_text = value.rpartition(":")
        if not sep:
            raise ValueError(f"{text!r} is not host:port")
        if ":" in host:
            raise ValueError(f"{text!r}: write IPv6 addresses as [address]:port")
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"{text!r}: the port must be a number from 0 to 65535")
    return ("" if host in ("", "*") else host), int(port_text)


def load_tls_context(config: Config) -> ssl.SSLContext | None:
    """The server context for STARTTLS, or None when no certificate is configured."""
    tls = config.smtpd.tls
    if not tls.cert and not tls.key:
        return None
    if not tls.cert or not tls.key:
        missing = "smtpd.tls.cert" if not tls.cert else "smtpd.tls.key"
        raise ConfigError(config.source, missing, "STARTTLS needs both cert and key")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(tls.cert, tls.key)
    except (OSError, ssl.SSLError) as exc:
        reason = getattr(exc, "strerror", None) or getattr(exc, "reason", None) or str(exc)
        raise ConfigError(config.source, "smtpd.tls.cert",
                          f"cannot load {tls.cert} with key {tls.key}: {reason}") from None
    return ctx


def _load_suppression(config: Config) -> SuppressionList | None:
    if not config.suppression.path:
        return None
    try:
        return SuppressionList.load(config.suppression.path)
    except SuppressionFileError as exc:
        raise ConfigError(config.source, "suppression.path", str(exc)) from None


@dataclass(frozen=True, slots=True)
class ReceiverParts:
    """What a Receiver is built from, each made from the configuration.

    Being made from it checks them against it: sluice.runtime.preflight
    builds them too.
    """

    listen: tuple[tuple[str, int], ...]
    policy: ReceivePolicy
    credentials: Credentials
    hooks: Hooks
    suppression: SuppressionList | None
    tls_context: ssl.SSLContext | None


def listen_addresses(config: Config, listen: Sequence[str] | None = None
                     ) -> tuple[tuple[str, int], ...]:
    """``smtpd.listen`` (or ``listen``) parsed; ConfigError names the bad item."""
    out = []
    for i, item in enumerate(config.smtpd.listen if listen is None else listen):
        try:
            out.append(parse_listen(item))
        except ValueError as exc:
            raise ConfigError(config.source, f"smtpd.listen[{i}]", str(exc)) from None
    return tuple(out)


def receiver_parts(config: Config, *, listen: Sequence[str] | None = None, share: int = 1,
                   hooks: Hooks | None = None, suppression: SuppressionList | None = None
                   ) -> ReceiverParts:
    """The parts of a receiver for ``config``; ConfigError names the bad key.

    ``hooks`` and ``suppression`` default to what the configuration names
    (``smtpd.hook``, ``suppression.path``).
    """
    s = config.smtpd
    addresses = listen_addresses(config, listen)
    if hooks is None:
        hook = (load_hook(s.hook, keypath="smtpd.hook", source=config.source,
                          base_dir=config.base_dir) if s.hook else None)
        hooks = Hooks(end_of_data=hook)
    if suppression is None:
        suppression = _load_suppression(config)
    try:
        credentials = Credentials.from_config(config)
    except ValueError as exc:
        raise ConfigError(config.source, "smtpd.auth.users", str(exc)) from None
    return ReceiverParts(
        listen=addresses,
        policy=ReceivePolicy.from_config(config, suppression, share=share),
        credentials=credentials, hooks=hooks, suppression=suppression,
        tls_context=load_tls_context(config))


def bind_listeners(addresses: Sequence[tuple[str, int]], backlog: int = 1024
                   ) -> list[socket.socket]:
    """Listening sockets for ``addresses``, without SO_REUSEPORT.

    The port is this process's alone (a second `sluice serve` on it gets
    "address already in use"); the receiving processes share these very
    sockets, passed to them, rather than each binding its own.  Raises
    ReceiverError in one line.  An empty host is every address, one
    socket per family.
    """
    socks: list[socket.socket] = []
    host, port = "", 0
    try:
        for host, port in addresses:
            infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
            done: set[tuple[int, object]] = set()
            for family, kind, proto, _, addr in infos:
                if (family, addr) in done:
                    continue
                done.add((family, addr))
                sock = socket.socket(family, kind, proto)
                socks.append(sock)
                # SO_REUSEADDR only lets a restart bind past TIME_WAIT; on Linux
                # it does not let two listeners share the port.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(addr)
                sock.listen(backlog)
                sock.setblocking(False)
    except OSError as exc:
        for sock in socks:
            sock.close()
        where = f"[{host}]:{port}" if ":" in host else f"{host or '*'}:{port}"
        reason = exc.strerror or str(exc)
        raise ReceiverError(f"cannot listen on {where}: {reason}") from None
    return socks


class Receiver:
    """Listening sockets and sessions of one process; see the module doc."""

    def __init__(self, settings: Settings, listen: Sequence[tuple[str, int]], *,
                 sockets: Sequence[socket.socket] | None = None,
                 backlog: int = 1024, shutdown_timeout_s: float = 30.0) -> None:
        self.settings = settings
        self.backlog = backlog
        self.shutdown_timeout_s = shutdown_timeout_s
        self._listen = list(listen)
        self._sockets = None if sockets is None else list(sockets)
        self._registry = Registry()
        self._servers: list[asyncio.Server] = []
        self._stopped = False

    @classmethod
    def from_config(
        cls,
        config: Config,
        queue: Queue,
        *,
        listen: Sequence[str] | None = None,
        sockets: Sequence[socket.socket] | None = None,
        share: int = 1,
        hooks: Hooks | None = None,
        suppression: SuppressionList | None = None,
        on_accepted: Callable[[Accepted, Submission], None] | None = None,
    ) -> Receiver:
        """A receiver for ``config.smtpd``.

        ``sockets`` are listening sockets bound already (bind_listeners), which
        the receiver then owns; without them start() binds ``smtpd.listen``.
        ``on_accepted`` is called on the event loop for every message queued.
        Raises ConfigError naming the key that is wrong (receiver_parts).
        """
        s = config.smtpd
        parts = receiver_parts(config, listen=listen, share=share, hooks=hooks,
                               suppression=suppression)
        spill_dir: str | None = config.queue.path
        try:
            Path(config.queue.path).mkdir(parents=True, exist_ok=True)
        except OSError:
            spill_dir = None  # the system's temporary directory
        settings = Settings(
            hostname=s.hostname or config.node.hostname or socket.gethostname(),
            queue=queue,
            policy=parts.policy,
            credentials=parts.credentials,
            hooks=parts.hooks,
            tls_context=parts.tls_context,
            timeout_s=s.timeout,
            spill_size=s.spill_size,
            spill_dir=spill_dir,
            on_accepted=on_accepted,
            handoff=Handoff(queue, Resends.open(config, queue.accounting) if s.dedupe else None),
        )
        return cls(settings, parts.listen, sockets=sockets, backlog=s.backlog,
                   shutdown_timeout_s=s.shutdown_timeout)

    # -- life cycle ------------------------------------------------------------------

    async def start(self) -> None:
        """Serve on the sockets given, or bind ``listen``; ReceiverError if it cannot."""
        loop = asyncio.get_running_loop()
        settings, registry = self.settings, self._registry

        def session() -> SmtpSession:
            return SmtpSession(settings, registry, loop)

        sockets = self._sockets
        self._sockets = []
        if sockets is None:
            sockets = bind_listeners(self._listen, self.backlog)
        pending = list(sockets)
        try:
            while pending:
                server = await loop.create_server(session, sock=pending[0],
                                                  backlog=self.backlog)
                pending.pop(0)
                self._servers.append(server)
        except OSError as exc:
            where = pending[0].getsockname()
            for rest in pending:
                rest.close()
            await self._close_servers()
            raise ReceiverError(f"cannot serve on {where}: {exc.strerror or exc}") from None
        log.info("receiving on %s", ", ".join(f"{h}:{p}" for h, p in self.addresses))

    @property
    def addresses(self) -> list[tuple[str, int]]:
        """The bound (host, port) pairs; the real port when 0 was asked for."""
        out = []
        for server in self._servers:
            for sock in server.sockets:
                name = sock.getsockname()
                out.append((str(name[0]), int(name[1])))
        return out

    async def stop(self, grace_s: float | None = None) -> None:
        """Stop accepting, let sessions finish what they do, then close them."""
        if self._stopped:
            return
        self._stopped = True
        loop = asyncio.get_running_loop()
        registry = self._registry
        registry.closing = True
        for server in self._servers:
            server.close()
        for session in list(registry.sessions):
            session.shutdown()
        grace = self.shutdown_timeout_s if grace_s is None else grace_s
        deadline = loop.time() + grace
        while registry.sessions:
            left = deadline - loop.time()
            if left <= 0:
                break
            registry.idle_changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(registry.idle_changed.wait(), left)
        if registry.sessions:
            log.warning("closing %d session(s) still busy after %.0f s",
                        len(registry.sessions), grace)
            for session in list(registry.sessions):
                session.abort()
            await asyncio.sleep(0)
        # The sessions' command loops end once their connections are gone.
        await registry.wait_tasks(5.0)
        await self._close_servers()
        if self.settings.handoff is not None:
            # Submissions already handed over finish (their sessions are gone).
            await asyncio.to_thread(self.settings.handoff.close)
        self.settings.credentials.close()

    async def _close_servers(self) -> None:
        for server in self._servers:
            server.close()
        for server in self._servers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 5.0)

    def stats(self) -> ReceiverStats:
        """The receiver's counters and open connections now."""
        return self._registry.snapshot()

    @property
    def sessions(self) -> int:
        """How many sessions are open."""
        return len(self._registry.sessions)

    async def __aenter__(self) -> Receiver:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

