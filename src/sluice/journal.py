"""The success journal: a delivery's success made durable on this node before the store has it.

SUMMARY
    paths = journal_paths(queue_path, node_id)
    kept = read_journal(paths)                (at start, before recovery)
    journal = SuccessJournal.open(paths, loop)  (after the replay: starts empty)
    done = journal.append(results)            (asyncio future: set once synced)
    journal.committed(qids); journal.close()

DESCRIPTION
    A success that has been read from the next hop but is not yet in the
    store is sent again after a crash (docs/queue.md, "What is promised",
    window 2).  With a store across the network (PostgreSQL) an outcome is
    durable only after a transaction's round trips to a server that may
    share the machine's cores: a few milliseconds, against well under one
    for a line appended and synced to a local file.  So each success is
    first written here, one line a recipient, and the delivery goes on once
    the line is synced; the outcomes then go to the store's group commit
    (sluice.runtime.recorder), so the store never has a success the
    journal lacks.  If the journal fails, the delivery waits for the store
    as it would without one.

    At the next start, before in-flight entries are returned to the queue,
    the journal is read (read_journal) and every entry it names that is
    still in flight on this node, with the arrival time the line kept, is
    recorded as delivered with the reply, the connection's facts and the
    time the journal kept (Queue.recover).  Its ``delivered`` line was
    written before the journal's (Queue.log_successes), and a line here
    says so ("w"); only a success whose accounting line could not be
    written is logged at the replay, with the time of the reply, not of
    the restart.  An entry the store already has as delivered is gone and
    its line is ignored.

STRATEGIES
    Group commit.  Lines are written from the event loop (a write(2) of a
    few hundred bytes to the page cache, as the accounting log's); one
    thread of the journal's own runs fdatasync for everything written
    before it began, so concurrent batches share a sync.

    Two files, in turn.  Successes are appended to one file until it has
    grown past ROTATE_AT; then, if the other is empty, appends go there,
    and the first is emptied (ftruncate, on the journal's thread) as soon
    as every success it holds is in the store.  So the journal stays small
    under a steady load, when some success is always on its way to the
    store.  A truncation a crash undoes only brings back lines of entries
    that are gone.  The files are named by node id: nodes that share a
    queue.path never touch each other's.

    A journal that cannot be written or synced (a full disk) is not an
    error for the delivery: append() raises or its future fails, the
    delivery waits for the store as it would without a journal, and the
    caller reports the failure.  A write that failed part-way is cut off
    again, so the next line starts clean; if even that fails, or a file
    cannot be emptied, or the thread fails, the journal refuses further
    appends until the next start (one error in the log).

LIMITATIONS
    On a queue shared by nodes only this node's entries marked
    "delivering" in the store are replayed (there an attempt waits for
    that mark: sluice.marks), and only while its claims are its own:
    a node that stays down past its lease (cluster.node_lease) has its
    entries taken by the others first.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from sluice import faults
from sluice._fdio import open_log, write_all
from sluice._fsync import fsync_path
from sluice.model import Delivered, QueueEntry, Reply
from sluice.queue import AttemptResult

__all__ = ["ROTATE_AT", "JournaledSuccess", "SuccessJournal", "first_of", "journal_paths",
           "read_journal"]

log = logging.getLogger("sluice.journal")

#: The size past which appends go to the other file, once it is empty.
ROTATE_AT = 1 << 20

#: Arrival times kept in a line and read from the store agree to this (seconds).
_SAME_ARRIVAL_S = 1e-3


def journal_paths(queue_path: str | os.PathLike[str], node_id: str) -> tuple[Path, Path]:
    """This node's two journal files under queue.path."""
    base, stem = Path(queue_path), f"success-{node_id}" if node_id else "success"
    return base / f"{stem}.0.journal", base / f"{stem}.1.journal"


