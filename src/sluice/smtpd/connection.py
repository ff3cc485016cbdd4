"""The bytes and the clock of one server connection, under the SMTP session.

SUMMARY
    class Connection(asyncio.Protocol)     sluice.smtpd.session.SmtpSession extends it
        _inbox            what the client sent (sluice.smtpd.inbox)
        _hold(data)       a reply, written at the next _flush
        _flush()          write what is held, in one write
        await _drain()    wait while the transport's write buffer is full
        _reset_timeout()  move the idle deadline; _timeout_cb() when it passes

DESCRIPTION
    A Connection owns the transport (replaced by the TLS transport after
    STARTTLS), the input buffer and the idle timer.  It knows nothing of
    SMTP: the session decides what to write and when to give up.

STRATEGIES
    Replies go out when the session would wait.  Replies are held and
    written in one write when the session is about to wait for input (the
    Inbox calls _flush before it waits) or for something slow, or when
    _MAX_HELD are held: a pipelining client gets its replies as a group
    (RFC 2920 3) and the server makes one system call, not one per reply.

    Flow control both ways.  The Inbox pauses reading when a client sends
    faster than the session reads; _drain waits while the transport says
    its write buffer is full (pause_writing), so a client that does not
    read cannot make the server buffer without bound.

    Idle timeout without a timer per command.  A command only moves the
    deadline forward; the one timer, when it fires before the deadline,
    sets itself again for the deadline.

SEE ALSO
    sluice.smtpd.session, sluice.smtpd.inbox
"""

from __future__ import annotations

import asyncio
import math

from sluice.smtpd.inbox import Inbox

__all__ = ["Connection"]

#: Replies held back before they are written even though more input is buffered.
_MAX_HELD = 64


class Connection(asyncio.Protocol):
    """Transport, input buffer, held replies and idle timer; see the module doc."""

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float) -> None:
        self._loop = loop
        self._transport: asyncio.Transport | None = None
        self._inbox = Inbox(loop, self._pause_reading, self._resume_reading, self._flush)
        self._held: list[bytes] = []  # replies not yet written
        self._write_paused = False
        self._drained: asyncio.Future[None] | None = None
        self._timeout_s = timeout_s
        self._timeout_handle: asyncio.TimerHandle | None = None
        self._deadline = 0.0  # loop time after which an idle session is closed
        self._timer_at = math.inf  # when the armed timer fires (inf: none armed)

    # -- asyncio.Protocol ---------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        """Hand what the client sent to the inbox."""
        self._inbox.feed(data)

    def eof_received(self) -> bool | None:
        """The client will send nothing more: end the input, and let the transport close.

        The reader ends when it has read what is buffered.
        """
        self._inbox.feed_eof()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        """End the input, stop the idle timer and wake a writer waiting to drain."""
        self._inbox.feed_eof()
        if self._timeout_handle is not None:
            self._timeout_handle.cancel()
            self._timeout_handle = None
            self._timer_at = math.inf
        self._wake_writer()

    def pause_writing(self) -> None:
        """The transport's write buffer is full: writers wait in _drain()."""
        self._write_paused = True

    def resume_writing(self) -> None:
        """The transport's write buffer has room again: wake a waiting writer."""
        self._write_paused = False
        self._wake_writer()

    # -- writing ----------------------------------------------------------------------------

    def _hold(self, data: bytes) -> None:
        self._held.append(data)

    def _flush(self) -> None:
        held = self._held
        if held:
            data = held[0] if len(held) == 1 else b"".join(held)
            held.clear()
            if self._transport is not None and not self._transport.is_closing():
                self._transport.write(data)

    async def _drain(self) -> None:
        if len(self._held) >= _MAX_HELD or self._write_paused:
            self._flush()
            while self._write_paused and not self._closed:
                self._drained = self._loop.create_future()
                await self._drained

    def _hang_up(self) -> None:
        """Write what is held and close; read nothing more.

        A TLS transport is lost only once the client answers close_notify (or
        after a timeout): the reader must not wait for that.
        """
        self._flush()
        if self._transport is not None:
            self._transport.close()
        self._inbox.feed_eof()

    def _wake_writer(self) -> None:
        waiter = self._drained
        if waiter is not None:
            self._drained = None
            if not waiter.done():
                waiter.set_result(None)

    # -- reading ----------------------------------------------------------------------------

    def _pause_reading(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.pause_reading()

    def _resume_reading(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.resume_reading()

    @property
    def _closed(self) -> bool:
        return self._transport is None or self._transport.is_closing()

    # -- idle timeout -----------------------------------------------------------------------

    def _reset_timeout(self, duration: float | None = None) -> None:
        loop = self._loop
        deadline = loop.time() + (duration or self._timeout_s)
        self._deadline = deadline
        if self._timer_at > deadline:  # none armed, or armed for later than this
            if self._timeout_handle is not None:
                self._timeout_handle.cancel()
            self._timer_at = deadline
            self._timeout_handle = loop.call_at(deadline, self._timeout_check)

    def _timeout_check(self) -> None:
        deadline = self._deadline
        if self._loop.time() < deadline:  # busy meanwhile
            self._timer_at = deadline
            self._timeout_handle = self._loop.call_at(deadline, self._timeout_check)
            return
        self._timer_at = math.inf
        self._timeout_handle = None
        self._timeout_cb()

    def _timeout_cb(self) -> None:
        """The idle deadline passed; the session decides what to say."""
        self._hang_up()
