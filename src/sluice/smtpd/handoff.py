"""Handing accepted messages to the queue from the event loop, without blocking it.

SUMMARY
    handoff = Handoff(queue, resends=None)
    accepted = await handoff.submit(submission, content)   # durable when it returns
    accepted = await handoff.submit(submission, content, origin=Origin(user, ip))
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

    Resends checked before submitting (``smtpd.dedupe``, with an origin).
    The handoff thread marks the message and claims its key in the index
    (sluice.smtpd.dedupe), then submits it -- every claim waiting in its
    queue in one transaction, so a burst pays one fsync of the index; a resend resolves the future
    with the first message's Accepted (``duplicate``) and queues nothing.
    When the queue's future resolves, the committer thread only puts the
    confirmation (or, on failure, the forgetting) of the key on the
    handoff thread's queue: it never waits for the index.  A big message
    is read through once for its digest into a temporary copy, on a
    worker thread.  An index that fails (disk full) is logged and the
    message queued anyway: a duplicate is allowed, a refusal would not
    be worth it.

    Never cancel the queue's future.  The result is relayed one way: a
    session that goes away (client gone, stop) cancels only its own
    asyncio future.  The store may already have committed the message;
    cancelling its future would make the committer fail its whole batch.

SEE ALSO
    sluice.smtpd.session, sluice.smtpd.dedupe, sluice.queue.Queue.submit_future
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import queue as queuelib
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import IO, Protocol

from sluice.accounting import AccountingLog
from sluice.model import Accepted, Submission
from sluice.smtpd.dedupe import Claimed, Duplicate, InFlight, Mark, Origin, Resends
from sluice.spool import Content
from sluice.store import StorageError, Store

__all__ = ["Handoff", "ResendInFlight", "Submitting", "await_durable"]


class Submitting(Protocol):
    """What the receiver uses of sluice.queue.Queue.

    A protocol, not the class: the receiver needs these five members only,
    and a compiled module (sluice._native) checks a class-typed argument's
    class at run time, where a protocol admits any object that has them.
    """

    @property
    def node(self) -> str:
        """This node's id, for the accounting lines."""

    @property
    def accounting(self) -> AccountingLog | None:
        """The accounting log, if one is kept."""

    @property
    def store(self) -> Store:
        """The store, for its inline_max."""

    def clock(self) -> float:
        """Now, in seconds since the epoch."""

    def submit_future(self, submission: Submission, content: Content
                      ) -> concurrent.futures.Future[Accepted]:
        """Queue a message; the future resolves once it is durable."""

log = logging.getLogger("sluice.smtpd")

_STOP = object()

#: Bytes read at a time from the temporary copy of a big message.
_PIECE = 1 << 16

#: Claims written to the index in one transaction at most.
CLAIM_BATCH = 256


class ResendInFlight(StorageError):
    """The same message is being queued by another session now (answer 451)."""


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


def _give(out: asyncio.Future[Accepted], accepted: Accepted) -> None:
    if not out.done():
        out.set_result(accepted)


