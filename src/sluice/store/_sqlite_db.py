"""The sqlite flavour's database: connections, the write lock and the committer.

SUMMARY
    Database, a part of SqliteStore (a mixin: SqliteStore sets the
    attributes): _reading() for readers, _submit_op(work) and _call(work)
    for the committer thread, _write_lock() for every writer; Batch, what
    the operations of one commit share; WalSyncer, the thread that flushes
    committed batches.

DESCRIPTION
    Readers take one connection per thread, opened on first use and
    read-only.  Every write goes through the one committer thread, which
    owns the only write connection.

STRATEGIES
    Group commit, and the fsync outside the write lock: the committer runs
    everything that queued up in one transaction with a savepoint per
    operation, commits with synchronous=NORMAL under the flock(2) lock
    beside the database, releases the lock and hands the batch to the
    syncer thread (WalSyncer), which fdatasyncs the WAL before telling the
    batch's callers that need it while the committer goes on with the
    next batch (see sluice.store.sqlite, STRATEGIES, for why); the others
    (claims, marks, failed attempts) hear of the commit before that flush.  Spool files
    are synced before the rows that point at them are committed, and
    deleted only after the commit that removed their last row is durable.

    Undo pages in memory for small batches.  Each operation runs in a
    savepoint, and SQLite keeps the pages a savepoint changed in a
    sub-journal that spills to a temporary file past 64 KiB: a refill or a
    few delivery outcomes created, wrote and deleted such a file, and the
    queue manager wrote about 100 KB per delivered message, most of it
    there.  The writer keeps temporary files in memory (temp_store), except
    for batches with a bulk operation (an operator action over a selector,
    recovery): their undo pages can be as large as the queue, so they go to
    a file as before.

SEE ALSO
    sluice.store.sqlite (the store), sluice.store._commit (GroupCommitter).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import logging
import os
import queue as queuelib
import sqlite3
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mypy_extensions import mypyc_attr

from sluice._batches import take_queued
from sluice.spool import SpoolFile
from sluice.spool.fs import FsSpool
from sluice.spool.segments import Segments
from sluice.store import StorageError
from sluice.store._commit import GroupCommitter, Op

__all__ = ["BULK", "OP_SAVEPOINT", "Batch", "Database", "WalSyncer"]

_log = logging.getLogger(__name__)

#: The savepoint each operation of a batch runs in; an operation may roll
#: back to it to start over.
OP_SAVEPOINT = "op"

#: An operation's ``extra`` when it may change a large part of the queue:
#: its batch keeps undo pages in a temporary file, not in memory.
BULK = "bulk"


@dataclass(slots=True)
class Batch:
    """What the operations of one commit share.

    The connection, the spool files to delete once the commit is durable,
    and the segments in which it dropped a content (to sweep after it).
    """

    conn: sqlite3.Connection
    unlink: list[str] = field(default_factory=list)
    freed: set[int] = field(default_factory=set)

    def __init__(self, conn: sqlite3.Connection, unlink: list[str] | None = None,
                 freed: set[int] | None = None) -> None:
        self.conn = conn
        self.unlink = [] if unlink is None else unlink
        self.freed = set() if freed is None else freed


@mypyc_attr(allow_interpreted_subclasses=True)  # SqliteStore is not compiled (sluice._native)
class Database:
    """SQLite connections and the committer of SqliteStore; see the module doc."""

    db_path: Path
    spool: FsSpool
    segments: Segments | None
    _busy_timeout_ms: int
    _local: threading.local
    _readers: list[sqlite3.Connection]
    _readers_lock: threading.Lock
    _closed: bool
    #: While close() finishes the segments' sweeps, readers still open.
    _reads_after_close: bool = False
    _lock_fd: int
    _writer: sqlite3.Connection
    _committer: GroupCommitter
    _syncer: WalSyncer
    _temp_in_memory: bool = False

    # -- connections ---------------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(
            self.db_path, isolation_level=None, check_same_thread=False,
            timeout=self._busy_timeout_ms / 1000,
        )
        conn.execute(f"PRAGMA busy_timeout = {self._busy_timeout_ms}")
        conn.execute("PRAGMA journal_mode = WAL")
        # FULL, not NORMAL: in WAL mode NORMAL is not durable on power loss
        # (the writer uses NORMAL and syncs the WAL itself: see _commit).
        conn.execute("PRAGMA synchronous = FULL")
        conn.execute("PRAGMA foreign_keys = OFF")
        conn.execute("PRAGMA cache_size = -65536")
        return conn

    def _reader(self) -> sqlite3.Connection:
        if self._closed and not self._reads_after_close:
            raise StorageError("the store is closed")
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            try:
                conn = self._connect()
                conn.execute("PRAGMA query_only = ON")
            except sqlite3.Error as exc:
                raise StorageError(f"cannot read the queue: {exc}") from exc
            self._local.conn = conn
            with self._readers_lock:
                self._readers.append(conn)
        return conn

    @contextlib.contextmanager
    def _reading(self) -> Iterator[sqlite3.Connection]:
        conn = self._reader()
        try:
            yield conn
        except sqlite3.Error as exc:
            raise StorageError(f"reading the queue failed: {exc}") from exc

    # -- the committer thread -------------------------------------------------------

    def _submit_op(self, work: Callable[[Batch], Any],
                   files: list[SpoolFile] | None = None, *,
                   durable: bool = True, bulk: bool = False, soon: bool = False
                   ) -> concurrent.futures.Future[Any]:
        if self._closed:
            raise StorageError("the store is closed")
        return self._committer.submit(work, files or (), BULK if bulk else None,
                                      durable=durable, soon=soon)

    def _call(self, work: Callable[[Batch], Any], *, durable: bool = True,
              bulk: bool = False) -> Any:
        return self._submit_op(work, durable=durable, bulk=bulk).result()

    def _temp_store_for(self, batch: list[Op]) -> None:
        """Undo pages in memory, unless an operation of the batch is bulk (module doc)."""
        in_memory = all(op.extra != BULK for op in batch)
        if in_memory != self._temp_in_memory:
            self._writer.execute(f"PRAGMA temp_store = {'MEMORY' if in_memory else 'FILE'}")
            self._temp_in_memory = in_memory

    @contextlib.contextmanager
    def _write_lock(self) -> Iterator[None]:
        """The flock(2) beside the database that every process's writer takes."""
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _flush_wal(self) -> None:
        """Make every commit so far durable: fdatasync the WAL.

        Called after a batch that needs it, and before deleting spool files
        that an unsynced batch freed.  fdatasync flushes the file, whichever
        descriptor or process wrote it; a checkpoint in between syncs the
        WAL before copying it into the database and the database after, so
        frames it took along are durable too.
        """
        try:
            fd = os.open(f"{self.db_path}-wal", os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return  # no WAL: the last checkpoint synced the database file
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)

    def _discard(self, op: Op) -> None:
        """An operation cancelled before its commit: its content goes."""
        for f in op.files:
            self._drop(f)

    def _drop(self, f: SpoolFile) -> None:
        """Content written for an operation that will not commit."""
        if f.offset < 0:
            self.spool.discard(f)
        elif self.segments is not None:
            self.segments.settle((f,))  # its bytes stay until the segment goes

    def _sync(self, files: list[SpoolFile]) -> None:
        """Make a batch's content durable: spool files, segments, or both."""
        alone = [f for f in files if f.offset < 0]
        if alone:
            self.spool.sync(alone)
        if self.segments is not None and len(alone) < len(files):
            self.segments.sync([f for f in files if f.offset >= 0])

    def _commit(self, batch: list[Op]) -> None:
        # 1. Content first: sync every spool file of the batch in one go.
        files = [f for op in batch for f in op.files]
        if files:
            try:
                self._sync(files)
            except OSError as exc:
                err = StorageError(f"spool sync failed: {exc}")
                for op in batch:
                    if op.files:
                        for f in op.files:
                            self._drop(f)
                        op.future.set_exception(err)
                batch = [op for op in batch if not op.files]
                if not batch:
                    return
        # 2. Meta: the whole batch in one transaction, one savepoint per op.
        conn = self._writer
        self._temp_store_for(batch)
        after = Batch(conn)
        results: list[tuple[Op, Any, BaseException | None]] = []
        # Several processes (receivers, the queue manager) commit to one
        # database.  SQLite's busy handler sleeps 1, 2, 5, 10 ms between
        # tries; a kernel lock around the transaction wakes the next
        # committer the moment the current one is done.
        with self._write_lock():
            try:
                self._transaction(batch, after, results)
            except sqlite3.Error as exc:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
                err = StorageError(f"queue commit failed: {exc}")
                for op in batch:
                    for f in op.files:
                        self._drop(f)
                    op.future.set_exception(err)
                return
        # 3. Callers that need no flush (a claim, a "delivering" mark, a
        #    failed attempt) and operations that failed hear of the commit
        #    now: they do not wait for a flush that other operations of
        #    their batch asked for.
        segments = self.segments
        if segments is not None:
            # Committed content: its segment may be sealed; dropped content:
            # its segment may be free once the commit is durable.
            segments.settle(f for op, _, failure in results if failure is None
                            for f in op.files if f.offset >= 0)
            if after.freed:
                segments.sweep_soon(after.freed)
        waiting: list[tuple[Op, Any]] = []
        for op, value, failure in results:
            if failure is not None or not (op.durable or op.files):
                self._settle(op, value, failure, None)
            else:
                waiting.append((op, value))
        # 4. Durability, outside the lock and off this thread: the commit
        #    wrote the WAL without syncing it (synchronous=NORMAL), so that
        #    no process waits for another's fsync to begin its own
        #    transaction, and the syncer thread flushes it while this thread
        #    commits the next batch (module doc, "Pipelined flush").  The
        #    callers that need it hear of their commit once it is flushed.
        #    A batch that needs no flush frees its content behind one; one
        #    whose operations asked for a flush soon (Op.soon) gets it now.
        if waiting or any(op.soon for op, _, failure in results if failure is None):
            self._syncer.after(waiting, after.unlink)
        else:
            self.spool.delete_soon(after.unlink, barrier=self._flush_wal)

    def _settle(self, op: Op, value: Any, failure: BaseException | None,
                unsynced: StorageError | None) -> None:
        """Tell an operation's caller how its commit went."""
        if failure is None and unsynced is not None:
            op.future.set_exception(unsynced)
        elif failure is None:
            op.future.set_result(value)
        else:
            for f in op.files:
                self._drop(f)
            if isinstance(failure, sqlite3.Error):
                failure = StorageError(str(failure))
            op.future.set_exception(failure)

    @staticmethod
    def _transaction(batch: list[Op], after: Batch,
                     results: list[tuple[Op, Any, BaseException | None]]) -> None:
        """The whole batch in one transaction, one savepoint per operation."""
        conn = after.conn
        conn.execute("BEGIN IMMEDIATE")
        for op in batch:
            conn.execute(f"SAVEPOINT {OP_SAVEPOINT}")
            try:
                value = op.work(after)
            except Exception as exc:
                conn.execute(f"ROLLBACK TO {OP_SAVEPOINT}")
                conn.execute(f"RELEASE {OP_SAVEPOINT}")
                results.append((op, None, exc))
            else:
                conn.execute(f"RELEASE {OP_SAVEPOINT}")
                results.append((op, value, None))
        conn.execute("COMMIT")


