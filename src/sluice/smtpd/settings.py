"""What the sessions of one receiver share: Settings, and the Registry of open sessions.

SUMMARY
    Settings(hostname, queue, policy, ...)   fixed for the receiver's life
    Registry()                               open sessions, their tasks, counters
    ReceiverStats                            a snapshot of the counters

DESCRIPTION
    sluice.smtpd.server builds one Settings and one Registry per Receiver
    and hands both to every sluice.smtpd.session.SmtpSession it creates.
    The Registry is touched from the event loop thread only.

STRATEGIES
    Built once.  The EHLO reply is rendered when Settings is made, in its
    two forms (before and after STARTTLS): with a connection per message,
    EHLO is on the hot path.

    Tasks have an owner.  Each session's command loop is a task that the
    Registry holds until it ends, so that none is dropped by the garbage
    collector while it waits and a stop can wait for them all.

SEE ALSO
    sluice.smtpd.session, sluice.smtpd.server
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sluice.hooks import Hooks
from sluice.model import Accepted, Submission
from sluice.smtpd.credentials import Credentials
from sluice.smtpd.handoff import Handoff, Submitting
from sluice.smtpd.policy import ReceivePolicy

if TYPE_CHECKING:
    from sluice.smtpd.session import SmtpSession

__all__ = ["ReceiverStats", "Registry", "Settings"]


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
    queue: Submitting
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
    _greeting: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_ehlo", (self._build_ehlo(False), self._build_ehlo(True)))
        object.__setattr__(self, "_greeting",
                           f"220 {self.hostname} {self.ident}\r\n".encode("ascii", "replace"))

    def ehlo_reply(self, tls_active: bool) -> bytes:
        """The whole multi-line EHLO reply, as one write."""
        return self._ehlo[tls_active]

    def greeting(self) -> bytes:
        """The 220 line sent when a connection is admitted (RFC 5321 4.2: no enhanced code)."""
        return self._greeting

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
    """Open sessions, their tasks and the counters of one receiver (event loop thread only)."""

    def __init__(self) -> None:
        self.sessions: set[SmtpSession] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.per_ip: dict[str, int] = {}
        self.closing = False
        self.counts: dict[str, int] = dict.fromkeys(ReceiverStats.__slots__, 0)
        self.idle_changed = asyncio.Event()

    def bump(self, name: str, n: int = 1) -> None:
        """Add ``n`` to counter ``name``."""
        self.counts[name] += n

    def snapshot(self) -> ReceiverStats:
        """The counters now, with the connections open."""
        counts = dict(self.counts)
        counts["connections"] = len(self.sessions)
        return ReceiverStats(**counts)

    def enter(self, session: SmtpSession, ip: str) -> None:
        """Count an admitted session, per client IP and in all."""
        self.sessions.add(session)
        self.per_ip[ip] = self.per_ip.get(ip, 0) + 1
        self.counts["connections_total"] += 1

    def leave(self, session: SmtpSession, ip: str) -> None:
        """Forget a session that ended, and tell a graceful stop waiting for sessions to go."""
        if session not in self.sessions:
            return
        self.sessions.discard(session)
        left = self.per_ip.get(ip, 1) - 1
        if left > 0:
            self.per_ip[ip] = left
        else:
            self.per_ip.pop(ip, None)
        self.idle_changed.set()

    def own(self, task: asyncio.Task[None]) -> None:
        """Hold ``task`` until it ends."""
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def wait_tasks(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the sessions' tasks to end."""
        if self.tasks:
            await asyncio.wait(set(self.tasks), timeout=timeout_s)