def _relay(loop: asyncio.AbstractEventLoop, out: asyncio.Future[Accepted],
           fut: concurrent.futures.Future[Accepted]) -> None:
    def done_cb(done: concurrent.futures.Future[Accepted]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            loop.call_soon_threadsafe(_settle, out, done)

    fut.add_done_callback(done_cb)


def _call(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: object) -> None:
    with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
        loop.call_soon_threadsafe(fn, *args)


def await_durable(fut: concurrent.futures.Future[Accepted]) -> asyncio.Future[Accepted]:
    """An asyncio future for a queue future, without ever cancelling the latter."""
    loop = asyncio.get_running_loop()
    out: asyncio.Future[Accepted] = loop.create_future()
    _relay(loop, out, fut)
    return out


def _replay(prefix: bytes, copy: IO[bytes]) -> Iterator[bytes]:
    """The content again, from the temporary copy made while digesting it."""
    try:
        copy.seek(0)
        if prefix:
            yield prefix
        while piece := copy.read(_PIECE):
            yield piece
    finally:
        copy.close()


@dataclass(slots=True)
class _ClaimJob:
    """A message to check for a resend before submitting (smtpd.dedupe)."""

    loop: asyncio.AbstractEventLoop
    submission: Submission
    content: Content
    text: Iterable[bytes]  # the client's text: content without our trace header
    size: int | None
    origin: Origin
    out: asyncio.Future[Accepted]
    discard: Callable[[], None] | None = None  # when content is not submitted

    def __init__(self, loop: asyncio.AbstractEventLoop, submission: Submission, content: Content,
                 text: Iterable[bytes], size: int | None, origin: Origin,
                 out: asyncio.Future[Accepted], discard: Callable[[], None] | None = None) -> None:
        self.loop = loop
        self.submission = submission
        self.content = content
        self.text = text
        self.size = size
        self.origin = origin
        self.out = out
        self.discard = discard

    def dispose(self) -> None:
        if self.discard is not None:
            self.discard()


@dataclass(frozen=True, slots=True)
class _SettleJob:
    """The queue has answered a marked submission: confirm or forget its key."""

    mark: Mark
    accepted: Accepted | None  # None: not queued

    def __init__(self, mark: Mark, accepted: Accepted | None) -> None:
        object.__setattr__(self, "mark", mark)
        object.__setattr__(self, "accepted", accepted)


class Handoff:
    """A thread that submits messages to a Queue for the event loop."""

    def __init__(self, queue: Submitting, resends: Resends | None = None) -> None:
        self.queue = queue
        self.resends = resends
        self._items: queuelib.SimpleQueue[object] = queuelib.SimpleQueue()
        self._worker = threading.Thread(target=self._run, name="sluice-smtpd-handoff",
                                        daemon=True)
        self._worker.start()
        self._closed = False

    def submit(self, submission: Submission, content: Content,
               big: bool = False, size: int | None = None,
               origin: Origin | None = None) -> asyncio.Future[Accepted]:
        """Queue the message; the future resolves when it is durable.

        It fails with what submit_future raises (StorageError, OSError).
        ``big``: the content is a file to copy; do it on a worker thread.
        ``size``: the content's size in bytes, when known; content in memory
        that the store keeps inline is submitted from the calling loop.
        ``origin``: who sent it; with ``resends``, a resend of a message
        queued before resolves with that message's Accepted (``duplicate``)
        and queues nothing.  The first piece of ``content`` is then the
        receiver's own trace header, which the comparison leaves out.
        """
        loop = asyncio.get_running_loop()
        out: asyncio.Future[Accepted] = loop.create_future()
        if self._closed:
            out.set_exception(RuntimeError("the handoff is closed"))
        elif self.resends is not None and origin is not None:
            if not big and isinstance(content, list):
                self._items.put(_ClaimJob(loop, submission, content, content[1:], size,
                                          origin, out))
            else:
                loop.run_in_executor(None, self._marked_big, loop, submission, content, size,
                                     origin, out)
        elif not big and size is not None and size <= self.queue.store.inline_max:
            self._submit_one(loop, submission, content, out)
        elif big:
            loop.run_in_executor(None, self._submit_one, loop, submission, content, out)
        else:
            self._items.put(functools.partial(self._submit_one, loop, submission, content, out))
        return out

    def _submit_one(self, loop: asyncio.AbstractEventLoop, submission: Submission,
                    content: Content, out: asyncio.Future[Accepted],
                    mark: Mark | None = None) -> None:
        try:
            fut = self.queue.submit_future(submission, content)
        except BaseException as exc:  # relayed to the session, which answers 451
            if mark is not None:
                self._after(mark, None)
            _call(loop, _fail, out, exc)
            return
        if mark is not None:
            # On the committer's thread: only hand the index work over.
            fut.add_done_callback(functools.partial(self._after, mark))
        _relay(loop, out, fut)

    # -- resends (smtpd.dedupe) -----------------------------------------------------

    def _claim_batch(self, jobs: list[_ClaimJob]) -> None:
        """Mark, claim (one write of the index for all), then submit each or answer it.

        The answer of a claimed key comes from the index.  Runs on the handoff
        thread or a worker.
        """
        resends = self.resends
        assert resends is not None
        marked: list[tuple[_ClaimJob, Mark | None]] = []
        for job in jobs:
            try:
                mark = resends.mark(job.submission, job.text, job.origin, job.size or 0)
            except BaseException as exc:  # the content could not be read (451)
                job.dispose()
                _call(job.loop, _fail, job.out, exc)
                continue
            marked.append((job, mark))
        claims = [m for _, m in marked if m is not None]
        verdicts: Iterator[Claimed | Duplicate | InFlight] | None = None
        if claims:
            try:
                verdicts = iter(resends.claim_all(claims))
            except Exception as exc:  # sqlite3.Error, OSError: queue them unchecked
                log.warning("smtpd.dedupe: the index failed (%s); %d message(s) queued "
                            "without the resend check", exc, len(claims))
        for job, mark in marked:
            verdict: Claimed | Duplicate | InFlight = Claimed()
            if mark is not None:
                if verdicts is None:
                    mark = None
                else:
                    verdict = next(verdicts)
            if not isinstance(verdict, Claimed):
                job.dispose()
            match verdict:
                case Duplicate(accepted=accepted):
                    _call(job.loop, _give, job.out, accepted)
                case InFlight():
                    _call(job.loop, _fail, job.out, ResendInFlight(
                        "the same message is being queued by another session"))
                case Claimed():
                    self._submit_one(job.loop, job.submission, job.content, job.out, mark)

    def _marked_big(self, loop: asyncio.AbstractEventLoop, submission: Submission,
                    content: Content, size: int | None, origin: Origin,
                    out: asyncio.Future[Accepted]) -> None:
        """Submit content held in a file, digested into a temporary copy.

        Otherwise as _claim_batch (on a worker thread).
        """
        resends = self.resends
        assert resends is not None
        if isinstance(content, bytes | bytearray | memoryview):
            content = [bytes(content)]
        pieces: Iterator[bytes] = (iter(content) if not hasattr(content, "read")
                                   else iter(functools.partial(content.read, _PIECE), b""))
        try:
            prefix = next(pieces, b"")
            copy = tempfile.TemporaryFile(prefix="smtpd-", dir=resends.spill_dir)  # noqa: SIM115
        except BaseException as exc:
            _call(loop, _fail, out, exc)
            return

        def copied() -> Iterator[bytes]:
            for piece in pieces:
                copy.write(piece)
                yield piece

        # mark() reads ``copied`` to its end before _replay is read.
        self._claim_batch([_ClaimJob(loop, submission, _replay(prefix, copy), copied(), size,
                                     origin, out, copy.close)])

    def _after(self, mark: Mark,
               done: concurrent.futures.Future[Accepted] | None) -> None:
        ok = done is not None and not done.cancelled() and done.exception() is None
        accepted = done.result() if done is not None and ok else None
        self._items.put(_SettleJob(mark, accepted))

    def _settle_batch(self, jobs: list[_SettleJob]) -> None:
        """Confirm (or forget) the keys of submissions the queue has answered."""
        resends = self.resends
        assert resends is not None
        try:
            resends.settle_all([(job.mark, job.accepted) for job in jobs])
        except Exception as exc:  # the keys stay pending: settled at the next start
            log.warning("smtpd.dedupe: the index could not record %d message(s): %s",
                        len(jobs), exc)

    def _run(self) -> None:
        pending: object = None
        while True:
            item = pending if pending is not None else self._items.get()
            pending = None
            if item is _STOP:
                return
            if isinstance(item, _ClaimJob | _SettleJob):
                # Every job of the kind waiting now goes in one write of the index.
                batch = [item]
                while len(batch) < CLAIM_BATCH:
                    try:
                        more = self._items.get_nowait()
                    except queuelib.Empty:
                        break
                    if type(more) is not type(item):
                        pending = more
                        break
                    batch.append(more)
                if isinstance(item, _ClaimJob):
                    self._claim_batch([j for j in batch if isinstance(j, _ClaimJob)])
                else:
                    self._settle_batch([j for j in batch if isinstance(j, _SettleJob)])
                continue
            assert callable(item)
            item()

    def close(self) -> None:
        """Finish what was handed over, then stop the thread (blocks)."""
        if self._closed:
            return
        self._closed = True
        self._items.put(_STOP)
        self._worker.join()
        # Confirmations that came in behind the stop (the committer was
        # still at work) are done here; any later ones are settled at the
        # next start.
        late: list[_SettleJob] = []
        with contextlib.suppress(queuelib.Empty):
            while True:
                item = self._items.get_nowait()
                if isinstance(item, _SettleJob):
                    late.append(item)
        if late:
            self._settle_batch(late)
        if self.resends is not None:
            self.resends.close()
