"""The success journal: a delivery's success made durable on this node before the store has it.

SUMMARY
    journal = SuccessJournal.open(path, loop) (after replay: starts empty)
    done = journal.append(results)            (asyncio future: set once synced)
    journal.committed(qids); journal.close()
    read_journal(path) -> {qid: JournaledSuccess}     (at start, before recovery)

DESCRIPTION
    A success that has been read from the next hop but is not yet in the
    store is sent again after a crash (docs/queue.md, "What is promised",
    window 2).  With a store across the network (PostgreSQL) an outcome is
    durable only after a transaction's round trips to a server that may
    share the machine's cores: about 3 ms, against well under a
    millisecond for a line appended and synced to a local file.  So each
    success is first written here, one line a recipient, and the delivery
    goes on once the line is synced or the store has the outcome, whichever
    comes first.  The store's group commit still follows, as before.

    At the next start, before in-flight entries are returned to the queue,
    the journal is read (read_journal) and every entry it names that is
    still in flight on this node is recorded as delivered, with the reply
    and the connection's facts the journal kept (Queue.recover).  An entry
    the store already has as delivered is gone and its line is ignored:
    queue ids are never reused, so a stale line can only name an entry
    that no longer exists.

STRATEGIES
    Group commit.  Lines are written from the event loop (page cache,
    microseconds); one thread of the journal's own runs fdatasync for
    everything written before it began, so concurrent batches share a sync.
    The file is emptied (ftruncate) once it has grown past TRUNCATE_AT and
    every success it holds is in the store; a truncation a crash undoes
    only brings back stale lines.

    A journal that cannot be written or synced (a full disk) is not an
    error for the delivery: its future fails, the delivery waits for the
    store as it would without a journal, and the failure is the caller's
    to report.

LIMITATIONS
    An entry whose "delivering" mark had not reached the store when the
    process died is not in flight as such, and is returned and sent again
    as without a journal (the mark is nearly always there, see
    sluice.delivery.agent).  On a queue shared by nodes only this node's
    in-flight entries are replayed; a node that stays down past its claims'
    lease has its entries taken by others first.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from sluice import faults
from sluice._fdio import write_all
from sluice.model import Delivered, QueueEntry, Reply
from sluice.queue import AttemptResult

__all__ = ["JOURNAL_NAME", "TRUNCATE_AT", "JournaledSuccess", "SuccessJournal", "read_journal"]

log = logging.getLogger("sluice.journal")

#: The journal's file name under queue.path.
JOURNAL_NAME = "success.journal"

#: The size past which the journal is emptied once all it holds is in the store.
TRUNCATE_AT = 1 << 20


@dataclass(frozen=True, slots=True)
class JournaledSuccess:
    """What the journal keeps of one recipient's success: enough to record it again."""

    reply: Reply
    localip: str | None = None
    remotemx: str | None = None
    remoteip: str | None = None
    duration_s: float | None = None

    def result(self, entry: QueueEntry) -> AttemptResult:
        """The attempt's outcome, for Queue.record."""
        return AttemptResult(entry, Delivered(self.reply), localip=self.localip,
                             remotemx=self.remotemx, remoteip=self.remoteip,
                             duration_s=self.duration_s)


def _line(res: AttemptResult) -> bytes:
    return orjson.dumps({"q": res.entry.qid, "r": res.outcome.reply.to_record(),
                         "l": res.localip, "m": res.remotemx, "i": res.remoteip,
                         "d": res.duration_s}) + b"\n"


def read_journal(path: str | os.PathLike[str]) -> dict[str, JournaledSuccess]:
    """The successes ``path`` holds by queue id; none when it does not exist.

    A line that does not parse (the last one, torn by a crash while it was
    written, before anyone was told it was durable) is skipped with a warning.
    """
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return {}
    out: dict[str, JournaledSuccess] = {}
    bad = 0
    for raw in data.splitlines():
        if not raw.strip():
            continue
        try:
            item = orjson.loads(raw)
            out[str(item["q"])] = JournaledSuccess(
                Reply.from_record(item["r"]), localip=item.get("l"), remotemx=item.get("m"),
                remoteip=item.get("i"), duration_s=item.get("d"))
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, IndexError):
            bad += 1
    if bad:
        log.warning("%s: %d line(s) that do not parse were skipped (a torn last write)",
                    path, bad)
    return out


