"""Handing accepted messages to the queue from the event loop, without blocking it.

SUMMARY
    handoff = Handoff(queue)
    accepted = await handoff.submit(submission, content)   # durable when it returns
    handoff.close()

DESCRIPTION
    Queue.submit_future writes the spool file in the caller's thread and
    returns a future that the store's committer resolves once content and
    meta are durable.  Creating that file waits while the file system
    commits other messages' fsyncs (an ext4 journal commit): measured on
    the event loop, half of the loop's time went there at 20 sessions.  A
    Handoff runs submit_future on one thread of its own, so the loop only
    puts the message on a queue and awaits the result.

STRATEGIES
    One thread, natural batching.  The thread takes submissions in order;
    while it is busy, new ones wait in the queue without waking anything,
    so a burst costs one wake-up, not one per message (a thread pool paid
    for locks, a future and a wake-up per message, and a second hop back to
    the loop).  The only hop back is the durable result.  Four threads
    instead of one made each submission slower on a busy disk (2.6 ms
    against 1.0 ms on average): they only contend for the GIL and for the
    file system's locks.

    Big messages on the side.  A message spilled to a temporary file is
    copied into the spool on a separate worker thread, so a 50 MB copy does
    not hold up the small messages behind it.

    Small messages straight through.  Content the store keeps in its own
    commit (``store.inline_max``) creates no file, so submitting it cannot
    block on the file system: the loop hands it to the store's committer
    itself, one thread hop fewer per message.

    Never cancel the queue's future.  The result is relayed one way: a
    session that goes away (client gone, stop) cancels only its own
    asyncio future.  The store may already have committed the message;
    cancelling its future would make the committer fail its whole batch.

SEE ALSO
    sluice.smtpd.session, sluice.queue.Queue.submit_future
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import queue as queuelib
import threading

from sluice.model import Accepted, Submission
from sluice.queue import Queue
from sluice.spool import Content

__all__ = ["Handoff", "await_durable"]

_STOP = object()


def _settle(out: asyncio.Future[Accepted], done: concurrent.futures.Future[Accepted]) -> None:
    if out.done():  # the session went away meanwhile
        return
    exc = done.exception()
    if exc is not None:
        out.set_exception(exc)
    else:
        out.set_result(done.result())


def _fail(out: asyncio.Future[Accepted], exc: BaseException) -> None:
    if not out.done():
        out.set_exception(exc)


def _relay(loop: asyncio.AbstractEventLoop, out: asyncio.Future[Accepted],
           fut: concurrent.futures.Future[Accepted]) -> None:
    def done_cb(done: concurrent.futures.Future[Accepted]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            loop.call_soon_threadsafe(_settle, out, done)

    fut.add_done_callback(done_cb)


def await_durable(fut: concurrent.futures.Future[Accepted]) -> asyncio.Future[Accepted]:
    """An asyncio future for a queue future, without ever cancelling the latter."""
    loop = asyncio.get_running_loop()
    out: asyncio.Future[Accepted] = loop.create_future()
    _relay(loop, out, fut)
    return out


class Handoff:
    """A thread that submits messages to a Queue for the event loop."""

    def __init__(self, queue: Queue) -> None:
        self.queue = queue
        self._items: queuelib.SimpleQueue[object] = queuelib.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="sluice-smtpd-handoff",
                                        daemon=True)
        self._thread.start()
        self._closed = False

    def submit(self, submission: Submission, content: Content,
               big: bool = False, size: int | None = None) -> asyncio.Future[Accepted]:
        """Queue the message; the future resolves when it is durable.

        It fails with what submit_future raises (StorageError, OSError).
        ``big``: the content is a file to copy; do it on a worker thread.
        ``size``: the content's size in bytes, when known; content in memory
        that the store keeps inline is submitted from the calling loop.
        """
        loop = asyncio.get_running_loop()
        out: asyncio.Future[Accepted] = loop.create_future()
        if self._closed:
            out.set_exception(RuntimeError("the handoff is closed"))
        elif not big and size is not None and size <= self.queue.store.inline_max:
            self._submit_one(loop, submission, content, out)
        elif big:
            loop.run_in_executor(None, self._submit_one, loop, submission, content, out)
        else:
            self._items.put((loop, submission, content, out))
        return out

    def _submit_one(self, loop: asyncio.AbstractEventLoop, submission: Submission,
                    content: Content, out: asyncio.Future[Accepted]) -> None:
        try:
            fut = self.queue.submit_future(submission, content)
        except BaseException as exc:  # relayed to the session, which answers 451
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_fail, out, exc)
            return
        _relay(loop, out, fut)

    def _run(self) -> None:
        while True:
            item = self._items.get()
            if item is _STOP:
                return
            assert isinstance(item, tuple)
            self._submit_one(*item)

    def close(self) -> None:
        """Finish what was handed over, then stop the thread (blocks)."""
        if self._closed:
            return
        self._closed = True
        self._items.put(_STOP)
        self._thread.join()

