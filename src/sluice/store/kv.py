"""ZoneMTA's LevelDB layout as a meta queue and spool in one: the ``kv`` flavour.

SUMMARY
    KvStore(path, node_id=..., max_batch=...) implements sluice.store.Store
    on LevelDB (plyvel).  ``queue.path`` is the LevelDB directory.

DESCRIPTION
    Keys are ZoneMTA's (seeds/002), with the message id being the SPID:

    message <SPID> 000001 ...    the content in 64 KB chunks, in arrival
                                 order, numbered from 1.
    message <SPID> #             the message exists; its creation time.
    message <SPID> *             JSON metadata: envelope sender, the
                                 recipients in envelope order, tenantid,
                                 jobid, transportid, localip, size, number
                                 of chunks, arrival time, report flag,
                                 SMTPUTF8 flag (absent in older metadata:
                                 false).
    delivery-zone <ZONE> <SPID> <RCPT>
                                 one per recipient, JSON: envelope index,
                                 state, next attempt, attempts, last reply,
                                 priority.  Iterating ``delivery-zone <ZONE> ``
                                 walks a zone's recipients from the oldest
                                 message (SPIDs sort by arrival).

    The zone.  In ZoneMTA a sending zone is a named pool of outbound
    addresses chosen per message; Sluice's equivalent is the ``transportid``
    (Halon's choice of transport and source IPs), so the zone is the
    transportid, or ``default`` when there is none.  Selections by
    transport iterate the zone.  (A second copy of the same address in one
    envelope gets `` #<index>`` after it, so that keys stay unique.)

    ZoneMTA iterates zones and skips what is not due; Sluice's refill needs
    new mail apart from deferred mail, due times and priorities, so the
    extra keys below (all under ``sluice ``, all written in the same atomic
    batch as the recipient keys they describe) index the states:

    sluice rcpt <SPID> <IDX6>            -> the delivery-zone key (listing in
                                            queue-id order, get, apply)
    sluice queue incoming <P> <SPID> <IDX6>           refill, FIFO
    sluice queue deferred <P> <DUE> <SPID> <IDX6>     refill by due time
    sluice queue hold|active|delivering|bounce <SPID> <IDX6>
    sluice stat <state>|messages         counts for qcount
    sluice change <SEQ12>                operator change feed (JSON)
    sluice pending <SPID>                content being written, not yet
                                         committed (removed by the commit;
                                         leftovers are swept by recover)

    <P> is 0 for priority 1 and 1 for priority 0, so that urgent mail comes
    first; <DUE> is the next attempt time as %017.6f seconds, so that keys
    sort by it; the index keys' values are the delivery-zone key.

STRATEGIES
    Content first, then meta, one synchronous batch.  A submitter streams
    its content into chunk keys as it arrives (plain writes, not synced)
    and then hands the meta keys to the committer thread.  The committer
    takes every operation that queued up, makes the content of the batch
    durable by fsyncing LevelDB's log files (one fsync round for the whole
    batch: a synchronous write only syncs the current log, and chunks may
    sit in the previous one if LevelDB switched logs meanwhile), and then
    writes all the batch's meta keys, index keys and counters in one
    WriteBatch with sync=True.  ZoneMTA lost data on recovery with unsynced
    writes; here a message is visible only through keys of a synced atomic
    batch whose content was already on disk.

    Read-your-writes inside a batch: operations of one batch see each
    other's changes through an overlay of pending keys merged into every
    lookup and iteration, so two claims in one batch never take the same
    recipient; an operation that fails is rolled back in the overlay.

    Deletion (ZoneMTA): when the last recipient of a message goes, all of
    its keys go in the same batch -- chunks, ``#``, ``*``.

    Errors.  LevelDB refuses writes after some I/O errors, and a failed
    write may leave a torn record in its log; so after any write error the
    database is closed and reopened (which replays the log) before the
    next write, and a batch that follows a reopen checks that the content
    of its submissions survived it.  A full disk is a StorageError (451)
    until space is freed.

    Readers use LevelDB snapshots: a listing page, a count or a content
    stream sees one consistent state while the committer writes.

INVARIANTS
    Every recipient key has exactly one state index key and one rcpt key.
    The ``sluice stat`` counters equal the index keys per state.  A message
    has its ``#``/``*`` keys and its chunks as long as a recipient key
    exists.

LIMITATIONS
    LevelDB locks its directory: one process only (``shared_access`` is
    False), so ``sluice qlist`` cannot open the queue while ``sluice serve``
    runs on it (use the API).  Selections by sender, tenant or job scan
    every recipient.

SEE ALSO
    sluice.store (the interface), seeds/002 (ZoneMTA), docs/storage.md.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import contextlib
import io
import json
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol
from urllib.parse import quote

from sluice.store import StorageError

try:
    import plyvel
except ImportError as exc:  # an optional extra: say which
    raise StorageError("the kv store needs plyvel: pip install 'sluice-mta[kv]'") from exc

from sluice.model import (
    IN_FLIGHT_STATES,
    Accepted,
    QueueEntry,
    QueueState,
    Reply,
    Selector,
    Submission,
    format_qid,
    parse_qid,
    recipient_domain,
)
from sluice.spool import Content, iter_chunks, spid_candidates
from sluice.store import ACTION_STATES, Action, Change, Counts, StorageError, Transition
from sluice.store._commit import GroupCommitter, Op, RWLock, fsync_paths
from sluice.store._refill import interleave, split_quota

if TYPE_CHECKING:
    from sluice.config import Config

__all__ = ["CHUNK_SIZE", "KvStore"]

#: ZoneMTA's body chunk size.
CHUNK_SIZE = 65536

#: Operator changes are kept this long in the change feed.
CHANGES_KEEP_S = 3600.0

#: Room needed on the disk, besides the size of LevelDB's logs, before the
#: database is reopened after a write error.
REOPEN_MARGIN = 1 << 20

#: Selections by state use the state index keys when the selected states
#: hold at most this many recipients; otherwise one scan of the rcpt keys
#: costs less than sorting that many index keys.
INDEX_SELECT_MAX = 50_000

_STAT_NAMES = (*(str(s) for s in QueueState), "messages")
_TOP = b"\xff"


# --------------------------------------------------------------------------
# Keys


def _b(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


def _zone(transportid: str) -> str:
    # Zone names are one key component: no spaces.
    return quote(transportid, safe="@.-_:+=,") if transportid else "default"


def _rcpt_keys(rcpts: Sequence[str]) -> list[str]:
    """The recipient part of each delivery-zone key; repeats get ' #<idx>'."""
    seen: set[str] = set()
    out = []
    for i, rcpt in enumerate(rcpts):
        out.append(rcpt if rcpt not in seen else f"{rcpt} #{i}")
        seen.add(rcpt)
    return out


def _dz_key(zone: str, spid: str, rcpt_key: str) -> bytes:
    return _b(f"delivery-zone {zone} {spid} {rcpt_key}")


def _chunk_key(spid: str, n: int) -> bytes:
    return _b(f"message {spid} {n:06d}")


def _exists_key(spid: str) -> bytes:
    return _b(f"message {spid} #")


def _meta_key(spid: str) -> bytes:
    return _b(f"message {spid} *")


def _rcpt_index(spid: str, idx: int) -> bytes:
    return _b(f"sluice rcpt {spid} {idx:06d}")


_RCPT_PREFIX = b"sluice rcpt "
_PENDING_PREFIX = b"sluice pending "
_CHANGE_PREFIX = b"sluice change "


def _due(at: float) -> str:
    return f"{min(max(at, 0.0), 9999999999.999999):017.6f}"


def _state_prefix(state: QueueState, priority: int | None = None) -> bytes:
    if state in (QueueState.INCOMING, QueueState.DEFERRED) and priority is not None:
        return _b(f"sluice queue {state} {1 - priority} ")
    return _b(f"sluice queue {state} ")


def _state_key(spid: str, idx: int, rec: dict[str, Any]) -> bytes:
    state = rec["s"]
    if state == "incoming":
        return _b(f"sluice queue incoming {1 - rec['p']} {spid} {idx:06d}")
    if state == "deferred":
        return _b(f"sluice queue deferred {1 - rec['p']} {_due(rec['n'])} {spid} {idx:06d}")
    return _b(f"sluice queue {state} {spid} {idx:06d}")


def _stat_key(name: str) -> bytes:
    return _b(f"sluice stat {name}")


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def _spid_of_rcpt_index(key: bytes) -> tuple[str, int]:
    _, _, spid, idx = key.decode().split(" ")
    return spid, int(idx)


# --------------------------------------------------------------------------
# Reading through a snapshot or through the committer's overlay


class _Reader(Protocol):
    def get(self, key: bytes) -> bytes | None: ...

    def items(self, prefix: bytes, start: bytes | None = None, stop: bytes | None = None
              ) -> Iterator[tuple[bytes, bytes]]: ...


class _SnapReader:
    """Reads from one LevelDB snapshot: a consistent state."""

    def __init__(self, snap: Any) -> None:
        self.snap = snap

    def get(self, key: bytes) -> bytes | None:
        value: bytes | None = self.snap.get(key)
        return value

    def items(self, prefix: bytes, start: bytes | None = None, stop: bytes | None = None
              ) -> Iterator[tuple[bytes, bytes]]:
        it = self.snap.iterator(start=start or prefix, stop=stop or prefix + _TOP)
        try:
            yield from it
        finally:
            it.close()


class _View:
    """The committer's view: the database plus the batch's pending changes."""

    def __init__(self, db: Any) -> None:
        self.db = db
        self.pending: dict[bytes, bytes | None] = {}
        self._keys: list[bytes] = []  # the pending keys, sorted, for range lookups
        self.stats: dict[str, int] = {}
        self._undo: list[tuple[bytes, bool, bytes | None]] = []
        self._stats_undo: list[tuple[str, int]] = []

    def mark(self) -> tuple[int, int]:
        return len(self._undo), len(self._stats_undo)

    def rollback(self, mark: tuple[int, int]) -> None:
        while len(self._undo) > mark[0]:
            key, had, old = self._undo.pop()
            if had:
                self.pending[key] = old
            else:
                self.pending.pop(key, None)
                i = bisect.bisect_left(self._keys, key)
                if i < len(self._keys) and self._keys[i] == key:
                    del self._keys[i]
        while len(self._stats_undo) > mark[1]:
            name, delta = self._stats_undo.pop()
            self.stats[name] -= delta

    def get(self, key: bytes) -> bytes | None:
        if key in self.pending:
            return self.pending[key]
        value: bytes | None = self.db.get(key)
        return value

    def _set(self, key: bytes, value: bytes | None) -> None:
        had = key in self.pending
        self._undo.append((key, had, self.pending.get(key)))
        self.pending[key] = value
        if not had:
            bisect.insort(self._keys, key)

    def put(self, key: bytes, value: bytes) -> None:
        self._set(key, value)

    def delete(self, key: bytes) -> None:
        self._set(key, None)

    def count(self, name: str, delta: int) -> None:
        self.stats[name] = self.stats.get(name, 0) + delta
        self._stats_undo.append((name, delta))

    def items(self, prefix: bytes, start: bytes | None = None, stop: bytes | None = None
              ) -> Iterator[tuple[bytes, bytes]]:
        lo = start or prefix
        hi = stop or prefix + _TOP
        extra = self._keys[bisect.bisect_left(self._keys, lo):bisect.bisect_left(self._keys, hi)]
        it = self.db.iterator(start=lo, stop=hi)
        try:
            i = 0
            for key, value in it:
                while i < len(extra) and extra[i] < key:
                    k = extra[i]
                    i += 1
                    v = self.pending.get(k)
                    if v is not None:
                        yield k, v
                if i < len(extra) and extra[i] == key:
                    i += 1
                if key in self.pending:
                    v = self.pending[key]
                    if v is None:
                        continue
                    yield key, v
                else:
                    yield key, value
            while i < len(extra):
                k = extra[i]
                i += 1
                v = self.pending.get(k)
                if v is not None:
                    yield k, v
        finally:
            it.close()


# --------------------------------------------------------------------------
# Records


def _entry(spid: str, meta: dict[str, Any], rec: dict[str, Any]) -> QueueEntry:
    idx = int(rec["i"])
    reply = rec.get("r")
    rcpt = meta["rcpts"][idx]
    return QueueEntry(
        spid=spid,
        idx=idx,
        sender=meta["sender"],
        recipient=rcpt,
        state=QueueState(rec["s"]),
        arrival_at=meta["arrival_at"],
        next_attempt_at=rec["n"],
        attempts=rec["a"],
        last_reply=None if reply is None else Reply.from_record(reply),
        priority=rec["p"],
        tenantid=meta["tenantid"],
        jobid=meta["jobid"],
        transportid=meta["transportid"],
        localip=tuple(meta["localip"]),
        is_report=meta["is_report"],
        size=meta["size"],
        domain=recipient_domain(rcpt),
        # Absent from metadata written before Sluice kept the flag.
        smtputf8=meta.get("smtputf8", False),
    )


@dataclass(slots=True)
class _Loader:
    """Loads recipients and their messages' metadata, caching the metadata."""

    reader: _Reader
    metas: dict[str, dict[str, Any] | None] = field(default_factory=dict)

    def meta(self, spid: str) -> dict[str, Any] | None:
        if spid not in self.metas:
            raw = self.reader.get(_meta_key(spid))
            self.metas[spid] = None if raw is None else json.loads(raw)
        return self.metas[spid]

    def record(self, dz: bytes) -> dict[str, Any] | None:
        raw = self.reader.get(dz)
        return None if raw is None else json.loads(raw)

    def by_qid(self, spid: str, idx: int) -> tuple[bytes, dict[str, Any]] | None:
        dz = self.reader.get(_rcpt_index(spid, idx))
        if dz is None:
            return None
        rec = self.record(dz)
        return None if rec is None else (dz, rec)

    def entry(self, spid: str, rec: dict[str, Any]) -> QueueEntry | None:
        meta = self.meta(spid)
        return None if meta is None else _entry(spid, meta, rec)


