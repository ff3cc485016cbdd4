"""The embedded default meta queue: SQLite in WAL mode, one row per recipient.

SUMMARY
    SqliteStore(path, spool, node_id=...) implements sluice.store.Store.

DESCRIPTION
    Table ``queue`` holds one row per recipient entry, keyed by (spid, idx),
    with its state, next attempt time, attempts, last reply, priority and
    the fields pickup policies key on (tenantid, jobid, transportid,
    localip, domain).  The SPID is time-ordered, so the primary key is also
    arrival order: listing is a range scan and a cursor is the last qid.
    ``qstats`` keeps counts per state and of messages up to date through
    triggers, so qcount costs nothing at a million rows.  ``qchanges`` is
    the operator change feed a running queue manager polls.  ``content``
    holds the content of small messages (``spool.inline_max``, 64 KiB by
    default), keyed by the SPID read as a number; bigger ones, and content
    handed over as a file or a stream, go to the filesystem spool.
    ``qmeta`` records the schema version: opening a queue written by an
    older Sluice migrates it, under the write lock and in one transaction
    (sluice.store._sql, "Schema versions"); a newer one is refused.

STRATEGIES
    Group commit.  Every write goes through one committer thread (the
    GroupCommitter every flavour shares) that owns the only write
    connection.  It takes everything that queued up while the previous
    commit was in flight -- no artificial wait -- makes the
    batch's spool files durable in one parallel sync, then runs the whole
    batch in one transaction with a savepoint per operation (one failing
    operation does not fail its neighbours) and commits: one WAL fsync
    for the whole batch.  Submitters block on a future that resolves only
    after that fsync.

    The fsync outside the write lock.  Receivers and the queue manager
    commit to one database from several processes, one at a time.  With
    synchronous=FULL each would sync the WAL while holding the write lock,
    so every process's transaction waited for the others' fsyncs.  The
    writer commits with synchronous=NORMAL (the WAL written, not synced),
    releases the lock, and then fdatasyncs the WAL itself before any
    caller of a batch that needs it hears of the commit: as durable as
    FULL for everything acknowledged, and one process's sync overlaps the
    next one's transaction (the kernel merges concurrent syncs).  Batches
    of attempt outcomes and claims only are not synced at all (losing one
    repeats an attempt); content they free waits for a sync.

    Content in the commit.  A small message's content is inserted in the
    same transaction as its rows, so the WAL fsync that makes the rows
    durable makes the content durable too: no file to create, fsync and
    later unlink, and no directory update, which on a busy disk cost more
    than everything else on the accept path.  Its content row is deleted
    in the transaction that deletes its last queue row.

    Order of durability.  Spool content is synced before the meta rows
    that point at it are committed; a spool file is deleted only after the
    commit that removed its last row.  A crash in between leaves at worst
    an orphan spool file, which recover() removes -- never a row without
    content.

    Readers use one connection per thread and never block the writer (WAL).
    Several processes may open the same queue; their commits take turns on
    an flock(2) lock beside the database, which wakes the next committer as
    soon as the previous one is done (SQLite's own busy handler would poll
    with sleeps of growing length).

    Cancellation.  An operation's future is marked running when the
    committer takes it, so a caller that cancels afterwards (asyncio's
    wrap_future does) cannot make a committed batch report failure.

INVARIANTS
    A row is in exactly one state.  ``qstats`` equals COUNT(*) per state.
    Content (a ``content`` row or a spool file) exists for every spid that
    has a row; a ``content`` row exists only while its spid has rows.

LIMITATIONS
    One machine: for several nodes sharing a queue use the postgres flavour.

SEE ALSO
    sluice.store (the interface), sluice.spool.fs, seeds/000 section 4.3.3.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import io
import os
import sqlite3
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, cast

from sluice.model import (
    IN_FLIGHT_STATES,
    Accepted,
    QueueEntry,
    QueueState,
    Reply,
    Selector,
    Submission,
    parse_qid,
)
from sluice.spool import Content, SpoolFile, SpoolIOError, new_spid
from sluice.spool.fs import FsSpool
from sluice.store import Action, Change, Counts, StorageError, Transition
from sluice.store._commit import GroupCommitter, Op
from sluice.store._sql import Conn, Dialect, SqlQueue, migrate, queue_rows, reply_columns

if TYPE_CHECKING:
    from sluice.config import Config

__all__ = ["SqliteStore"]

#: The version of _SCHEMA (kept in qmeta); _MIGRATIONS[v] takes a queue
#: of version v to v + 1 when it is opened (sluice.store._sql.migrate).
SCHEMA_VERSION = 3

_MIGRATIONS: dict[int, tuple[str, ...]] = {
    # 2: the message arrived with SMTPUTF8 (RFC 6531); older mail did not say.
    1: ("ALTER TABLE queue ADD COLUMN smtputf8 INTEGER NOT NULL DEFAULT 0",),
    # 3: who gave the last reply and when (the NDR's Remote-MTA and
    # Last-Attempt-Date); older replies read as Sluice's own, at no time.
    2: ("ALTER TABLE queue ADD COLUMN last_mta TEXT",
        "ALTER TABLE queue ADD COLUMN last_attempt_at REAL"),
}

_SCHEMA = """
CREATE TABLE IF NOT EXISTS queue (
    spid            TEXT    NOT NULL,
    idx             INTEGER NOT NULL,
    sender          TEXT    NOT NULL,
    recipient       TEXT    NOT NULL,
    domain          TEXT    NOT NULL,
    state           TEXT    NOT NULL,
    arrival_at      REAL    NOT NULL,
    next_attempt_at REAL    NOT NULL,
    attempts        INTEGER NOT NULL DEFAULT 0,
    last_code       INTEGER,
    last_enhanced   TEXT,
    last_text       TEXT,
    priority        INTEGER NOT NULL DEFAULT 0,
    tenantid        TEXT    NOT NULL DEFAULT '',
    jobid           TEXT    NOT NULL DEFAULT '',
    transportid     TEXT    NOT NULL DEFAULT '',
    localip         TEXT    NOT NULL DEFAULT '',
    is_report       INTEGER NOT NULL DEFAULT 0,
    size            INTEGER NOT NULL DEFAULT 0,
    owner           TEXT,
    smtputf8        INTEGER NOT NULL DEFAULT 0,
    last_mta        TEXT,
    last_attempt_at REAL,
    PRIMARY KEY (spid, idx)
) WITHOUT ROWID;
-- due-deferred selection, incoming FIFO, listing and counting by state
CREATE INDEX IF NOT EXISTS queue_pick ON queue (state, priority, next_attempt_at);
-- selectors and qshape by domain
CREATE INDEX IF NOT EXISTS queue_domain ON queue (domain);
-- selectors by tenant and job
CREATE INDEX IF NOT EXISTS queue_tenant ON queue (tenantid, jobid);
-- pages by tenant or by state in key order, and the oldest entry per state
-- (an index of a WITHOUT ROWID table ends in its key: these are
-- (tenantid, spid, idx) and (state, spid, idx))
CREATE INDEX IF NOT EXISTS queue_tenant_key ON queue (tenantid);
CREATE INDEX IF NOT EXISTS queue_state_key ON queue (state);