@dataclass(frozen=True, slots=True)
class JournaledSuccess:
    """What the journal keeps of one recipient's success: enough to record it again."""

    reply: Reply
    arrival_at: float | None = None
    localip: str | None = None
    remotemx: str | None = None
    remoteip: str | None = None
    duration_s: float | None = None
    #: When the reply came (the append's time); None in a line written without it.
    at: float | None = None
    #: Its ``delivered`` line was written before the journal had it (not
    #: again at the replay); False in a line written without the mark.
    logged: bool = False

    def concerns(self, entry: QueueEntry) -> bool:
        """Whether ``entry`` is the one this success was for (its arrival time agrees)."""
        return self.arrival_at is None or abs(entry.arrival_at - self.arrival_at) < _SAME_ARRIVAL_S

    def result(self, entry: QueueEntry) -> AttemptResult:
        """The attempt's outcome, for Queue.record."""
        return AttemptResult(entry, Delivered(self.reply), localip=self.localip,
                             remotemx=self.remotemx, remoteip=self.remoteip,
                             duration_s=self.duration_s, at=self.at, logged=self.logged)


def _line(res: AttemptResult, at: float) -> bytes:
    return orjson.dumps({"q": res.entry.qid, "a": res.entry.arrival_at, "t": res.at_or(at),
                         "r": res.outcome.reply.to_record(), "l": res.localip,
                         "m": res.remotemx, "i": res.remoteip, "d": res.duration_s,
                         "w": 1 if res.logged else 0}) + b"\n"


def read_journal(paths: Iterable[str | os.PathLike[str]]) -> dict[str, JournaledSuccess]:
    """The successes the files hold by queue id; none from a file that does not exist.

    A line that does not parse (the last one, torn by a crash while it was
    written, before anyone was told it was durable) is skipped with a warning.
    """
    out: dict[str, JournaledSuccess] = {}
    for path in paths:
        try:
            data = Path(path).read_bytes()
        except FileNotFoundError:
            continue
        bad = 0
        for raw in data.splitlines():
            if not raw.strip():
                continue
            try:
                item = orjson.loads(raw)
                arrival, at = item.get("a"), item.get("t")
                out[str(item["q"])] = JournaledSuccess(
                    Reply.from_record(item["r"]),
                    arrival_at=None if arrival is None else float(arrival),
                    localip=item.get("l"), remotemx=item.get("m"), remoteip=item.get("i"),
                    duration_s=item.get("d"), at=None if at is None else float(at),
                    logged=bool(item.get("w")))
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, IndexError,
                    AttributeError):
                bad += 1
        if bad:
            log.warning("%s: %d line(s) that do not parse were skipped (a torn last write)",
                        path, bad)
    return out