@dataclass(slots=True)
class _Submit:
    """What the committer needs to know about a submission's content."""

    spid: str
    chunks: int
    size: int = 0


class _ChunkReader(io.RawIOBase):
    """A message's content, chunk by chunk, from one snapshot."""

    def __init__(self, store: KvStore, spid: str, snap: Any, chunks: int) -> None:
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
                    data = self._snap.get(_chunk_key(self._spid, self._next))
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


# --------------------------------------------------------------------------
# The store


class KvStore:
    """Meta queue and content in LevelDB, ZoneMTA's layout; see the module doc."""

    flavour = "kv"
    shared_access = False
    inline_max = 0  # content always goes to body chunks, whatever its size

    def __init__(self, path: str | os.PathLike[str], *, node_id: str = "local",
                 max_batch: int = 2000) -> None:
        self.dir = Path(path)
        self.node_id = node_id
        self._rw = RWLock()
        self._wlock = threading.Lock()
        self._broken = False
        self._reopened = False
        self._inflight: set[str] = set()
        self._inflight_lock = threading.Lock()
        self._closed = False
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"cannot create the queue directory {self.dir}: {exc}") from exc
        self._db: Any | None = self._open_db()
        try:
            last = next(self._open_handle().iterator(prefix=_CHANGE_PREFIX, reverse=True,
                                          include_value=False), None)
        except plyvel.Error as exc:
            raise StorageError(f"cannot read the queue at {self.dir}: {exc}") from exc
        self._seq = int(last.rsplit(b" ", 1)[1]) if last else 0
        self._committer = GroupCommitter(
            self._commit, max_batch=max_batch, name="sluice-kv-commit",
            dropped=lambda op: self._drop_content(op.extra)
            if isinstance(op.extra, _Submit) else None)

    @classmethod
    def from_config(cls, config: Config) -> KvStore:
        q = config.queue
        return cls(q.path, node_id=config.node.id, max_batch=q.commit_max_batch)

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
    def _snapshot(self) -> Iterator[_Loader]:
        self._ensure_open()
        with self._rw.reading():
            if self._db is None:
                raise StorageError("the queue is not open")
            try:
                snap = self._db.snapshot()
            except (plyvel.Error, RuntimeError) as exc:
                raise StorageError(f"reading the queue failed: {exc}") from exc
            try:
                yield _Loader(_SnapReader(snap))
            except (plyvel.Error, RuntimeError) as exc:
                raise StorageError(f"reading the queue failed: {exc}") from exc
            finally:
                with contextlib.suppress(plyvel.Error, RuntimeError):
                    snap.close()

    def _sync_logs(self) -> None:
        """fsync every LevelDB log file: the content written since the last sync."""
        logs = [str(p) for p in self.dir.glob("*.log")]
        try:
            fsync_paths(logs)
        except FileNotFoundError:
            # A log was retired while we synced: its data is in a table that
            # LevelDB synced before deleting it.  Sync the ones left.
            fsync_paths(str(p) for p in self.dir.glob("*.log") if p.exists())

    # -- the committer ------------------------------------------------------------------

    def _commit(self, batch: list[Op]) -> None:
        if self._broken or self._db is None:
            try:
                self._try_reopen()
            except StorageError as exc:
                self._fail(batch, exc)
                return
        submits = [op for op in batch if isinstance(op.extra, _Submit)]
        if submits:
            try:
                self._sync_logs()
            except OSError as exc:
                self._fail(submits, StorageError(f"making the content durable failed: {exc}"))
                batch = [op for op in batch if not isinstance(op.extra, _Submit)]
        if self._reopened:
            # Content written before an error may have been in the dropped tail.
            self._reopened = False
            lost = [op for op in batch
                    if isinstance(op.extra, _Submit) and not self._content_intact(op.extra)]
            self._fail(lost, StorageError("the content was lost with a failed write; try again"))
            batch = [op for op in batch if op not in lost]
        if not batch:
            return
        results: list[tuple[Op, Any, BaseException | None]] = []
        write_error: StorageError | None = None
        with self._rw.reading():
            view = _View(self._db)
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
                with db.write_batch(sync=True) as wb:
                    for key, value in view.pending.items():
                        if value is None:
                            wb.delete(key)
                        else:
                            wb.put(key, value)
                    for name, delta in stats.items():
                        wb.put(_stat_key(name), str(current.get(name, 0) + delta).encode())

            try:
                self._write("writing the queue", write)
            except StorageError as exc:
                write_error = exc
        for op, value, failure in results:
            if write_error is not None and failure is None:
                failure = write_error
            if isinstance(op.extra, _Submit):
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
            if isinstance(op.extra, _Submit):
                self._drop_content(op.extra)
            if not op.future.done():
                op.future.set_exception(err)

    def _content_intact(self, sub: _Submit) -> bool:
        with self._rw.reading():
            try:
                return self._db is not None and all(
                    self._db.get(_chunk_key(sub.spid, n)) is not None
                    for n in range(1, sub.chunks + 1))
            except plyvel.Error:
                return False

    def _drop_content(self, sub: _Submit) -> None:
        """Best effort: remove the chunks of a submission that was not committed."""
        with self._inflight_lock:
            self._inflight.discard(sub.spid)

        def drop(db: Any) -> None:
            with db.write_batch() as wb:
                for n in range(1, sub.chunks + 1):
                    wb.delete(_chunk_key(sub.spid, n))
                wb.delete(_PENDING_PREFIX + _b(sub.spid))

        with contextlib.suppress(StorageError), self._rw.reading():
            self._write("removing content", drop)  # else recover() sweeps it

    @staticmethod
    def _read_stats(db: Any) -> dict[str, int]:
        out = {}
        for name in _STAT_NAMES:
            raw = db.get(_stat_key(name))
            out[name] = int(raw) if raw else 0
        return out

    def _op(self, work: Callable[[_View], Any], extra: Any = None
            ) -> concurrent.futures.Future[Any]:
        if self._closed:
            raise StorageError("the store is closed")
        return self._committer.submit(work, extra=extra)

    def _call(self, work: Callable[[_View], Any]) -> Any:
        return self._op(work).result()

    # -- submission ---------------------------------------------------------------------

    def _put(self, key: bytes, value: bytes) -> None:
        # The lock is held per write, not per message: a slow client must
        # not keep the committer from reopening the database.
        with self._rw.reading():
            self._write("writing the content", lambda db: db.put(key, value))

    def _write_content(self, content: Content, wanted: str = "") -> _Submit:
        """Stream content into 64 KB chunk keys under ``wanted`` if it is
        free, else under a fresh SPID."""
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
                    taken = (db.get(_exists_key(spid)) is not None
                             or db.get(_PENDING_PREFIX + _b(spid)) is not None)
            except (plyvel.Error, RuntimeError) as exc:
                raise StorageError(f"reading the queue failed: {exc}") from exc
            if not taken:
                break
        else:  # pragma: no cover - 100 collisions in a row means a broken clock
            raise RuntimeError("could not allocate a unique SPID")
        with self._inflight_lock:
            self._inflight.add(spid)
        sub = _Submit(spid, 0)
        try:
            self._put(_PENDING_PREFIX + _b(spid), b"")
            buf = bytearray()
            for piece in iter_chunks(content, CHUNK_SIZE):
                buf += piece
                while len(buf) >= CHUNK_SIZE:
                    sub.chunks += 1
                    sub.size += CHUNK_SIZE
                    self._put(_chunk_key(spid, sub.chunks), bytes(buf[:CHUNK_SIZE]))
                    del buf[:CHUNK_SIZE]
            if buf:
                sub.chunks += 1
                sub.size += len(buf)
                self._put(_chunk_key(spid, sub.chunks), bytes(buf))
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

    def submit_future(self, submission: Submission, content: Content, now: float
                      ) -> concurrent.futures.Future[Accepted]:
        if self._closed:
            raise StorageError("the store is closed")
        sub = self._write_content(content, submission.spid)
        spid = sub.spid
        state, next_at = submission.initial_state(now)
        rcpts = list(submission.recipients)
        zone = _zone(submission.transportid)
        keys = _rcpt_keys(rcpts)
        size = sub.size
        meta = {
            "sender": submission.sender, "rcpts": rcpts, "zone": zone,
            "tenantid": submission.tenantid, "jobid": submission.jobid,
            "transportid": submission.transportid, "localip": list(submission.localip),
            "is_report": submission.is_report, "size": size, "chunks": sub.chunks,
            "arrival_at": now, "smtputf8": submission.smtputf8,
        }
        accepted = Accepted(spid=spid, qids=tuple(format_qid(spid, i) for i in range(len(rcpts))),
                            size=size)

        def work(view: _View) -> Accepted:
            view.put(_exists_key(spid), repr(now).encode())
            view.put(_meta_key(spid), _dumps(meta))
            for i, key in enumerate(keys):
                dz = _dz_key(zone, spid, key)
                rec = {"i": i, "s": str(state), "n": next_at, "a": 0, "r": None,
                       "p": submission.priority}
                view.put(dz, _dumps(rec))
                view.put(_rcpt_index(spid, i), dz)
                view.put(_state_key(spid, i, rec), dz)
            view.count(str(state), len(keys))
            view.count("messages", 1)
            view.delete(_PENDING_PREFIX + _b(spid))
            return accepted

        try:
            return self._op(work, extra=sub)
        except BaseException:
            self._drop_content(sub)
            raise

    def submit(self, submission: Submission, content: Content, now: float) -> Accepted:
        result: Accepted = self.submit_future(submission, content, now).result()
        return result

    # -- the queue manager's side -------------------------------------------------------

    def _claimable(self, reader: _Reader, now: float) -> bool:
        if next(reader.items(_state_prefix(QueueState.INCOMING)), None) is not None:
            return True
        for prio in (1, 0):
            prefix = _state_prefix(QueueState.DEFERRED, prio)
            if next(reader.items(prefix, stop=prefix + _b(_due(now)) + b"~"), None):
                return True
        return False

    def claim(self, limit: int, now: float, quota_deferred: int) -> list[QueueEntry]:
        if limit <= 0:
            return []
        # A queue manager polls often; answer "nothing" from a snapshot.
        with self._snapshot() as loader:
            if not self._claimable(loader.reader, now):
                return []

        def work(view: _View) -> list[QueueEntry]:
            loader = _Loader(view)
            incoming: list[tuple[bytes, bytes, dict[str, Any]]] = []
            for prio in (1, 0):
                for key, dz in view.items(_state_prefix(QueueState.INCOMING, prio)):
                    if len(incoming) >= limit:
                        break
                    rec = loader.record(dz)
                    if rec is not None:
                        incoming.append((key, dz, rec))
            deferred: list[tuple[bytes, bytes, dict[str, Any]]] = []
            for prio in (1, 0):
                prefix = _state_prefix(QueueState.DEFERRED, prio)
                for key, dz in view.items(prefix, stop=prefix + _b(_due(now)) + b"~"):
                    if len(deferred) >= limit:
                        break
                    rec = loader.record(dz)
                    if rec is not None and rec["n"] <= now:
                        deferred.append((key, dz, rec))
            take_d, take_i = split_quota(limit, len(incoming), len(deferred), quota_deferred)
            out = []
            for key, dz, rec in interleave(incoming[:take_i], deferred[:take_d]):
                spid = key.decode().rsplit(" ", 2)[1]
                view.delete(key)
                view.count(rec["s"], -1)
                rec["s"] = "active"
                view.count("active", 1)
                view.put(dz, _dumps(rec))
                view.put(_state_key(spid, rec["i"], rec), dz)
                entry = loader.entry(spid, rec)
                if entry is not None:
                    out.append(entry)
            return out

        result: list[QueueEntry] = self._call(work)
        return result

    def _change_state(self, view: _View, spid: str, dz: bytes, rec: dict[str, Any],
                      new: dict[str, Any] | None, gone: set[str]) -> None:
        """Replace one recipient's record (None: it leaves the queue)."""
        idx = rec["i"]
        view.delete(_state_key(spid, idx, rec))
        view.count(rec["s"], -1)
        if new is None:
            view.delete(dz)
            view.delete(_rcpt_index(spid, idx))
            gone.add(spid)
            return
        view.put(dz, _dumps(new))
        view.put(_state_key(spid, idx, new), dz)
        view.count(new["s"], 1)

    def _collect_gone(self, view: _View, spids: Iterable[str]) -> None:
        """Remove every key of the messages that have no recipient left."""
        for spid in spids:
            if next(view.items(_RCPT_PREFIX + _b(spid) + b" "), None) is not None:
                continue
            raw = view.get(_meta_key(spid))
            chunks = json.loads(raw)["chunks"] if raw else 0
            for n in range(1, chunks + 1):
                view.delete(_chunk_key(spid, n))
            view.delete(_exists_key(spid))
            view.delete(_meta_key(spid))
            view.count("messages", -1)

    def apply(self, transitions: Sequence[Transition], *, wait: bool = True,
              durable: bool = True) -> set[str]:
        if not transitions:
            return set()
        items = []
        for t in transitions:
            spid, idx = parse_qid(t.qid)
            if idx is None:
                raise ValueError(f"a transition needs a full queue id, not {t.qid!r}")
            items.append((spid, idx, t))

        def work(view: _View) -> set[str]:
            loader = _Loader(view)
            applied: set[str] = set()
            gone: set[str] = set()
            for spid, idx, t in items:
                found = loader.by_qid(spid, idx)
                if found is None:
                    continue
                dz, rec = found
                if t.expect and QueueState(rec["s"]) not in t.expect:
                    continue
                new: dict[str, Any] | None = None
                if t.state is not None:
                    new = dict(rec)
                    new["s"] = str(t.state)
                    if t.next_attempt_at is not None:
                        new["n"] = t.next_attempt_at
                    if t.reply is not None:
                        new["r"] = t.reply.to_record()
                    if t.attempted:
                        new["a"] = rec["a"] + 1
                self._change_state(view, spid, dz, rec, new, gone)
                applied.add(t.qid)
            self._collect_gone(view, gone)
            return applied

        fut = self._op(work)
        if not wait:
            return set()
        result: set[str] = fut.result()
        return result

    def claim_bounces(self, limit: int, now: float, lease_s: float) -> list[QueueEntry]:
        if limit <= 0:
            return []
        until = now + lease_s

        def work(view: _View) -> list[QueueEntry]:
            loader = _Loader(view)
            out: list[QueueEntry] = []
            for key, dz in list(view.items(_state_prefix(QueueState.BOUNCE))):
                if len(out) >= limit:
                    break
                rec = loader.record(dz)
                if rec is None or rec["n"] > now:
                    continue
                spid = key.decode().split(" ")[3]
                new = dict(rec, n=until)
                self._change_state(view, spid, dz, rec, new, set())
                entry = loader.entry(spid, new)
                if entry is not None:
                    out.append(entry)
            return out

        result: list[QueueEntry] = self._call(work)
        return result

    def recover(self, now: float) -> int:
        with self._inflight_lock:
            inflight = set(self._inflight)

        def work(view: _View) -> int:
            loader = _Loader(view)
            moved = 0
            for state in IN_FLIGHT_STATES:
                for key, dz in list(view.items(_state_prefix(state))):
                    rec = loader.record(dz)
                    if rec is None:
                        view.delete(key)
                        continue
                    spid = key.decode().split(" ")[3]
                    new = dict(rec, s="deferred", n=now)
                    self._change_state(view, spid, dz, rec, new, set())
                    moved += 1
            # Content whose submission never committed (a crash mid-stream).
            for key, _ in list(view.items(_PENDING_PREFIX)):
                spid = key[len(_PENDING_PREFIX):].decode()
                if spid in inflight:
                    continue
                if view.get(_exists_key(spid)) is None:
                    prefix = _b(f"message {spid} ")
                    for ckey, _ in list(view.items(prefix)):
                        view.delete(ckey)
                view.delete(key)
            # Old operator changes.
            for key, raw in list(view.items(_CHANGE_PREFIX)):
                if json.loads(raw)["at"] >= now - CHANGES_KEEP_S:
                    break
                view.delete(key)
            # Recount, as insurance against counters left wrong by an older version.
            counts = {name: 0 for name in _STAT_NAMES}
            for state in QueueState:
                counts[str(state)] = sum(1 for _ in view.items(_state_prefix(state)))
            last = None
            for key, _ in view.items(_RCPT_PREFIX):
                spid = key.decode().split(" ")[2]
                if spid != last:
                    counts["messages"] += 1
                    last = spid
            current = self._read_stats(view.db)
            for name in _STAT_NAMES:
                view.count(name, counts[name] - current.get(name, 0) - view.stats.get(name, 0))
            return moved

        result: int = self._call(work)
        return result

    def expired(self, cutoff_at: float, reports_cutoff_at: float, limit: int = 10000
                ) -> list[QueueEntry]:
        out: list[QueueEntry] = []
        with self._snapshot() as loader:
            for prio in (1, 0):
                for _, dz in loader.reader.items(_state_prefix(QueueState.DEFERRED, prio)):
                    rec = loader.record(dz)
                    if rec is None:
                        continue
                    spid = dz.decode().split(" ")[2]
                    entry = loader.entry(spid, rec)
                    if entry is None:
                        continue
                    cutoff = reports_cutoff_at if entry.is_report else cutoff_at
                    if entry.arrival_at <= cutoff:
                        out.append(entry)
                        if len(out) >= limit:
                            return out
        return out

    def due_at(self) -> float | None:
        best: float | None = None
        with self._snapshot() as loader:
            for prio in (1, 0):
                for _, dz in loader.reader.items(_state_prefix(QueueState.DEFERRED, prio)):
                    rec = loader.record(dz)
                    if rec is not None:
                        best = rec["n"] if best is None else min(best, rec["n"])
                        break
        return best

    # -- operator side ------------------------------------------------------------------

    def _candidates(self, loader: _Loader, selector: Selector,
                    states: Sequence[QueueState], counts: dict[str, int] | None = None,
                    after: tuple[str, int] | None = None
                    ) -> Iterator[tuple[bytes, dict[str, Any], QueueEntry]]:
        """Recipients matching ``selector`` in ``states``, in queue-id order."""
        reader = loader.reader
        wanted = set(states)

        def emit(spid: str, dz: bytes) -> Iterator[tuple[bytes, dict[str, Any], QueueEntry]]:
            rec = loader.record(dz)
            if rec is None or QueueState(rec["s"]) not in wanted:
                return
            entry = loader.entry(spid, rec)
            if entry is not None and selector.matches(entry):
                yield dz, rec, entry

        def after_cursor(spid: str, idx: int) -> bool:
            return after is None or (spid, idx) > after

        if selector.qids:
            keys: list[tuple[str, int]] = []
            for qid in selector.qids:
                spid, idx = parse_qid(qid)
                if idx is None:
                    for key, _ in reader.items(_RCPT_PREFIX + _b(spid) + b" "):
                        keys.append(_spid_of_rcpt_index(key))
                else:
                    keys.append((spid, idx))
            for spid, idx in sorted(set(keys)):
                dz = reader.get(_rcpt_index(spid, idx))
                if dz is not None and after_cursor(spid, idx):
                    yield from emit(spid, dz)
            return
        if len(wanted) < len(QueueState) and counts is not None and \
                sum(counts.get(str(s), 0) for s in wanted) <= INDEX_SELECT_MAX:
            found = []
            for state in wanted:
                for key, dz in reader.items(_state_prefix(state)):
                    parts = key.decode().split(" ")
                    spid, idx = parts[-2], int(parts[-1])
                    if after_cursor(spid, idx):
                        found.append((spid, idx, dz))
            for spid, _, dz in sorted(found):
                yield from emit(spid, dz)
            return
        if selector.transportid is not None:
            found2 = []
            for dz, raw in reader.items(_b(f"delivery-zone {_zone(selector.transportid)} ")):
                rec = json.loads(raw)
                spid = dz.decode().split(" ")[2]
                if after_cursor(spid, rec["i"]):
                    found2.append((spid, rec["i"], dz))
            for spid, _, dz in sorted(found2):
                yield from emit(spid, dz)
            return
        start = None
        if after is not None:
            start = _rcpt_index(after[0], after[1]) + b"\x00" if after[1] >= 0 else \
                _RCPT_PREFIX + _b(after[0]) + b" "
        for key, dz in reader.items(_RCPT_PREFIX, start=start):
            spid, _ = _spid_of_rcpt_index(key)
            yield from emit(spid, dz)

    def modify(self, selector: Selector, action: Action, now: float,
               priority: int | None = None, reply: Reply | None = None) -> list[QueueEntry]:
        if action is Action.PRIORITY and priority not in (0, 1):
            raise ValueError("priority must be 0 or 1")
        states = ACTION_STATES[action]
        if selector.states:
            states = tuple(s for s in states if s in selector.states)
        bounce = reply or Reply(550, "5.0.0", "bounced by the operator")

        def work(view: _View) -> list[QueueEntry]:
            loader = _Loader(view)
            counts = self._read_stats(view.db)
            for name, delta in view.stats.items():
                counts[name] = counts.get(name, 0) + delta
            found = list(self._candidates(loader, selector, states, counts))
            gone: set[str] = set()
            entries = []
            for dz, rec, entry in found:
                spid = entry.spid
                new: dict[str, Any] | None = dict(rec)
                assert new is not None
                if action is Action.HOLD:
                    new["s"] = "hold"
                elif action is Action.RELEASE:
                    new["s"] = "incoming" if rec["a"] == 0 else "deferred"
                    new["n"] = now
                elif action is Action.RETRY:
                    new["n"] = now
                elif action is Action.PRIORITY:
                    new["p"] = priority
                elif action is Action.BOUNCE:
                    new["s"] = "bounce"
                    new["n"] = now
                    new["r"] = bounce.to_record()
                elif action is Action.DELETE:
                    new = None
                self._change_state(view, spid, dz, rec, new, gone)
                self._seq += 1
                view.put(_CHANGE_PREFIX + _b(f"{self._seq:012d}"),
                         _dumps({"at": now, "qid": entry.qid, "action": str(action)}))
                entries.append(entry)
            self._collect_gone(view, gone)
            return entries

        seq_before = self._seq
        try:
            result: list[QueueEntry] = self._call(work)
        except BaseException:
            self._seq = max(self._seq, seq_before)
            raise
        return result

    def changes_since(self, seq: int) -> tuple[int, list[Change]]:
        out: list[Change] = []
        top = seq
        with self._snapshot() as loader:
            start = _CHANGE_PREFIX + _b(f"{seq + 1:012d}")
            for key, raw in loader.reader.items(_CHANGE_PREFIX, start=start):
                n = int(key.rsplit(b" ", 1)[1])
                item = json.loads(raw)
                out.append(Change(n, item["qid"], Action(item["action"])))
                top = max(top, n)
        return top, out

    # -- reading ------------------------------------------------------------------------

    def get(self, qid: str) -> QueueEntry | None:
        spid, idx = parse_qid(qid)
        if idx is None:
            raise ValueError(f"get() needs a full queue id, not a SPID: {qid!r}")
        with self._snapshot() as loader:
            found = loader.by_qid(spid, idx)
            return None if found is None else loader.entry(spid, found[1])

    def _stats(self, loader: _Loader) -> dict[str, int]:
        out = {}
        for name in _STAT_NAMES:
            raw = loader.reader.get(_stat_key(name))
            out[name] = int(raw) if raw else 0
        return out

    def entries(self, selector: Selector, *, after: str | None = None,
                limit: int | None = None) -> Iterator[QueueEntry]:
        states = selector.states or tuple(QueueState)
        cursor: tuple[str, int] | None = None
        if after is not None:
            spid, idx = parse_qid(after)
            cursor = (spid, -1 if idx is None else idx)
        remaining = limit
        page_size = 1000
        while remaining is None or remaining > 0:
            n = page_size if remaining is None else min(page_size, remaining)
            page: list[QueueEntry] = []
            with self._snapshot() as loader:
                counts = self._stats(loader)
                for _, _, entry in self._candidates(loader, selector, states, counts, cursor):
                    page.append(entry)
                    if len(page) >= n:
                        break
            yield from page
            if len(page) < n:
                return
            cursor = (page[-1].spid, page[-1].idx)
            if remaining is not None:
                remaining -= len(page)

    def count(self, selector: Selector | None = None) -> Counts:
        with self._snapshot() as loader:
            stats = self._stats(loader)
            if selector is None or selector.is_empty:
                return Counts(by_state={s: stats[str(s)] for s in QueueState},
                              messages=stats["messages"])
            by_state = {s: 0 for s in QueueState}
            spids: set[str] = set()
            states = selector.states or tuple(QueueState)
            for _, _, entry in self._candidates(loader, selector, states, stats):
                by_state[entry.state] += 1
                spids.add(entry.spid)
        return Counts(by_state=by_state, messages=len(spids))

    def shape(self, selector: Selector, now: float, edges_s: Sequence[float]
              ) -> dict[str, list[int]]:
        edges = list(edges_s)
        out: dict[str, list[int]] = {}
        with self._snapshot() as loader:
            stats = self._stats(loader)
            states = selector.states or tuple(QueueState)
            for _, _, entry in self._candidates(loader, selector, states, stats):
                age = now - entry.arrival_at
                bucket = next((i for i, e in enumerate(edges) if age < e), len(edges))
                out.setdefault(entry.domain, [0] * (len(edges) + 1))[bucket] += 1
        return out

    def open_content(self, spid: str) -> IO[bytes]:
        self._ensure_open()
        with self._rw.reading():
            try:
                if self._db is None:
                    raise RuntimeError("the queue is not open")
                snap = self._db.snapshot()
                raw = snap.get(_meta_key(spid))
            except (plyvel.Error, RuntimeError) as exc:
                raise StorageError(f"cannot open the content of {spid}: {exc}") from exc
        if raw is None:
            with contextlib.suppress(plyvel.Error, RuntimeError):
                snap.close()
            raise StorageError(f"no content for {spid}")
        chunks = int(json.loads(raw)["chunks"])
        return io.BufferedReader(_ChunkReader(self, spid, snap, chunks), CHUNK_SIZE)

    # -- life ---------------------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._committer.close()
        self._closed = True
        with self._rw.writing(), contextlib.suppress(plyvel.Error, RuntimeError):
            if self._db is not None:
                self._db.close()

    def __enter__(self) -> KvStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