CREATE TABLE IF NOT EXISTS qstats (key TEXT PRIMARY KEY, n INTEGER NOT NULL) WITHOUT ROWID;
INSERT OR IGNORE INTO qstats (key, n) VALUES
    ('hold', 0), ('incoming', 0), ('deferred', 0), ('active', 0),
    ('delivering', 0), ('bounce', 0), ('messages', 0);

CREATE TRIGGER IF NOT EXISTS queue_ins AFTER INSERT ON queue BEGIN
    UPDATE qstats SET n = n + 1 WHERE key = new.state;
    UPDATE qstats SET n = n + 1 WHERE key = 'messages' AND new.idx = 0;
END;
CREATE TRIGGER IF NOT EXISTS queue_del AFTER DELETE ON queue BEGIN
    UPDATE qstats SET n = n - 1 WHERE key = old.state;
END;
CREATE TRIGGER IF NOT EXISTS queue_upd AFTER UPDATE OF state ON queue
WHEN old.state <> new.state BEGIN
    UPDATE qstats SET n = n - 1 WHERE key = old.state;
    UPDATE qstats SET n = n + 1 WHERE key = new.state;
END;

CREATE TABLE IF NOT EXISTS qchanges (
    seq    INTEGER PRIMARY KEY AUTOINCREMENT,
    at     REAL NOT NULL,
    qid    TEXT NOT NULL,
    action TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS qmeta (key TEXT PRIMARY KEY, value TEXT) WITHOUT ROWID;

-- Content of small messages (spool.inline_max), committed with their rows;
-- the rowid is the SPID read as a hexadecimal number.
CREATE TABLE IF NOT EXISTS content (id INTEGER PRIMARY KEY, data BLOB NOT NULL);
"""

#: How long an orphan spool file (content without rows) must have existed
#: before recover() removes it: a submission in another process may be
#: between its spool write and its commit.
ORPHAN_AGE_S = 3600.0

#: The savepoint each operation of a batch runs in; an operation may roll
#: back to it to start over.
_OP_SAVEPOINT = "op"

#: Operator changes are kept this long in the change feed.
CHANGES_KEEP_S = 3600.0


class _Sqlite(Dialect):
    """SQLite's side of the queue statements (sluice.store._sql)."""

    p = "?"
    queue = "queue"
    changes = "qchanges"
    meta = "qmeta"
    true = "1"
    is_report = "is_report = 1"
    not_report = "is_report = 0"
    # Every change runs under the database's write lock (one writer at a
    # time): no rows to lock, none to skip.
    for_change = ""
    claim_order = "next_attempt_at"
    claim_lock = ""

    # IN lists, not a chain of ORs: SQLite refuses expression trees deeper
    # than 1000, which a selection of many ids would build.

    def one_of(self, column: str, values: Sequence[Any]) -> tuple[str, list[Any]]:
        return f"{column} IN ({','.join('?' * len(values))})", list(values)

    def keys_in(self, spids: list[str], idxs: list[int]) -> tuple[str, list[Any]]:
        return (f"(spid, idx) IN (VALUES {','.join(['(?,?)'] * len(spids))})",
                [v for key in zip(spids, idxs, strict=True) for v in key])

    def equal_nocase(self, column: str) -> str:
        return f"{column} = ? COLLATE NOCASE"

    # One prepared statement run per row: no round trips in an embedded
    # database, and no limit on the number of rows one change may touch.

    def change_rows(self, conn: Conn, head: str, params: Sequence[Any],
                    rows: Sequence[Sequence[Any]]) -> None:
        # Claims and most operator actions have one parameter: a tuple
        # display per row is half the cost of unpacking ``params`` into it.
        args: list[tuple[Any, ...]]
        if not params:
            args = [(r[0], r[1]) for r in rows]
        elif len(params) == 1:
            value = params[0]
            args = [(value, r[0], r[1]) for r in rows]
        else:
            args = [(*params, r[0], r[1]) for r in rows]
        cast(sqlite3.Connection, conn).executemany(f"{head} WHERE spid = ? AND idx = ?", args)

    def executemany(self, conn: Conn, sql: str, params: Sequence[Sequence[Any]]) -> None:
        cast(sqlite3.Connection, conn).executemany(sql, params)


def _open_schema(conn: sqlite3.Connection, where: str) -> None:
    """Create what is missing and migrate (sluice.store._sql.migrate), in one
    transaction; the caller holds the write lock."""
    # executescript() commits an open transaction before it starts, so the
    # BEGIN is the script's first statement; the transaction stays open.
    conn.executescript("BEGIN IMMEDIATE;" + _SCHEMA)
    try:
        migrate(conn, _Sqlite(), SCHEMA_VERSION, _MIGRATIONS, where)
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


# --------------------------------------------------------------------------
# The committer

@dataclass(slots=True)
class _Batch:
    """What the operations of one commit share: the connection, and the
    content to delete once the commit is durable."""

    conn: sqlite3.Connection
    unlink: list[str] = field(default_factory=list)


class SqliteStore:
    """Meta queue on SQLite (WAL), small content inline, the rest in a
    filesystem spool; see the module doc."""

    flavour = "sqlite"
    shared_access = True

    def __init__(
        self,
        path: str | os.PathLike[str],
        spool: FsSpool,
        *,
        node_id: str = "local",
        max_batch: int = 2000,
        busy_timeout_s: float = 60.0,
        inline_max: int = 0,
    ) -> None:
        if inline_max < 0:
            raise ValueError("inline_max must be >= 0")
        self.inline_max = inline_max
        self.dir = Path(path)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.db_path = self.dir / "queue.db"
        self.spool = spool
        self.node_id = node_id
        self.max_batch = max_batch
        self._busy_timeout_ms = int(busy_timeout_s * 1000)
        self._local = threading.local()
        self._readers: list[sqlite3.Connection] = []
        self._readers_lock = threading.Lock()
        self._closed = False
        self._lock_fd = os.open(self.dir / "queue.db.writelock",
                                os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
        # Processes that open the queue at the same moment (the receivers of
        # `sluice serve`) take turns: switching a new database to WAL and
        # creating or migrating the schema can fail at once with "database
        # is locked", without waiting for the busy timeout, while another
        # connection does the same.
        writer: sqlite3.Connection | None = None
        try:
            with self._write_lock():
                writer = self._connect()
                _open_schema(writer, str(self.db_path))
        except (sqlite3.Error, StorageError) as exc:
            if writer is not None:
                writer.close()
            os.close(self._lock_fd)
            if isinstance(exc, StorageError):
                raise
            raise StorageError(f"cannot open the queue at {self.db_path}: {exc}") from exc
        self._writer = writer
        # The writer commits without syncing the WAL; _commit syncs it itself,
        # after the commit and outside the lock, for batches that need it.
        self._writer.execute("PRAGMA synchronous = NORMAL")
        self._committer = GroupCommitter(self._commit, max_batch=max_batch, name="sluice-commit",
                                         dropped=self._discard)
        self._sql = SqlQueue(_Sqlite(), self._reading)

    @classmethod
    def from_config(cls, config: Config) -> SqliteStore:
        q = config.queue
        spool = FsSpool(q.spool.rootpath, q.spool.partitiondepth, q.spool.bufsize,
                        q.spool.sync_method)
        return cls(q.path, spool, node_id=config.node.id, max_batch=q.commit_max_batch,
                   inline_max=q.spool.inline_max)

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
        if self._closed:
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

    def _submit_op(self, work: Callable[[_Batch], Any],
                   files: list[SpoolFile] | None = None, *,
                   durable: bool = True) -> concurrent.futures.Future[Any]:
        if self._closed:
            raise StorageError("the store is closed")
        return self._committer.submit(work, files or (), durable=durable)

    def _call(self, work: Callable[[_Batch], Any], *, durable: bool = True) -> Any:
        return self._submit_op(work, durable=durable).result()

    @contextlib.contextmanager
    def _write_lock(self) -> Iterator[None]:
        """The flock(2) beside the database that every process's writer takes."""
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _flush_wal(self) -> None:
        """Make every commit so far durable: fdatasync the WAL (after a batch
        that needs it, and before deleting spool files that an unsynced batch
        freed).  fdatasync flushes the file, whichever descriptor or process
        wrote it; a checkpoint in between syncs the WAL before copying it
        into the database and the database after, so frames it took along
        are durable too."""
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
            self.spool.discard(f)

    def _commit(self, batch: list[Op]) -> None:
        # 1. Content first: sync every spool file of the batch in one go.
        files = [f for op in batch for f in op.files]
        if files:
            try:
                self.spool.sync(files)
            except OSError as exc:
                err = StorageError(f"spool sync failed: {exc}")
                for op in batch:
                    if op.files:
                        for f in op.files:
                            self.spool.discard(f)
                        op.future.set_exception(err)
                batch = [op for op in batch if not op.files]
                if not batch:
                    return
        # 2. Meta: the whole batch in one transaction, one savepoint per op.
        conn = self._writer
        durable = any(op.durable or op.files for op in batch)
        after = _Batch(conn)
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
                        self.spool.discard(f)
                    op.future.set_exception(err)
                return
        # 3. Durability, outside the lock: the commit wrote the WAL without
        #    syncing it (synchronous=NORMAL), so that no process waits for
        #    another's fsync to begin its own transaction; the batch's
        #    callers hear of it only once the WAL is synced.  If that fails,
        #    the rows are in the queue but maybe not on disk: callers that
        #    needed durability get an error (a client retries; a duplicate
        #    is possible, a loss after 250 is not).
        unsynced: StorageError | None = None
        if durable:
            try:
                self._flush_wal()
            except OSError as exc:
                unsynced = StorageError(f"the queue's log could not be synced: {exc}")
        # 4. Content whose last row is gone may go too (on the spool's own
        #    thread: unlinks must not delay the next commit).
        self.spool.delete_soon(after.unlink, barrier=(
            None if durable and unsynced is None else self._flush_wal))
        for op, value, failure in results:
            if failure is None and unsynced is not None and (op.durable or op.files):
                op.future.set_exception(unsynced)
            elif failure is None:
                op.future.set_result(value)
            else:
                for f in op.files:
                    self.spool.discard(f)
                if isinstance(failure, sqlite3.Error):
                    failure = StorageError(str(failure))
                op.future.set_exception(failure)

    @staticmethod
    def _transaction(batch: list[Op], after: _Batch,
                     results: list[tuple[Op, Any, BaseException | None]]) -> None:
        """The whole batch in one transaction, one savepoint per operation."""
        conn = after.conn
        conn.execute("BEGIN IMMEDIATE")
        for op in batch:
            conn.execute(f"SAVEPOINT {_OP_SAVEPOINT}")
            try:
                value = op.work(after)
            except Exception as exc:
                conn.execute(f"ROLLBACK TO {_OP_SAVEPOINT}")
                conn.execute(f"RELEASE {_OP_SAVEPOINT}")
                results.append((op, None, exc))
            else:
                conn.execute(f"RELEASE {_OP_SAVEPOINT}")
                results.append((op, value, None))
        conn.execute("COMMIT")

    # -- submission --------------------------------------------------------------

    def submit_future(self, submission: Submission, content: Content, now: float
                      ) -> concurrent.futures.Future[Accepted]:
        blob = self._inline(content)
        if blob is not None:
            return self._submit_inline(submission, blob, now)
        try:
            sf = self.spool.write(content, submission.spid)
        except SpoolIOError as exc:
            raise StorageError(f"spool write failed: {exc.strerror or exc}") from exc
        rows, accepted = queue_rows(submission, sf.spid, sf.size, now)

        def work(after: _Batch) -> Accepted:
            self._sql.insert(after.conn, rows)
            return accepted

        try:
            return self._submit_op(work, [sf])
        except BaseException:
            self.spool.discard(sf)
            raise

    def _inline(self, content: Content) -> bytes | None:
        """The content as one piece if it is small enough to keep in the
        database (in memory already, at most ``inline_max`` bytes)."""
        limit = self.inline_max
        if not limit:
            return None
        if isinstance(content, bytes | bytearray | memoryview):
            return bytes(content) if len(content) <= limit else None
        if isinstance(content, list | tuple):
            if sum(len(piece) for piece in content) > limit:
                return None
            return b"".join(content)
        return None  # a file or a stream: its size is unknown until read

    def _submit_inline(self, submission: Submission, blob: bytes, now: float
                       ) -> concurrent.futures.Future[Accepted]:
        """Content and rows in one operation: one WAL fsync makes both durable,
        and no file is created, synced or later unlinked."""

        def work(after: _Batch) -> Accepted:
            conn = after.conn
            spid = submission.spid or new_spid()
            while True:
                # SPIDs of different processes can collide (exclusive create
                # settles it for files); here the primary keys do: undo this
                # operation so far (_transaction's savepoint) and draw again.
                try:
                    conn.execute("INSERT INTO content (id, data) VALUES (?, ?)",
                                 (int(spid, 16), blob))
                    rows, accepted = queue_rows(submission, spid, len(blob), now)
                    self._sql.insert(conn, rows)
                except sqlite3.IntegrityError:
                    conn.execute(f"ROLLBACK TO {_OP_SAVEPOINT}")
                    spid = new_spid()
                    continue
                return accepted

        return self._submit_op(work)

    def submit(self, submission: Submission, content: Content, now: float) -> Accepted:
        result: Accepted = self.submit_future(submission, content, now).result()
        return result

    # -- the queue manager's side ----------------------------------------------------

    def claim(self, limit: int, now: float, quota_deferred: int) -> list[QueueEntry]:
        if limit <= 0:
            return []
        # A queue manager polls often; when there is nothing to claim, answer
        # from a reader instead of taking the write lock.
        with self._reading() as conn:
            found = conn.execute(
                "SELECT 1 FROM queue WHERE state = 'incoming' UNION ALL "
                "SELECT 1 FROM queue WHERE state = 'deferred' AND priority = 1 "
                "AND next_attempt_at <= ? UNION ALL "
                "SELECT 1 FROM queue WHERE state = 'deferred' AND priority = 0 "
                "AND next_attempt_at <= ? LIMIT 1",
                (now, now),
            ).fetchone()
        if found is None:
            return []
        node = self.node_id

        def work(after: _Batch) -> list[QueueEntry]:
            return self._sql.claim(after.conn, limit, now, quota_deferred, node)[0]

        # A claim lost in a power cut leaves the entries where they were.
        result: list[QueueEntry] = self._call(work, durable=False)
        return result

    def apply(self, transitions: Sequence[Transition], *, wait: bool = True,
              durable: bool = True) -> set[str]:
        if not transitions:
            return set()
        items = list(transitions)
        node = self.node_id

        def work(after: _Batch) -> set[str]:
            conn = after.conn
            applied: set[str] = set()
            touched: set[str] = set()
            for t in items:
                spid, idx = parse_qid(t.qid)
                if idx is None:
                    raise ValueError(f"a transition needs a full queue id, not {t.qid!r}")
                cond = "spid = ? AND idx = ?"
                cparams: list[Any] = [spid, idx]
                if t.expect:
                    cond += f" AND state IN ({','.join('?' * len(t.expect))})"
                    cparams.extend(str(s) for s in t.expect)
                if t.state is None:
                    cur = conn.execute(f"DELETE FROM queue WHERE {cond}", cparams)
                else:
                    sets = ["state = ?"]
                    params: list[Any] = [str(t.state)]
                    if t.next_attempt_at is not None:
                        sets.append("next_attempt_at = ?")
                        params.append(t.next_attempt_at)
                    if t.reply is not None:
                        sets += ["last_code = ?", "last_enhanced = ?", "last_text = ?",
                                 "last_mta = ?", "last_attempt_at = ?"]
                        params += reply_columns(t.reply)
                    if t.attempted:
                        sets.append("attempts = attempts + 1")
                    sets.append("owner = ?")
                    params.append(node if t.state in IN_FLIGHT_STATES else None)
                    cur = conn.execute(
                        f"UPDATE queue SET {', '.join(sets)} WHERE {cond}", params + cparams
                    )
                if cur.rowcount:
                    applied.add(t.qid)
                    if t.state is None:
                        touched.add(spid)
            self._collect_gone(conn, touched, after)
            return applied

        fut = self._submit_op(work, durable=durable)
        if not wait:
            return set()
        result: set[str] = fut.result()
        return result

    def _collect_gone(self, conn: sqlite3.Connection, spids: set[str], after: _Batch) -> None:
        """Queue for deletion the content of messages that have no rows left."""
        for spid in spids:
            if conn.execute("SELECT 1 FROM queue WHERE spid = ? LIMIT 1", (spid,)).fetchone():
                continue
            # Content kept inline goes in this very transaction; a file only
            # once the commit is durable.
            if not conn.execute("DELETE FROM content WHERE id = ?", (int(spid, 16),)).rowcount:
                after.unlink.append(spid)
            conn.execute("UPDATE qstats SET n = n - 1 WHERE key = 'messages'")

    def claim_bounces(self, limit: int, now: float, lease_s: float) -> list[QueueEntry]:
        if limit <= 0:
            return []

        def work(after: _Batch) -> list[QueueEntry]:
            return self._sql.claim_bounces(after.conn, limit, now, lease_s)

        result: list[QueueEntry] = self._call(work)
        return result

    def recover(self, now: float) -> int:
        def work(after: _Batch) -> int:
            conn = after.conn
            # On the embedded store one queue manager owns the whole queue, so
            # every in-flight row is ours to return, whichever node id wrote it
            # (a renamed host, a copied queue directory).
            cur = conn.execute(
                "UPDATE queue SET state = 'deferred', next_attempt_at = ?, owner = NULL "
                "WHERE state IN ('active', 'delivering')",
                (now,),
            )
            conn.execute("DELETE FROM qchanges WHERE at < ?", (now - CHANGES_KEEP_S,))
            # Inline content and its rows come and go in one transaction, so
            # an orphan row could only be left by an older version or a hand
            # edit; it would never be deleted otherwise.
            conn.execute(
                "DELETE FROM content WHERE NOT EXISTS (SELECT 1 FROM queue "
                "WHERE queue.spid = printf('%016X', content.id))"
            )
            # Recount, as insurance against counters left wrong by an older
            # version (one scan of an index; a fraction of a second at 1M rows).
            conn.execute(
                "UPDATE qstats SET n = (SELECT COUNT(*) FROM queue q WHERE q.state = qstats.key) "
                "WHERE key <> 'messages'"
            )
            conn.execute(
                "UPDATE qstats SET n = (SELECT COUNT(*) FROM (SELECT DISTINCT spid FROM queue)) "
                "WHERE key = 'messages'"
            )
            return int(cur.rowcount)

        moved: int = self._call(work)
        self._sweep_orphans(now)
        return moved

    def _sweep_orphans(self, now: float) -> None:
        with self._reading() as conn:
            for spid, mtime in self.spool.spids():
                if now - mtime < ORPHAN_AGE_S:
                    continue
                row = conn.execute("SELECT 1 FROM queue WHERE spid = ? LIMIT 1", (spid,))
                if row.fetchone() is None:
                    self.spool.delete(spid)

    def expired(self, cutoff_at: float, reports_cutoff_at: float, limit: int = 10000
                ) -> list[QueueEntry]:
        return self._sql.expired(cutoff_at, reports_cutoff_at, limit)

    def due_at(self) -> float | None:
        return self._sql.due_at()

    def oldest(self) -> dict[QueueState, float]:
        return self._sql.oldest()

    # -- operator side ------------------------------------------------------------------

    def modify(self, selector: Selector, action: Action, now: float,
               priority: int | None = None, reply: Reply | None = None) -> list[QueueEntry]:
        change = self._sql.modifier(selector, action, now, priority, reply)

        def work(after: _Batch) -> list[QueueEntry]:
            conn = after.conn
            return change(conn, lambda spids: self._collect_gone(conn, spids, after))

        result: list[QueueEntry] = self._call(work)
        return result

    def changes_since(self, seq: int) -> tuple[int, list[Change]]:
        return self._sql.changes_since(seq)

    # -- reading ----------------------------------------------------------------------

    def get(self, qid: str) -> QueueEntry | None:
        return self._sql.get(qid)

    def entries(self, selector: Selector, *, after: str | None = None,
                limit: int | None = None) -> Iterator[QueueEntry]:
        return self._sql.entries(selector, after=after, limit=limit)

    def count(self, selector: Selector | None = None) -> Counts:
        if selector is not None and not selector.is_empty:
            return self._sql.count(selector)
        # The whole queue: the counters the triggers keep, not a scan.
        with self._reading() as conn:
            stats = dict(conn.execute("SELECT key, n FROM qstats").fetchall())
        by_state = {s: int(stats.get(str(s), 0)) for s in QueueState}
        return Counts(by_state=by_state, messages=int(stats.get("messages", 0)))

    def shape(self, selector: Selector, now: float, edges_s: Sequence[float]
              ) -> dict[str, list[int]]:
        where, params = self._sql.where(selector)
        edges = list(edges_s)
        case = " ".join(
            f"WHEN ? - arrival_at < {float(e)!r} THEN {i}" for i, e in enumerate(edges)
        )
        sql = (
            f"SELECT domain, CASE {case} ELSE {len(edges)} END AS b, COUNT(*) "
            f"FROM queue WHERE {where} GROUP BY domain, b"
        )
        out: dict[str, list[int]] = {}
        with self._reading() as conn:
            for domain, bucket, n in conn.execute(sql, [now] * len(edges) + params):
                out.setdefault(domain, [0] * (len(edges) + 1))[int(bucket)] += int(n)
        return out

    def open_content(self, spid: str) -> IO[bytes]:
        try:
            key = int(spid, 16)
        except ValueError:
            raise StorageError(f"not a SPID: {spid!r}") from None
        with self._reading() as conn:
            row = conn.execute("SELECT data FROM content WHERE id = ?", (key,)).fetchone()
        if row is not None:
            return io.BytesIO(row[0])
        try:
            return self.spool.open(spid)
        except OSError as exc:
            raise StorageError(f"cannot open the content of {spid}: {exc}") from exc

    # -- life ------------------------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._committer.close()
        self.spool.close()
        os.close(self._lock_fd)
        with contextlib.suppress(sqlite3.Error):
            self._writer.close()
        with self._readers_lock:
            for conn in self._readers:
                with contextlib.suppress(sqlite3.Error):
                    conn.close()
            self._readers.clear()

    def __enter__(self) -> SqliteStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