class _File:
    """One of the journal's two files, as the loop sees it."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd = fd
        self.size = 0
        self.held: set[str] = set()  # successes written here, not yet in the store
        self.emptying = False


class SuccessJournal:
    """Successes appended and synced in groups, in two files emptied in turn."""

    def __init__(self, files: Sequence[_File], loop: asyncio.AbstractEventLoop) -> None:
        self._files = list(files)
        self._cur = 0
        self._loop = loop
        self._broken: OSError | None = None
        self._cond = threading.Condition()
        self._wanted = 0             # writes made (a sequence number)
        self._synced = 0             # writes covered by a finished sync
        self._dirty: set[int] = set()  # files written since their last sync
        self._empty: list[int] = []  # files to truncate
        self._spids: list[str] = []
        self._closing = False
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = \
            collections.deque()
        self._thread = threading.Thread(target=self._run, name="sluice-journal", daemon=True)
        self._thread.start()

    @classmethod
    def open(cls, paths: Sequence[Path], loop: asyncio.AbstractEventLoop) -> SuccessJournal:
        """Open ``paths`` empty (their lines replayed already); futures are ``loop``'s."""
        files: list[_File] = []
        try:
            for path in paths:
                files.append(_File(path, open_log(path)))
                os.fsync(files[-1].fd)  # emptied for good: a crash never replays old lines twice
            for directory in {str(p.parent) for p in paths}:
                fsync_path(directory)  # and the files' names are there after a power cut
        except OSError:
            for f in files:
                os.close(f.fd)
            raise
        return cls(files, loop)

    def append(self, results: Sequence[AttemptResult], at: float | None = None
               ) -> asyncio.Future[None]:
        """Write these successes, got at their own ``at`` or this one (default: now).

        The future is set once they are synced.

        Raises OSError when they cannot be written (the future fails when
        they cannot be synced).  The caller reports each success through
        committed() once the store has it.
        """
        self._check()
        when = time.time() if at is None else at
        data = b"".join(_line(r, when) for r in results)
        f = self._files[self._cur]
        if f.size >= ROTATE_AT:
            other = self._files[1 - self._cur]
            if other.size == 0 and not other.emptying:
                self._cur = 1 - self._cur
                f = other
        try:
            write_all(f.fd, data)
        except OSError as exc:
            try:
                os.ftruncate(f.fd, f.size)  # no torn line before the next one
            except OSError:
                self._broken = exc
            raise
        f.size += len(data)
        f.held.update(r.entry.qid for r in results)
        fut = self._loop.create_future()
        with self._cond:
            self._check()  # the thread may have stopped meanwhile: nobody would sync it
            self._wanted += 1
            self._waiters.append((self._wanted, fut))
            self._dirty.add(self._cur)
            self._spids.extend(r.entry.spid for r in results)
            self._cond.notify()
        return fut

    def _check(self) -> None:
        if self._closing:
            raise OSError(0, "the success journal is closed")
        if self._broken is not None:
            raise OSError(self._broken.errno, "the success journal is off until the next "
                          f"start: {self._broken.strerror or self._broken}")

    def committed(self, qids: Iterable[str]) -> None:
        """These entries' successes are in the store now; a file not in use may be emptied."""
        done = list(qids)
        for i, f in enumerate(self._files):
            f.held.difference_update(done)
            if i != self._cur and f.size and not f.held and not f.emptying:
                f.emptying = True
                with self._cond:
                    self._empty.append(i)
                    self._cond.notify()

    def close(self) -> None:
        """Stop the thread after its last sync, and close the files."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join()
        for f in self._files:
            os.close(f.fd)

    # -- the journal's thread ----------------------------------------------------------

    def _run(self) -> None:
        try:
            self._work_until_closed()
        except BaseException as exc:  # never silently: the deliveries fall back on the store
            log.exception("the success journal's thread failed")
            with self._cond:
                self._broken = OSError(0, f"its thread failed: {exc!r}")
                wanted = self._wanted
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._resolve, wanted, self._broken)
            raise

    def _work_until_closed(self) -> None:
        while True:
            with self._cond:
                while (self._wanted == self._synced and not self._empty
                       and not self._closing):
                    self._cond.wait()
                if self._wanted == self._synced and not self._empty:
                    return
                target, spids, self._spids = self._wanted, self._spids, []
                dirty, self._dirty = self._dirty, set()
                empty, self._empty = self._empty, []
            error: OSError | None = None
            for i in sorted(dirty):
                try:
                    os.fdatasync(self._files[i].fd)
                except OSError as exc:
                    error = error or exc
            if dirty and error is None:
                faults.point("after_journal", spids)
            for i in empty:
                try:
                    os.ftruncate(self._files[i].fd, 0)
                except OSError as exc:
                    log.error("%s: cannot empty it (%s): the success journal is off until "
                              "the next start", self._files[i].path, exc)
                    with self._cond:
                        self._broken = exc
                    continue
                with contextlib.suppress(RuntimeError):
                    self._loop.call_soon_threadsafe(self._emptied, i)
            with self._cond:
                self._synced = target
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits
                self._loop.call_soon_threadsafe(self._resolve, target, error)

    def _emptied(self, i: int) -> None:
        f = self._files[i]
        f.emptying = False
        f.size = 0

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