class SuccessJournal:
    """Successes appended and synced in groups; emptied when the store has them all."""

    def __init__(self, path: str | os.PathLike[str], fd: int,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.path = str(path)
        self._fd = fd
        self._loop = loop
        self._size = 0
        self._outstanding: set[str] = set()  # written here, not yet committed in the store
        self._cond = threading.Condition()
        self._wanted = 0       # writes made (a sequence number)
        self._synced = 0       # writes covered by a finished fdatasync
        self._spids: list[str] = []
        self._closing = False
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = \
            collections.deque()
        self._thread = threading.Thread(target=self._run, name="sluice-journal", daemon=True)
        self._thread.start()

    @classmethod
    def open(cls, path: str | os.PathLike[str], loop: asyncio.AbstractEventLoop
             ) -> SuccessJournal:
        """Open ``path`` empty (its lines replayed already); futures are ``loop``'s."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC,
                     0o640)
        try:
            os.fsync(fd)  # the emptying is durable: a crash never replays old lines twice
        except OSError:
            os.close(fd)
            raise
        return cls(path, fd, loop)

    def append(self, results: Sequence[AttemptResult]) -> asyncio.Future[None]:
        """Write the successes among ``results``; the future is set once they are synced.

        Raises OSError when they cannot be written; the future fails when
        they cannot be synced.  The caller reports each success through
        committed() once the store has it.
        """
        data = b"".join(_line(r) for r in results)
        write_all(self._fd, data)
        self._size += len(data)
        self._outstanding.update(r.entry.qid for r in results)
        fut = self._loop.create_future()
        with self._cond:
            self._wanted += 1
            self._waiters.append((self._wanted, fut))
            self._spids.extend(r.entry.spid for r in results)
            self._cond.notify()
        return fut

    def committed(self, qids: Iterable[str]) -> None:
        """These entries' successes are in the store now; empty the file if it may."""
        self._outstanding.difference_update(qids)
        if not self._outstanding and self._size >= TRUNCATE_AT:
            try:
                os.ftruncate(self._fd, 0)
            except OSError as exc:
                log.warning("%s: cannot empty the journal: %s", self.path, exc)
                return
            self._size = 0

    def close(self) -> None:
        """Stop the sync thread after its last sync, and close the file."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join()
        os.close(self._fd)

    # -- the sync thread -------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._sync_until_closed()
        except BaseException:  # never silently: the deliveries fall back on the store
            log.exception("%s: the journal's sync thread failed", self.path)
            raise

    def _sync_until_closed(self) -> None:
        while True:
            with self._cond:
                while self._wanted == self._synced and not self._closing:
                    self._cond.wait()
                if self._wanted == self._synced:
                    return
                target, spids, self._spids = self._wanted, self._spids, []
            error: OSError | None = None
            try:
                os.fdatasync(self._fd)
            except OSError as exc:
                error = exc
            else:
                faults.point("after_journal", spids)
            with self._cond:
                self._synced = target
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits
                self._loop.call_soon_threadsafe(self._resolve, target, error)

    def _resolve(self, target: int, error: OSError | None) -> None:
        while self._waiters and self._waiters[0][0] <= target:
            _, fut = self._waiters.popleft()
            if fut.done():
                continue
            if error is None:
                fut.set_result(None)
            else:
                fut.set_exception(error)


def first_of(*futures: asyncio.Future[Any]) -> asyncio.Future[None]:
    """A future set when the first of ``futures`` succeeds, or when all have ended."""
    loop = asyncio.get_running_loop()
    out: asyncio.Future[None] = loop.create_future()
    left = [len(futures)]

    def ended(fut: asyncio.Future[Any]) -> None:
        left[0] -= 1
        if out.done():
            return
        if (not fut.cancelled() and fut.exception() is None) or left[0] == 0:
            out.set_result(None)

    for fut in futures:
        fut.add_done_callback(ended)
    return out
