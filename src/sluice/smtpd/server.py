"""The receiving SMTP server of one process: listening sockets and their sessions.

SUMMARY
    receiver = Receiver.from_config(config, queue)   # ConfigError if unusable
    await receiver.start()      # listening; receiver.addresses
    await receiver.stop()       # graceful: see STRATEGIES
    receiver.stats() -> ReceiverStats

DESCRIPTION
    A Receiver listens on ``smtpd.listen`` (``host:port`` or
    ``[v6addr]:port``; port 0 picks a free port, for tests) and runs one
    sluice.smtpd.session.SmtpSession (Sluice's own SMTP server protocol)
    per connection on the running event loop.  Messages go to the Queue it
    was given; the caller owns the queue and closes it after stop().

    Several processes can each run a Receiver on the same port with
    ``reuse_port=True`` (SO_REUSEPORT): the kernel spreads new connections
    over them.  ``share`` tells each one how many there are, so that the
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
    With SO_REUSEPORT, connections that the kernel had already queued for a
    process's socket when that process stops are reset; clients retry.
    The connection limits are per process (split as above), not counted
    across processes.

SEE ALSO
    sluice.smtpd.session, sluice.smtpd.worker, docs/smtpd.md
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import ssl
from collections.abc import Callable, Sequence
from pathlib import Path

from sluice.config import Config, ConfigError
from sluice.hooks import Hooks, load_hook
from sluice.model import Accepted, Submission
from sluice.queue import Queue
from sluice.smtpd.credentials import Credentials
from sluice.smtpd.handoff import Handoff
from sluice.smtpd.policy import ReceivePolicy
from sluice.smtpd.session import SmtpSession
from sluice.smtpd.settings import ReceiverStats, Registry, Settings
from sluice.suppression import SuppressionFileError, SuppressionList

__all__ = ["Receiver", "ReceiverError", "ReceiverStats", "load_tls_context", "parse_listen"]

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


class Receiver:
    """Listening sockets and sessions of one process; see the module doc."""

    def __init__(self, settings: Settings, listen: Sequence[str], *, reuse_port: bool = False,
                 backlog: int = 1024, shutdown_timeout_s: float = 30.0,
                 source: str = "<config>") -> None:
        self.settings = settings
        self.reuse_port = reuse_port
        self.backlog = backlog
        self.shutdown_timeout_s = shutdown_timeout_s
        self._listen: list[tuple[str, int]] = []
        for i, item in enumerate(listen):
            try:
                self._listen.append(parse_listen(item))
            except ValueError as exc:
                raise ConfigError(source, f"smtpd.listen[{i}]", str(exc)) from None
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
        reuse_port: bool = False,
        share: int = 1,
        hooks: Hooks | None = None,
        suppression: SuppressionList | None = None,
        on_accepted: Callable[[Accepted, Submission], None] | None = None,
    ) -> Receiver:
        """A receiver for ``config.smtpd``.

        ``hooks`` and ``suppression`` default to what the configuration
        names (``smtpd.hook``, ``suppression.path``).  ``on_accepted`` is
        called on the event loop for every message queued.
        Raises ConfigError naming the key that is wrong.
        """
        s = config.smtpd
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
        spill_dir: str | None = config.queue.path
        try:
            Path(config.queue.path).mkdir(parents=True, exist_ok=True)
        except OSError:
            spill_dir = None  # the system's temporary directory
        settings = Settings(
            hostname=s.hostname or config.node.hostname or socket.gethostname(),
            queue=queue,
            policy=ReceivePolicy.from_config(config, suppression, share=share),
            credentials=credentials,
            hooks=hooks,
            tls_context=load_tls_context(config),
            timeout_s=s.timeout,
            spill_size=s.spill_size,
            spill_dir=spill_dir,
            on_accepted=on_accepted,
            handoff=Handoff(queue),
        )
        return cls(settings, listen if listen is not None else s.listen,
                   reuse_port=reuse_port, backlog=s.backlog,
                   shutdown_timeout_s=s.shutdown_timeout, source=config.source)

    # -- life cycle ------------------------------------------------------------------

    async def start(self) -> None:
        """Listen on every address; ReceiverError if one cannot be bound."""
        loop = asyncio.get_running_loop()
        settings, registry = self.settings, self._registry

        def session() -> SmtpSession:
            return SmtpSession(settings, registry, loop)

        try:
            for host, port in self._listen:
                server = await loop.create_server(
                    session, host or None, port, backlog=self.backlog,
                    reuse_address=True, reuse_port=self.reuse_port or None)
                self._servers.append(server)
        except OSError as exc:
            await self._close_servers()
            where = f"{host or '*'}:{port}"
            reason = os.strerror(exc.errno) if exc.errno else str(exc)
            raise ReceiverError(f"cannot listen on {where}: {reason}") from None
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

    async def _close_servers(self) -> None:
        for server in self._servers:
            server.close()
        for server in self._servers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 5.0)

    def stats(self) -> ReceiverStats:
        return self._registry.snapshot()

    @property
    def sessions(self) -> int:
        return len(self._registry.sessions)

    async def __aenter__(self) -> Receiver:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

