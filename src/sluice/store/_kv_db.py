"""The kv flavour's database: opening and reopening LevelDB, the committer, content.

SUMMARY
    Database, a part of KvStore: _snapshot() for readers, _op(work) for
    the committer thread, _write_content(content) for submitters.

DESCRIPTION
    Every write to LevelDB goes through _write, one at a time.  After a
    write error the database is closed and reopened (replaying its log)
    before the next write, and only when the disk has room for the log to
    be replayed; a batch that follows a reopen checks that the content of
    its submissions survived it.  The committer syncs LevelDB's log files
    once for the content of the whole batch, then writes the batch's meta
    keys, index keys and counters in one WriteBatch and syncs the log files
    again.  A batch that holds new mail and other changes (delivery
    outcomes, marks, operator actions) commits the others first, synced on
    their own: an outcome must not wait for the content of new mail to be
    synced, since every millisecond it is not durable is one in which a
    crash sends its message twice (docs/queue.md, at least once).

STRATEGIES
    No sync for what may be lost in a power cut (``durable=False``: claims,
    "delivering" marks), as with SQLite: such a batch is written to the
    operating system, which keeps it through a crash of the process, and
    its callers hear of it at once.  It used to be a synchronous write like
    any other, three per delivered message, and an outcome arriving while
    one ran waited for it.  Durable batches sync every log file, not only
    the current one (which is all a synchronous LevelDB write syncs): an
    unsynced batch may sit in the log LevelDB just left, and a durable one
    written after it must not survive a power cut without it.  A log that
    LevelDB retired meanwhile was synced into a table before it went.

SEE ALSO
    sluice.store.kv (the layout and its strategies), sluice.store._commit
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import plyvel

from sluice.spool import Content, iter_chunks, spid_candidates
from sluice.store import StorageError
from sluice.store._commit import GroupCommitter, Op, RWLock, fsync_paths
from sluice.store._kv_batch import Batch, Loader, SnapReader
from sluice.store._kv_keys import (
    PENDING_PREFIX,
    STAT_NAMES,
    b,
    chunk_key,
    exists_key,
    stat_key,
)

#: ZoneMTA's body chunk size.
CHUNK_SIZE = 65536

#: Room needed on the disk, besides the size of LevelDB's logs, before the
#: database is reopened after a write error.
REOPEN_MARGIN = 1 << 20


@dataclass(slots=True)
class Submit:
    """What the committer needs to know about a submission's content."""

    spid: str
    chunks: int
    size: int = 0


