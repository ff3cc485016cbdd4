"""A programmable SMTP sink: the next hop for demos, tests and policy trials.

SUMMARY
    Sink(behaviours, default="accept", hostname=...).start(host, port)
    sluice sink --listen 127.0.0.1:2526 --greylist example.com --reject bad.example ...

DESCRIPTION
    A real SMTP server (aiosmtpd) that answers per recipient domain the
    way destinations on the Internet do, and counts what it saw:

    accept      250 for every recipient
    greylist    451 4.7.1 the first time a (sender, recipient) pair is
                seen, 250 when it comes back (RFC 6647)
    reject      550 5.1.1 for every recipient
    tempfail    451 4.3.0 for every recipient, forever
    slow=S      accept, but wait S seconds before answering DATA
    throttle=N  accept at most N recipients a minute for the domain, then
                answer 451 4.7.0 "too many messages, slow down"

    It records per domain the messages accepted, the replies given, and
    the highest number of simultaneous connections, so tests can check
    that a policy's limits held at the receiving end.  A connection counts
    from its first RCPT for a domain until the client says QUIT or the
    connection closes, whichever comes first: a client is done with a
    connection once it has said QUIT, and counting until the close as well
    would charge it with how late this sink's own loop (in a busy test
    process) gets to the close.  Accepted messages can be kept (in memory
    or as files) to compare bytes.

LIMITATIONS
    Not a mail store: messages kept in memory stay until the sink stops.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiosmtpd.smtp import SMTP, Envelope, Session

from sluice.model import recipient_domain

__all__ = ["Behaviour", "ReceivedMessage", "Sink", "SinkStats", "parse_behaviour"]


@dataclass(frozen=True, slots=True)
class Behaviour:
    """How the sink answers mail for one domain (see the module doc)."""

    kind: str = "accept"
    seconds: float = 0.0  # slow
    per_minute: int = 0  # throttle

    def __post_init__(self) -> None:
        if self.kind not in ("accept", "greylist", "reject", "tempfail", "slow", "throttle"):
            raise ValueError(f"unknown sink behaviour {self.kind!r}")


def parse_behaviour(text: str) -> Behaviour:
    """'accept', 'greylist', 'reject', 'tempfail', 'slow=2.5', 'throttle=60'."""
    kind, _, arg = text.partition("=")
    kind = kind.strip().lower()
    if kind == "slow":
        return Behaviour("slow", seconds=float(arg or 1))
    if kind == "throttle":
        return Behaviour("throttle", per_minute=int(arg or 60))
    if arg:
        raise ValueError(f"behaviour {kind!r} takes no argument")
    return Behaviour(kind)


@dataclass(frozen=True, slots=True)
class ReceivedMessage:
    """One message the sink accepted, kept when the sink is asked to keep them."""
    sender: str
    recipients: tuple[str, ...]
    data: bytes
    peer: str
    local: str
    at: float


@dataclass
class SinkStats:
    """What the sink saw; read it with Sink.snapshot()."""

    delivered: collections.Counter[str] = field(default_factory=collections.Counter)
    replies: collections.Counter[tuple[str, int]] = field(default_factory=collections.Counter)
    transactions: int = 0
    connections: int = 0
    current_connections: int = 0
    peak_connections: int = 0
    current_by_domain: collections.Counter[str] = field(default_factory=collections.Counter)
    peak_by_domain: collections.Counter[str] = field(default_factory=collections.Counter)
    peers: collections.Counter[str] = field(default_factory=collections.Counter)
    accepted_at: dict[str, list[float]] = field(default_factory=dict)
    # per recipient, when its connection opened: the nearest the sink sees
    # to the sender's pickup (rate tests; with no connection reuse)
    connected_at: dict[str, list[float]] = field(default_factory=dict)
    # per domain, (when, how many connections) each time the count rose
    rises_by_domain: dict[str, list[tuple[float, int]]] = field(default_factory=dict)

    def copy(self) -> SinkStats:
        """A copy whose counters and lists are not shared with this one."""
        return SinkStats(
            delivered=collections.Counter(self.delivered),
            replies=collections.Counter(self.replies),
            transactions=self.transactions,
            connections=self.connections,
            current_connections=self.current_connections,
            peak_connections=self.peak_connections,
            current_by_domain=collections.Counter(self.current_by_domain),
            peak_by_domain=collections.Counter(self.peak_by_domain),
            peers=collections.Counter(self.peers),
            accepted_at={k: list(v) for k, v in self.accepted_at.items()},
            connected_at={k: list(v) for k, v in self.connected_at.items()},
            rises_by_domain={k: list(v) for k, v in self.rises_by_domain.items()},
        )

    @property
    def total_delivered(self) -> int:
        """How many recipients were accepted, over all domains."""
        return sum(self.delivered.values())


class _Handler:
    def __init__(self, sink: Sink) -> None:
        self.sink = sink

    async def handle_RCPT(self, server: SMTP, session: Session, envelope: Envelope,
                          address: str, rcpt_options: list[str]) -> str:
        return self.sink._on_rcpt(server, envelope, address)

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        return await self.sink._on_data(server, session, envelope)

    async def handle_QUIT(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        if isinstance(server, _SinkSMTP):
            self.sink._on_disconnect(server)
        return "221 Bye"


class _SinkSMTP(SMTP):
    """aiosmtpd's server, told about connections so the sink can count them."""

    def __init__(self, sink: Sink, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._sink = sink
        self._domains: set[str] = set()
        self.connected_at = 0.0
        self.counted = False  # among the open connections (from connect to QUIT or close)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.connected_at = time.time()
        super().connection_made(transport)
        self._sink._on_connect(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._sink._on_disconnect(self)
        super().connection_lost(exc)


class Sink:
    """An SMTP sink with per-domain behaviours; see the module doc."""

    def __init__(self, behaviours: Mapping[str, Behaviour] | None = None, *,
                 default: Behaviour | None = None, hostname: str = "sink.sluice.test",
                 keep: bool = False, keep_dir: str | Path | None = None) -> None:
        self.behaviours = {k.lower(): v for k, v in (behaviours or {}).items()}
        self.default = default or Behaviour("accept")
        self.hostname = hostname
        self.keep = keep
        self.keep_dir = Path(keep_dir) if keep_dir else None
        self.messages: list[ReceivedMessage] = []
        self._stats = SinkStats()
        self._lock = threading.Lock()
        self._greylist: set[tuple[str, str]] = set()
        self._throttle: dict[str, collections.deque[float]] = collections.defaultdict(
            collections.deque)
        self._servers: list[asyncio.base_events.Server] = []
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- behaviour -----------------------------------------------------------------

    def behaviour(self, domain: str) -> Behaviour:
        """The behaviour for ``domain``: exact name, then ``*.`` pattern, then the default."""
        domain = domain.lower()
        if domain in self.behaviours:
            return self.behaviours[domain]
        for pattern, b in self.behaviours.items():
            if pattern.startswith("*.") and domain.endswith(pattern[1:]):
                return b
        return self.default

    def _reply(self, domain: str, code: int, text: str) -> str:
        with self._lock:
            self._stats.replies[(domain, code)] += 1
        return f"{code} {text}"

    def _on_rcpt(self, server: SMTP, envelope: Envelope, address: str) -> str:
        domain = recipient_domain(address)
        if isinstance(server, _SinkSMTP) and domain not in server._domains:
            # Connections "to a domain": counted from its first RCPT until
            # the connection closes.
            server._domains.add(domain)
            with self._lock:
                s = self._stats
                s.current_by_domain[domain] += 1
                s.peak_by_domain[domain] = max(s.peak_by_domain[domain],
                                               s.current_by_domain[domain])
                s.rises_by_domain.setdefault(domain, []).append(
                    (time.time(), s.current_by_domain[domain]))
        if isinstance(server, _SinkSMTP):
            with self._lock:
                self._stats.connected_at.setdefault(domain, []).append(server.connected_at)
        b = self.behaviour(domain)
        if b.kind == "reject":
            return self._reply(domain, 550, f"5.1.1 <{address}>: no such user here")
        if b.kind == "tempfail":
            return self._reply(domain, 451, "4.3.0 temporary trouble, try again later")
        if b.kind == "greylist":
            key = ((envelope.mail_from or "").lower(), address.lower())
            with self._lock:
                seen = key in self._greylist
                self._greylist.add(key)
            if not seen:
                return self._reply(domain, 451, "4.7.1 greylisted, please try again later")
        if b.kind == "throttle":
            now = time.monotonic()
            with self._lock:
                window = self._throttle[domain]
                while window and now - window[0] > 60:
                    window.popleft()
                over = len(window) >= b.per_minute
                if not over:
                    window.append(now)
            if over:
                return self._reply(domain, 451, "4.7.0 too many messages, slow down")
        envelope.rcpt_tos.append(address)
        return "250 2.1.5 OK"

    async def _on_data(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        domains = {recipient_domain(r) for r in envelope.rcpt_tos}
        delay = max((self.behaviour(d).seconds for d in domains), default=0.0)
        if delay:
            await asyncio.sleep(delay)
        data = envelope.original_content or envelope.content or b""
        assert isinstance(data, bytes)
        peer = session.peer[0] if isinstance(session.peer, tuple) else str(session.peer)
        transport = server.transport
        local = ""
        if transport is not None:
            sock = transport.get_extra_info("sockname")
            local = sock[0] if sock else ""
        now = time.time()
        with self._lock:
            self._stats.transactions += 1
            for rcpt in envelope.rcpt_tos:
                d = recipient_domain(rcpt)
                self._stats.delivered[d] += 1
                self._stats.replies[(d, 250)] += 1
                self._stats.accepted_at.setdefault(d, []).append(now)
            if self.keep:
                self.messages.append(ReceivedMessage(
                    envelope.mail_from or "", tuple(envelope.rcpt_tos), data, peer, local, now))
        if self.keep_dir is not None:
            name = f"{now:.6f}-{self._stats.transactions}.eml"
            (self.keep_dir / name).write_bytes(data)
        return "250 2.0.0 OK: queued"

    def _on_connect(self, server: _SinkSMTP) -> None:
        with self._lock:
            server.counted = True
            s = self._stats
            s.connections += 1
            s.current_connections += 1
            s.peak_connections = max(s.peak_connections, s.current_connections)
            peer = server.transport.get_extra_info("peername") if server.transport else None
            if peer:
                s.peers[peer[0]] += 1

    def _on_disconnect(self, server: _SinkSMTP) -> None:
        # A connection stops counting at QUIT (the client is done with it:
        # an MTA frees its slot once it has said QUIT), or when it closes.
        with self._lock:
            if not server.counted:
                return
            server.counted = False
            self._stats.current_connections -= 1
            for domain in server._domains:
                self._stats.current_by_domain[domain] -= 1

    def snapshot(self) -> SinkStats:
        """A copy of the statistics so far, safe to read while the sink runs."""
        with self._lock:
            return self._stats.copy()

    # -- running -------------------------------------------------------------------------

    def _factory(self) -> _SinkSMTP:
        return _SinkSMTP(self, _Handler(self), hostname=self.hostname, enable_SMTPUTF8=True,
                         decode_data=False, data_size_limit=None, timeout=60)

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Listen (in the running loop); returns the port."""
        loop = asyncio.get_running_loop()
        server = await loop.create_server(self._factory, host=host, port=port,
                                          reuse_address=True)
        self._servers.append(server)
        sock = server.sockets[0].getsockname()
        return int(sock[1])

    async def stop(self) -> None:
        """Close the listening servers and wait for them to finish."""
        for server in self._servers:
            server.close()
            await server.wait_closed()
        self._servers.clear()

    def start_in_thread(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Run the sink in a thread of its own (for tests); returns the port."""
        ready: list[int] = []
        started = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                ready.append(loop.run_until_complete(self.start(host, port)))
            except BaseException as exc:
                failure.append(exc)
                started.set()
                loop.close()
                return
            started.set()
            loop.run_forever()
            loop.run_until_complete(self.stop())
            loop.close()

        self._thread = threading.Thread(target=run, name="sluice-sink", daemon=True)
        self._thread.start()
        started.wait(30)
        if failure:
            raise failure[0]
        return ready[0]

    def stop_thread(self) -> None:
        """Stop the event loop start_in_thread() runs, and wait for its thread."""
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)
            self._thread = None
            self._loop = None