class WalSyncer:
    """The thread that flushes the WAL after commits, then answers their callers.

    ``after(waiting, unlink)`` queues a committed batch: the operations
    whose callers wait for durability, with their values, and the content
    their commit freed.  The thread takes every batch queued while its last
    flush ran, flushes once for all of them (``flush``, the WAL's
    fdatasync), and settles them in commit order; if the flush fails they
    get the error (their rows are committed but maybe not on disk: a client
    retries, a duplicate is possible, a loss after 250 is not) and their
    content waits for a later flush.
    """

    def __init__(self, flush: Callable[[], None],
                 settle: Callable[[Op, Any, BaseException | None, StorageError | None], None],
                 spool: FsSpool, *, name: str = "sluice-wal-sync") -> None:
        self._flush = flush
        self._settle = settle
        self._spool = spool
        self._queue: queuelib.SimpleQueue[tuple[list[tuple[Op, Any]], list[str]] | None] = (
            queuelib.SimpleQueue())
        self._worker = threading.Thread(target=self._run, name=name, daemon=True)
        self._worker.start()

    def after(self, waiting: list[tuple[Op, Any]], unlink: list[str]) -> None:
        """Queue a committed batch for the next flush."""
        self._queue.put((waiting, unlink))

    def _run(self) -> None:
        stop = False
        while not stop:
            item = self._queue.get()
            if item is None:
                return
            # Every batch committed so far shares this flush.
            batches, stop = take_queued(self._queue, item)
            unsynced: StorageError | None = None
            try:
                self._flush()
            except OSError as exc:
                unsynced = StorageError(f"the queue's log could not be synced: {exc}")
            for waiting, unlink in batches:
                self._spool.delete_soon(
                    unlink, barrier=None if unsynced is None else self._flush)
                for op, value in waiting:
                    try:
                        self._settle(op, value, None, unsynced)
                    except Exception:  # one bad answer must not stop the flushes
                        _log.exception("answering a committed operation failed")

    def close(self) -> None:
        """Flush and answer what is queued, then stop the thread."""
        self._queue.put(None)
        self._worker.join()