class ChunkReader(io.RawIOBase):
    """A message's content, chunk by chunk, from one snapshot."""

    def __init__(self, store: Database, spid: str, snap: Any, chunks: int) -> None:
        self._store = store
        self._spid = spid
        self._snap = snap
        self._chunks = chunks
        self._next = 1
        self._buf = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        if not self._buf:
            if self._next > self._chunks:
                return 0
            try:
                with self._store._rw.reading():
                    data = self._snap.get(chunk_key(self._spid, self._next))
            except (plyvel.Error, RuntimeError) as exc:
                raise OSError(f"reading {self._spid} failed: {exc}") from exc
            if data is None:
                raise OSError(f"chunk {self._next} of {self._spid} is missing")
            self._next += 1
            self._buf = memoryview(data)
        n = min(len(view), len(self._buf))
        view[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n

    def close(self) -> None:
        if not self.closed:
            with contextlib.suppress(plyvel.Error, RuntimeError):
                self._snap.close()
        super().close()



def _needs_sync(op: Op) -> bool:
    """Whether an operation's caller hears of its commit only after the log sync."""
    return op.durable or isinstance(op.extra, Submit)

class Database:
    """LevelDB and the committer of KvStore (a mixin: KvStore sets the attributes)."""

    dir: Path
    _rw: RWLock
    _wlock: threading.Lock
    _broken: bool
    _reopened: bool
    _inflight: set[str]
    _inflight_lock: threading.Lock
    _closed: bool
    _db: Any | None
    _committer: GroupCommitter

    # -- the database -------------------------------------------------------------------

    def _open_db(self) -> Any:
        try:
            return plyvel.DB(
                str(self.dir), create_if_missing=True, write_buffer_size=16 << 20,
                max_open_files=500, lru_cache_size=32 << 20, bloom_filter_bits=10,
            )
        except plyvel.IOError as exc:
            if "lock" in str(exc).lower():
                raise StorageError(
                    f"the kv queue at {self.dir} is open in another process "
                    "(LevelDB allows one); use the running server's API") from exc
            raise StorageError(f"cannot open the kv queue at {self.dir}: {exc}") from exc
        except plyvel.Error as exc:
            raise StorageError(f"cannot open the kv queue at {self.dir}: {exc}") from exc

    def _try_reopen(self) -> None:
        """After a write error: close LevelDB and reopen it, replaying its log.

        A write that fails part way leaves a torn record in LevelDB's log,
        and on the next open LevelDB drops everything after it -- even
        synchronous writes that were acknowledged (ZoneMTA's data loss on
        recovery).  So nothing is written after an error until the
        database has been reopened, and it is reopened only when the disk
        has room for the log to be replayed into a table.
        """
        logs = 0
        with contextlib.suppress(OSError):
            logs = sum(p.stat().st_size for p in self.dir.glob("*.log"))
        need = logs + REOPEN_MARGIN
        try:
            st = os.statvfs(self.dir)
            free = st.f_bavail * st.f_frsize
        except OSError as exc:
            raise StorageError(f"cannot check the disk of {self.dir}: {exc}") from exc
        if free < need:
            raise StorageError(
                f"the disk holding {self.dir} is full: {free} bytes free, about {need} "
                "needed to reopen the queue after a write error")
        with self._rw.writing():
            if not self._broken and self._db is not None:
                return
            if self._db is not None:
                with contextlib.suppress(plyvel.Error, RuntimeError):
                    self._db.close()
                self._db = None
            self._db = self._open_db()
            self._broken = False
            self._reopened = True

    def _write(self, what: str, fn: Callable[[Any], None]) -> None:
        """Every write to LevelDB goes through here, one at a time (see _try_reopen).

        The caller holds ``self._rw`` for reading.
        """
        with self._wlock:
            if self._broken or self._db is None:
                raise StorageError(f"{what}: the queue had a write error and is waiting "
                                   "to be reopened")
            try:
                fn(self._db)
            except (plyvel.Error, RuntimeError) as exc:
                self._broken = True
                raise StorageError(f"{what} failed: {exc}") from exc

    def _open_handle(self) -> Any:
        if self._db is None:
            raise StorageError("the queue is not open")
        return self._db

    def _ensure_open(self) -> None:
        if self._closed:
            raise StorageError("the store is closed")
        if self._db is None:
            self._try_reopen()

    @contextlib.contextmanager
    def _snapshot(self) -> Iterator[Loader]:
        self._ensure_open()
        with self._rw.reading():
            if self._db is None:
                raise StorageError("the queue is not open")
            try:
                snap = self._db.snapshot()
            except (plyvel.Error, RuntimeError) as exc:
                raise StorageError(f"reading the queue failed: {exc}") from exc
            try:
                yield Loader(SnapReader(snap))
            except (plyvel.Error, RuntimeError) as exc:
                raise StorageError(f"reading the queue failed: {exc}") from exc
            finally:
                with contextlib.suppress(plyvel.Error, RuntimeError):
                    snap.close()

    def _sync_logs(self) -> None:
        """Sync every LevelDB log file: the content written since the last sync."""
        logs = [str(p) for p in self.dir.glob("*.log")]
        try:
            fsync_paths(logs)
        except FileNotFoundError:
            # A log was retired while we synced: its data is in a table that
            # LevelDB synced before deleting it.  Sync the ones left.
            fsync_paths(str(p) for p in self.dir.glob("*.log") if p.exists())

    # -- the committer ------------------------------------------------------------------

    def _commit(self, batch: list[Op]) -> None:
        if any(isinstance(op.extra, Submit) for op in batch) and not all(
                isinstance(op.extra, Submit) for op in batch):
            # The other changes first (module doc): nothing in a batch
            # depends on a submission of the same batch, whose queue id its
            # caller learns only after the commit.
            self._commit([op for op in batch if not isinstance(op.extra, Submit)])
            batch = [op for op in batch if isinstance(op.extra, Submit)]
        if self._broken or self._db is None:
            try:
                self._try_reopen()
            except StorageError as exc:
                self._fail(batch, exc)
                return
        submits = [op for op in batch if isinstance(op.extra, Submit)]
        if submits:
            try:
                self._sync_logs()
            except OSError as exc:
                self._fail(submits, StorageError(f"making the content durable failed: {exc}"))
                batch = [op for op in batch if not isinstance(op.extra, Submit)]
        if self._reopened:
            # Content written before an error may have been in the dropped tail.
            self._reopened = False
            lost = [op for op in batch
                    if isinstance(op.extra, Submit) and not self._content_intact(op.extra)]
            self._fail(lost, StorageError("the content was lost with a failed write; try again"))
            batch = [op for op in batch if op not in lost]
        if not batch:
            return
        results: list[tuple[Op, Any, BaseException | None]] = []
        write_error: StorageError | None = None
        # Op.soon: answered before the sync, but the batch is synced now.
        durable = any(op.soon or _needs_sync(op) for op in batch)
        with self._rw.reading():
            view = Batch(self._db)
            for op in batch:
                mark = view.mark()
                try:
                    value = op.work(view)
                except plyvel.Error as exc:
                    view.rollback(mark)
                    results.append((op, None, StorageError(f"reading the queue failed: {exc}")))
                except Exception as exc:
                    view.rollback(mark)
                    results.append((op, None, exc))
                else:
                    results.append((op, value, None))

            def write(db: Any) -> None:
                stats = {name: delta for name, delta in view.stats.items() if delta}
                current = self._read_stats(db) if stats else {}
                with db.write_batch() as wb:  # synced below, every log (module doc)
                    for key, value in view.pending.items():
                        if value is None:
                            wb.delete(key)
                        else:
                            wb.put(key, value)
                    for name, delta in stats.items():
                        wb.put(stat_key(name), str(current.get(name, 0) + delta).encode())

            try:
                self._write("writing the queue", write)
            except StorageError as exc:
                write_error = exc
        if write_error is None:
            # Those that need no sync hear of the commit now (module doc).
            for op, value, failure in results:
                if failure is None and not _needs_sync(op):
                    op.future.set_result(value)
            results = [r for r in results if not r[0].future.done()]
            if durable:
                try:
                    self._sync_logs()
                except OSError as exc:
                    # Written but maybe not on disk: the callers get an error
                    # (a client sends again: a duplicate, never a loss), and
                    # the database is reopened before the next write.
                    with self._wlock:
                        self._broken = True
                    write_error = StorageError(f"syncing the queue's log failed: {exc}")
        for op, value, failure in results:
            if write_error is not None and failure is None:
                failure = write_error
            if isinstance(op.extra, Submit):
                if failure is None:
                    with self._inflight_lock:
                        self._inflight.discard(op.extra.spid)
                else:
                    self._drop_content(op.extra)
            if failure is None:
                op.future.set_result(value)
            else:
                op.future.set_exception(failure)

    def _fail(self, batch: list[Op], err: StorageError) -> None:
        for op in batch:
            if isinstance(op.extra, Submit):
                self._drop_content(op.extra)
            if not op.future.done():
                op.future.set_exception(err)

    def _content_intact(self, sub: Submit) -> bool:
        with self._rw.reading():
            try:
                return self._db is not None and all(
                    self._db.get(chunk_key(sub.spid, n)) is not None
                    for n in range(1, sub.chunks + 1))
            except plyvel.Error:
                return False

    def _drop_content(self, sub: Submit) -> None:
        """Best effort: remove the chunks of a submission that was not committed."""
        with self._inflight_lock:
            self._inflight.discard(sub.spid)

        def drop(db: Any) -> None:
            with db.write_batch() as wb:
                for n in range(1, sub.chunks + 1):
                    wb.delete(chunk_key(sub.spid, n))
                wb.delete(PENDING_PREFIX + b(sub.spid))

        with contextlib.suppress(StorageError), self._rw.reading():
            self._write("removing content", drop)  # else recover() sweeps it

    @staticmethod
    def _read_stats(db: Any) -> dict[str, int]:
        out = {}
        for name in STAT_NAMES:
            raw = db.get(stat_key(name))
            out[name] = int(raw) if raw else 0
        return out

    def _op(self, work: Callable[[Batch], Any], extra: Any = None, *, durable: bool = True,
            soon: bool = False) -> concurrent.futures.Future[Any]:
        if self._closed:
            raise StorageError("the store is closed")
        return self._committer.submit(work, extra=extra, durable=durable, soon=soon)

    def _call(self, work: Callable[[Batch], Any], *, durable: bool = True) -> Any:
        return self._op(work, durable=durable).result()

    # -- submission ---------------------------------------------------------------------

    def _put(self, key: bytes, value: bytes) -> None:
        # The lock is held per write, not per message: a slow client must
        # not keep the committer from reopening the database.
        with self._rw.reading():
            self._write("writing the content", lambda db: db.put(key, value))

    def _write_content(self, content: Content, wanted: str = "") -> Submit:
        """Stream content into 64 KB chunk keys under ``wanted`` if free, else a fresh SPID."""
        self._ensure_open()
        for spid in spid_candidates(wanted):
            with self._inflight_lock:
                if spid in self._inflight:
                    continue
            try:
                with self._rw.reading():
                    db = self._db
                    if db is None:
                        raise StorageError("the queue is not open")
                    taken = (db.get(exists_key(spid)) is not None
                             or db.get(PENDING_PREFIX + b(spid)) is not None)
            except (plyvel.Error, RuntimeError) as exc:
                raise StorageError(f"reading the queue failed: {exc}") from exc
            if not taken:
                break
        else:  # pragma: no cover - 100 collisions in a row means a broken clock
            raise RuntimeError("could not allocate a unique SPID")
        with self._inflight_lock:
            self._inflight.add(spid)
        sub = Submit(spid, 0)
        try:
            self._put(PENDING_PREFIX + b(spid), b"")
            buf = bytearray()
            for piece in iter_chunks(content, CHUNK_SIZE):
                buf += piece
                while len(buf) >= CHUNK_SIZE:
                    sub.chunks += 1
                    sub.size += CHUNK_SIZE
                    self._put(chunk_key(spid, sub.chunks), bytes(buf[:CHUNK_SIZE]))
                    del buf[:CHUNK_SIZE]
            if buf:
                sub.chunks += 1
                sub.size += len(buf)
                self._put(chunk_key(spid, sub.chunks), bytes(buf))
        except StorageError:
            self._drop_content(sub)
            self._kick()
            raise
        except BaseException:
            self._drop_content(sub)
            raise
        return sub

    def _kick(self) -> None:
        """Have the committer reopen the database soon, even if no write follows."""
        with contextlib.suppress(StorageError):
            self._committer.submit(lambda view: None)

