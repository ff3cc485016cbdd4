"""The server's side of an SMTP/LMTP conversation: replies read and parsed as they arrive.

SUMMARY
    reader = ReplyReader(loop)                  # the asyncio.Protocol of a Session
    await reader.reply(wait_s) -> ServerReply   # or ReplyTimeout, ConnectionError
    await reader.drain(wait_s)                  # until the transport takes more
    ServerReply(code, lines).to_reply() -> sluice.model.Reply

DESCRIPTION
    A ServerReply is one reply as the server sent it: its code and its
    text lines (multiline replies, RFC 5321 4.2.1, joined into one).
    to_reply() makes it a sluice Reply with the enhanced status code
    (RFC 3463) the server gave, or the class default X.0.0.

    A ReplyReader is the protocol object of one connection.  It turns
    the bytes the server sends into ServerReplies, tracks flow control
    (pause_writing/resume_writing) for the Session's writes, and
    remembers why the connection is gone.  A line longer than
    MAX_REPLY_LINE, a reply of more than MAX_REPLY_LINES lines, or a
    line that does not start with three digits and " ", "-" or nothing
    is a protocol error: the connection is aborted.

STRATEGIES
    Reply parsing in data_received.  Complete replies are queued as they
    arrive; reading a reply that is already there does not yield to the
    loop.  Timeouts are plain loop timers, not tasks: a timer that fires
    sets ReplyTimeout on the future being awaited.

SEE ALSO
    RFC 5321 (4.2 replies), RFC 3463 (enhanced status codes),
    sluice.delivery.client (the Session that writes and reads)
"""

from __future__ import annotations

import asyncio
import re
from collections import deque
from typing import cast

from sluice.model import Reply

__all__ = ["MAX_REPLY_LINE", "MAX_REPLY_LINES", "ReplyReader", "ReplyTimeout", "ServerReply"]

#: A server's reply line longer than this is a protocol error (RFC 5321
#: allows 512 octets; be generous with real servers).
MAX_REPLY_LINE = 8192
#: Most reply lines in one reply (EHLO lists are the longest).
MAX_REPLY_LINES = 256

_ENHANCED_RE = re.compile(r"^([245])\.(\d{1,3})\.(\d{1,3})(?: |$)")


class ServerReply:
    """One reply as the server sent it: code and text lines.

    ``phase`` is the SMTP phase the Session read it in (sluice.shaping.rules.PHASES),
    set by the Session; empty until then.
    """

    __slots__ = ("code", "lines", "phase")

    def __init__(self, code: int, lines: list[str], phase: str = "") -> None:
        self.code = code
        self.lines = lines
        self.phase = phase

    @property
    def is_positive(self) -> bool:
        """Whether the reply is a success (2xx) or asks for more (3xx)."""
        return 200 <= self.code < 400

    def to_reply(self, prefix: str = "", suffix: str = "", remote_mta: str = "") -> Reply:
        """As a sluice Reply, with an enhanced code (RFC 3463).

        The one taken from the text when the server gave one, else the class
        default (X.0.0).  ``remote_mta``: the server's name, for a reply it
        gave about the mail (see Reply).
        """
        enhanced = ""
        texts = []
        for line in self.lines:
            m = _ENHANCED_RE.match(line)
            if m and int(m.group(1)) == self.code // 100:
                enhanced = enhanced or line[: m.end()].strip()
                line = line[m.end():]
            texts.append(line.strip())
        cls = self.code // 100
        if not enhanced and cls in (2, 4, 5):
            enhanced = f"{cls}.0.0"
        text = " ".join(t for t in texts if t)
        return Reply(self.code, enhanced, f"{prefix}{text}{suffix}", remote_mta,
                     phase=self.phase)

    def __repr__(self) -> str:
        return f"ServerReply({self.code}, {self.lines!r})"


class ReplyTimeout(Exception):
    """No reply came (or the transport took no more) within the wait given."""


class ReplyReader(asyncio.Protocol):
    """Parses the server's replies as bytes arrive; tracks flow control."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.lines: list[str] = []
        self.replies: deque[ServerReply] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self.drainer: asyncio.Future[None] | None = None
        self.paused = False
        self.lost: str | None = None  # why the connection is gone

    # -- asyncio.Protocol ----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Keep the transport: the Session writes to it."""
        # uvloop's transports are not subclasses of asyncio.Transport.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        """Queue every reply ``data`` completes; a malformed line aborts the connection."""
        buf = self.buf + data if self.buf else data
        if b"\n" not in buf:
            if len(buf) > MAX_REPLY_LINE:
                self._protocol_error("reply line too long")
            self.buf = buf
            return
        *complete, self.buf = buf.split(b"\n")
        for raw in complete:
            line = raw.rstrip(b"\r")
            code = line[:3]
            sep = line[3:4]
            if len(line) > MAX_REPLY_LINE or not code.isdigit() or sep not in (b"", b" ", b"-"):
                self._protocol_error(f"malformed reply line {line[:80]!r}")
                return
            self.lines.append(line[4:].decode("utf-8", "replace"))
            if sep == b"-":
                if len(self.lines) > MAX_REPLY_LINES:
                    self._protocol_error("reply has too many lines")
                    return
                continue
            self.replies.append(ServerReply(int(code), self.lines))
            self.lines = []
        self._wake()

    def eof_received(self) -> bool | None:
        """The server closed its side: the connection is gone."""
        self._gone("connection closed by the server")
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        """Remember why, and wake whoever waits for a reply or to write."""
        self._gone(f"connection lost: {exc}" if exc else "connection closed by the server")
        drainer = self.drainer
        if drainer is not None and not drainer.done():
            drainer.set_result(None)

    def pause_writing(self) -> None:
        """The transport's buffer is full: writers wait in drain()."""
        self.paused = True

    def resume_writing(self) -> None:
        """The transport takes more again: wake drain()."""
        self.paused = False
        drainer = self.drainer
        if drainer is not None and not drainer.done():
            drainer.set_result(None)

    # -- helpers ------------------------------------------------------------------

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _gone(self, why: str) -> None:
        if self.lost is None:
            self.lost = why
        self._wake()

    def _protocol_error(self, why: str) -> None:
        self._gone(f"protocol error: {why}")
        if self.transport is not None:
            self.transport.abort()

    async def reply(self, wait_s: float) -> ServerReply:
        """The next reply; ReplyTimeout or ConnectionError if none comes."""
        while True:
            if self.replies:
                return self.replies.popleft()
            if self.lost is not None:
                raise ConnectionError(self.lost)
            waiter = self.loop.create_future()
            self.waiter = waiter
            timer = self.loop.call_later(wait_s, _expire, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self.waiter = None

    async def drain(self, wait_s: float) -> None:
        """Wait until the transport takes more data (flow control)."""
        while self.paused:
            if self.lost is not None:
                raise ConnectionError(self.lost)
            drainer = self.loop.create_future()
            self.drainer = drainer
            timer = self.loop.call_later(wait_s, _expire, drainer)
            try:
                await drainer
            finally:
                timer.cancel()
                self.drainer = None
        if self.lost is not None:
            raise ConnectionError(self.lost)


def _expire(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_exception(ReplyTimeout())

