"""What a client sent and the session has not read yet: lines and DATA pieces.

SUMMARY
    inbox = Inbox(loop, pause, resume, before_wait)
    inbox.feed(data) / inbox.feed_eof()           from the asyncio.Protocol callbacks
    await inbox.readline() -> bytes | TOO_LONG | None (end of input)
    await inbox.read_data_piece() -> bytes | None  up to and with the next ".CRLF"
    inbox.discard()                                 throw away what is buffered (STARTTLS)

DESCRIPTION
    sluice.smtpd.session is an asyncio.Protocol; its data_received feeds
    this buffer and its command loop reads from it.  A reader that finds
    too little waits on one future, which the next feed or the end of
    input resolves.  Before it waits it calls ``before_wait``: the session
    flushes its pending replies then, which is when RFC 2920 says a server
    must (it is about to wait for the client).

STRATEGIES
    Bounded memory.  Past HIGH_WATER buffered bytes the transport is asked
    to pause reading, and resumed once the reader has taken the buffer
    below LOW_WATER.  A command line longer than LINE_READ_MAX is not kept:
    it is thrown away up to its end and reported as TOO_LONG.

    Pieces, not lines, in DATA.  read_data_piece returns everything up to
    and with the next ".CRLF" (the Unstuffer in sluice.smtpd.content
    decides whether it ends the data), or, when there is none in the
    first LINE_READ_MAX bytes, all but the last two (they may begin a
    ".CRLF").  Waiting for the mark rather than handing out what came
    makes a small message one piece, not one per network read.

INVARIANTS
    Bytes come out in the order they went in, each once; nothing after
    the end of DATA is consumed by read_data_piece.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Final

from sluice._wirescan import end_mark
from sluice.smtpd.protocol import LINE_READ_MAX

__all__ = ["HIGH_WATER", "LOW_WATER", "TOO_LONG", "Inbox"]

HIGH_WATER = 4 * LINE_READ_MAX
LOW_WATER = LINE_READ_MAX
#: What readline returns for a line longer than LINE_READ_MAX (thrown away).
TOO_LONG: Final = b"\x00too long\x00"


class Inbox:
    """The unread input of one connection; see the module doc."""

    __slots__ = ("_before_wait", "_buf", "_eof", "_loop", "_pause", "_paused", "_resume",
                 "_waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop, pause: Callable[[], None],
                 resume: Callable[[], None], before_wait: Callable[[], None]) -> None:
        self._loop = loop
        self._pause = pause
        self._resume = resume
        self._before_wait = before_wait
        self._buf = bytearray()
        self._eof = False
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None

    # -- the protocol's side ---------------------------------------------------------

    def feed(self, data: bytes) -> None:
        """Add what arrived and wake the reader; pause reading above HIGH_WATER bytes."""
        self._buf += data
        self._wake()
        if not self._paused and len(self._buf) > HIGH_WATER:
            self._paused = True
            self._pause()

    def feed_eof(self) -> None:
        """The client will send nothing more: wake the reader to see it."""
        self._eof = True
        self._wake()

    @property
    def at_eof(self) -> bool:
        """Whether the input has ended and everything buffered was read."""
        return self._eof and not self._buf

    def discard(self) -> None:
        """Forget buffered input (RFC 3207 5: nothing sent before TLS is trusted after)."""
        self._buf.clear()
        self._unpause()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    # -- the session's side ------------------------------------------------------------

    async def _wait(self) -> None:
        self._before_wait()
        self._unpause()  # the reader needs more than is buffered
        waiter = self._loop.create_future()
        self._waiter = waiter
        try:
            await waiter
        finally:
            self._waiter = None

    def _unpause(self) -> None:
        if self._paused and len(self._buf) < LOW_WATER:
            self._paused = False
            self._resume()

    def _take(self, end: int) -> bytes:
        buf = self._buf
        if end == len(buf):
            out = bytes(buf)
            buf.clear()
        else:
            out = bytes(buf[:end])
            del buf[:end]
        if self._paused:
            self._unpause()
        return out

    async def readline(self) -> bytes | None:
        """The next line with its LF; TOO_LONG for an overlong one; None at the end."""
        start = 0
        too_long = False
        while True:
            buf = self._buf
            end = buf.find(b"\n", start)
            if end >= 0:
                line = self._take(end + 1)
                return TOO_LONG if too_long else line
            if len(buf) > LINE_READ_MAX:
                buf.clear()  # keep reading to the line's end, but keep nothing
                too_long = True
            start = len(self._buf)
            if self._eof:
                return None
            await self._wait()

    async def read_data_piece(self) -> bytes | None:
        """Raw DATA up to and with the next ".CRLF", or a big safe piece; None at the end."""
        start = 0
        while True:
            buf = self._buf
            end = end_mark(buf, start)
            if end >= 0:
                return self._take(end)
            if len(buf) >= LINE_READ_MAX:
                return self._take(len(buf) - 2)
            if self._eof:
                return None
            start = max(0, len(buf) - 2)
            await self._wait()
