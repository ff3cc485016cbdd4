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
    default), keyed by the SPID read as a number; bigger ones go to spool
    segments, ``content_at`` recording where (sluice.store._sqlite_segments),
    and with ``spool.layout: files``, or when handed over as a file or a
    stream, to a spool file of their own.
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

    Pipelined flush.  The fdatasync runs on a syncer thread of its own,
    so the committer begins the next batch while the last one is being
    flushed: a claim or a "delivering" mark queued behind a delivery's
    outcome waits for that outcome's transaction, not for its fsync, and
    batches that commit during one flush share the next.

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
    Content (a ``content`` row, a ``content_at`` row and its segment, or a
    spool file) exists for every spid that has a row; a ``content`` or
    ``content_at`` row exists only while its spid has rows.

LIMITATIONS
    One machine: for several nodes sharing a queue use the postgres flavour.

SEE ALSO
    sluice.store (the interface), sluice.store._sqlite_schema (tables and
    triggers), sluice.store._sqlite_db (connections and the committer),
    sluice.store._sqlite_apply (the statements of apply),
    sluice.store._sqlite_segments (contents in segments), sluice.spool.fs,
    seeds/000 section 4.3.3.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import os
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from sluice.model import (
    Accepted,
    QueueEntry,
    QueueState,
    Reply,
    Selector,
    Submission,
)
from sluice.spool import Content, SpoolIOError, new_spid
from sluice.spool.fs import FsSpool
from sluice.spool.segments import Segments
from sluice.store import (
    CHANGES_KEEP_S,
    ORPHAN_AGE_S,
    Action,
    ApplyByFuture,
    Change,
    Counts,
    StorageError,
    Transition,
    applied_nothing,
)
from sluice.store._commit import GroupCommitter
from sluice.store._refill import EQUAL, TenantWeights
from sluice.store._sql import SqlQueue, queue_rows
from sluice.store._sqlite_apply import KEYS_PER_STATEMENT, grouped, keys_where
from sluice.store._sqlite_db import Batch, WalSyncer
from sluice.store._sqlite_schema import (
    CHECKED,
    SCHEMA_VERSION,
    Sqlite,
    check_whole_queue,
    open_schema,
)
from sluice.store._sqlite_segments import COMPACT_EVERY_S, InSegments, insert_message

if TYPE_CHECKING:
    from sluice.config import Config

__all__ = ["SCHEMA_VERSION", "SqliteStore"]

class SqliteStore(ApplyByFuture, InSegments):
    """Meta queue on SQLite (WAL), small content inline, the rest in files.

    The files are a filesystem spool; see the module doc.
    """

    flavour = "sqlite"
    #: Tenants' weights for sharing a refill (from_config: scheduler.tenants).
    tenant_weights: TenantWeights = EQUAL
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
        segments: Segments | None = None,
        write_segments: bool = True,
    ) -> None:
        if inline_max < 0:
            raise ValueError("inline_max must be >= 0")
        self.inline_max = inline_max
        self.segments = segments
        #: Big contents go to segments (queue.spool.layout); either way the
        #: ones already in segments are read and freed there.
        self.write_segments = write_segments and segments is not None
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
                open_schema(writer, str(self.db_path))
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
        # A lambda, so that a test spying on _flush_wal sees the syncer's flushes.
        self._syncer = WalSyncer(lambda: self._flush_wal(), self._settle, self.spool)
        self._committer = GroupCommitter(self._commit, max_batch=max_batch, name="sluice-commit",
                                         dropped=self._discard)
        self._sql = SqlQueue(Sqlite(), self._reading)
        if segments is not None:
            self._bind_segments(segments)

    @classmethod
    def from_config(cls, config: Config) -> SqliteStore:
        """The store a configuration names (queue.path, queue.spool)."""
        q = config.queue
        spool = FsSpool(q.spool.rootpath, q.spool.partitiondepth, q.spool.bufsize,
                        q.spool.sync_method)
        segments = Segments(q.spool.rootpath, q.spool.segment_max, q.spool.segment_age,
                            q.spool.bufsize)
        store = cls(q.path, spool, node_id=config.node.id, max_batch=q.commit_max_batch,
                    inline_max=q.spool.inline_max, segments=segments,
                    write_segments=q.spool.layout == "segments")
        store.tenant_weights = TenantWeights.of(config.scheduler.tenants)
        return store

    # -- submission --------------------------------------------------------------

    def submit_future(self, submission: Submission, content: Content, now: float
                      ) -> concurrent.futures.Future[Accepted]:
        """Store.submit_future: rows and small content in the next group commit."""
        blob = self._inline(content)
        if blob is not None:
            return self._submit_inline(submission, blob, now)
        if self.write_segments and self.segments is not None and isinstance(
                content, bytes | bytearray | memoryview | list | tuple):
            return self._submit_segment(submission, self.segments, content, now)
        try:
            sf = self.spool.write(content, submission.spid)
        except SpoolIOError as exc:
            raise StorageError(f"spool write failed: {exc.strerror or exc}") from exc
        rows, accepted = queue_rows(submission, sf.spid, sf.size, now)

        def work(after: Batch) -> Accepted:
            self._sql.insert(after.conn, rows)
            return accepted

        try:
            return self._submit_op(work, [sf])
        except BaseException:
            self.spool.discard(sf)
            raise

    def _inline(self, content: Content) -> bytes | None:
        """The content as one piece if it is small enough to keep in the database.

        That is: in memory already, and at most ``inline_max`` bytes.
        """
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
        """Content and rows in one operation: one WAL fsync makes both durable.

        No file is created, synced or later unlinked.
        """

        def work(after: Batch) -> Accepted:
            return insert_message(self._sql, after.conn, submission,
                                  submission.spid or new_spid(), len(blob), now,
                                  "INSERT INTO content (id, data) VALUES (?, ?)", (blob,))

        return self._submit_op(work)

    def submit(self, submission: Submission, content: Content, now: float) -> Accepted:
        """Store.submit: queue a message and wait until it is durable."""
        result: Accepted = self.submit_future(submission, content, now).result()
        return result

    # -- the queue manager's side ----------------------------------------------------

    def claim(self, limit: int, now: float, quota_deferred: int) -> list[QueueEntry]:
        """Store.claim: incoming and due deferred entries become active, in one transaction."""
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

        def work(after: Batch) -> list[QueueEntry]:
            return self._sql.claim(after.conn, limit, now, quota_deferred, node,
                                   weights=self.tenant_weights)[0]

        # A claim lost in a power cut leaves the entries where they were.
        result: list[QueueEntry] = self._call(work, durable=False)
        return result

    def apply_future(self, transitions: Sequence[Transition], *, durable: bool = True,
                     flush_soon: bool = False) -> concurrent.futures.Future[set[str]]:
        """Store.apply_future: outcomes and marks, one statement per kind of change."""
        if not transitions:
            return applied_nothing()
        items = list(transitions)
        node = self.node_id

        def work(after: Batch) -> set[str]:
            conn = after.conn
            applied: set[str] = set()
            touched: set[str] = set()
            for statement, params, keys in grouped(items, node):
                deleting = statement.startswith("DELETE")
                for at in range(0, len(keys), KEYS_PER_STATEMENT):
                    where, values, qids = keys_where(keys[at : at + KEYS_PER_STATEMENT])
                    for spid, idx in conn.execute(
                            f"{statement} AND ({where}) RETURNING spid, idx",
                            (*params, *values)).fetchall():
                        applied.add(qids[spid, idx])
                        if deleting:
                            touched.add(spid)
            self._collect_gone(conn, touched, after)
            return applied

        return self._submit_op(work, durable=durable, soon=flush_soon)

    def _collect_gone(self, conn: sqlite3.Connection, spids: set[str], after: Batch) -> None:
        """Queue for deletion the content of messages that have no rows left.

        A few statements for all of them, not a few each.
        """
        if not spids:
            return
        listed = sorted(spids)
        for at in range(0, len(listed), KEYS_PER_STATEMENT):
            chunk = listed[at : at + KEYS_PER_STATEMENT]
            marks = ",".join("?" * len(chunk))
            kept = {spid for spid, in conn.execute(
                f"SELECT DISTINCT spid FROM queue WHERE spid IN ({marks})", chunk)}
            gone = [spid for spid in chunk if spid not in kept]
            if not gone:
                continue
            # Content kept inline, and a segment's record of one, go in this
            # very transaction (the segment once nothing in it is queued); a
            # file only once the commit is durable.
            keys = [int(spid, 16) for spid in gone]
            recorded = {i for i, in conn.execute(
                f"DELETE FROM content WHERE id IN ({','.join('?' * len(keys))}) RETURNING id",
                keys)}
            rest = [k for k in keys if k not in recorded]
            if rest and self.segments is not None:
                for i, seg in conn.execute(
                        f"DELETE FROM content_at WHERE id IN ({','.join('?' * len(rest))}) "
                        "RETURNING id, seg", rest):
                    recorded.add(i)
                    after.freed.add(seg)
            after.unlink.extend(spid for spid in gone if int(spid, 16) not in recorded)
            conn.execute("UPDATE qstats SET n = n - ? WHERE key = 'messages'", (len(gone),))

    def claim_bounces(self, limit: int, now: float, lease_s: float) -> list[QueueEntry]:
        """Store.claim_bounces: entries in the bounce state, leased for the NDR writer."""
        if limit <= 0:
            return []

        def work(after: Batch) -> list[QueueEntry]:
            return self._sql.claim_bounces(after.conn, limit, now, lease_s)

        result: list[QueueEntry] = self._call(work)
        return result

    def recover(self, now: float) -> int:
        """Store.recover: every in-flight row is this node's; orphan spool files go."""
        def work(after: Batch) -> int:
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
            if conn.execute(f"SELECT 1 FROM qmeta WHERE key = '{CHECKED}'").fetchone() is None:
                check_whole_queue(conn)
            return int(cur.rowcount)

        moved: int = self._call(work, bulk=True)
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
        if self.segments is not None:
            self.segments.sweep_all()
            # The queue manager recovers the queue; it also compacts it.
            self.segments.bind_compaction(self.compact_segments, COMPACT_EVERY_S)

    def expired(self, cutoff_at: float, reports_cutoff_at: float, limit: int = 10000
                ) -> list[QueueEntry]:
        """Store.expired: entries past their lifetime (reports by their own cutoff)."""
        return self._sql.expired(cutoff_at, reports_cutoff_at, limit)

    def due_at(self) -> float | None:
        """Store.due_at: the earliest next attempt of a deferred entry."""
        return self._sql.due_at()

    def oldest(self) -> dict[QueueState, float]:
        """Store.oldest: the arrival of the oldest entry per state, from the state index."""
        return self._sql.oldest()

    # -- operator side ------------------------------------------------------------------

    def modify(self, selector: Selector, action: Action, now: float,
               priority: int | None = None, reply: Reply | None = None) -> list[QueueEntry]:
        """Store.modify: an operator action on the selected entries, audited as changes."""
        change = self._sql.modifier(selector, action, now, priority, reply)

        def work(after: Batch) -> list[QueueEntry]:
            conn = after.conn
            return change(conn, lambda spids: self._collect_gone(conn, spids, after))

        result: list[QueueEntry] = self._call(work, bulk=True)
        return result

    def changes_since(self, seq: int) -> tuple[int, list[Change]]:
        """Store.changes_since: the change log after ``seq``."""
        return self._sql.changes_since(seq)

    # -- reading ----------------------------------------------------------------------

    def get(self, qid: str) -> QueueEntry | None:
        """Store.get: one entry by queue id."""
        return self._sql.get(qid)

    def entries(self, selector: Selector, *, after: str | None = None,
                limit: int | None = None) -> Iterator[QueueEntry]:
        """Store.entries: the selected entries in queue-id order, after the cursor."""
        return self._sql.entries(selector, after=after, limit=limit)

    def list_rows(self, selector: Selector, *, limit: int | None = None
                  ) -> Iterator[list[tuple[Any, ...]]]:
        """ListsRows.list_rows: the driver's rows, a page at a time, no QueueEntry."""
        return self._sql.rows(selector, limit=limit)

    def count(self, selector: Selector | None = None) -> Counts:
        """Store.count: totals from qstats, or counted for a selector."""
        if selector is not None and not selector.is_empty:
            return self._sql.count(selector)
        # The whole queue: the counters the triggers keep, not a scan.
        with self._reading() as conn:
            stats = dict(conn.execute("SELECT key, n FROM qstats").fetchall())
        by_state = {s: int(stats.get(str(s), 0)) for s in QueueState}
        return Counts(by_state=by_state, messages=int(stats.get("messages", 0)))

    def shape(self, selector: Selector, now: float, edges_s: Sequence[float]
              ) -> dict[str, list[int]]:
        """Store.shape: qshape buckets of the selected entries by age."""
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

    @property
    def ahead_max(self) -> int:
        """ReadsContentsAhead.ahead_max: the contents kept inline."""
        return self.inline_max

    def inline_contents(self, spids: Sequence[str]) -> dict[str, bytes]:
        """ReadsContentsAhead.inline_contents: one statement for all of ``spids``."""
        keys = {_content_key(s): s for s in spids}
        if not keys:
            return {}
        marks = ",".join("?" * len(keys))
        with self._reading() as conn:
            rows = conn.execute(f"SELECT id, data FROM content WHERE id IN ({marks})",
                                tuple(keys)).fetchall()
        return {keys[k]: bytes(data) for k, data in rows}

    def open_large(self, spid: str) -> IO[bytes]:
        """ReadsContentsAhead.open_large: the segment or spool file, else inline.

        Inline when ``inline_max`` was lowered since the message came in.
        Where big contents are written as files, no segment is looked for
        before the file (open_content looks, for those written before).
        """
        if self.write_segments:
            found = self._open_segment(_content_key(spid), spid)
            if found is not None:
                return found
        try:
            return self.spool.open(spid)
        except FileNotFoundError:
            return self.open_content(spid)
        except OSError as exc:
            raise StorageError(f"cannot open the content of {spid}: {exc}") from exc

    def open_content(self, spid: str) -> IO[bytes]:
        """Store.open_content: the inline content, else the spool file."""
        key = _content_key(spid)
        with self._reading() as conn:
            row = conn.execute("SELECT data FROM content WHERE id = ?", (key,)).fetchone()
        if row is not None:
            return io.BytesIO(row[0])
        if self.segments is not None:
            found = self._open_segment(key, spid)
            if found is not None:
                return found
        try:
            return self.spool.open(spid)
        except OSError as exc:
            raise StorageError(f"cannot open the content of {spid}: {exc}") from exc

    # -- life ------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the committer and close the spool and connections."""
        if self._closed:
            return
        self._closed = True
        # Sweeps queued by the last commits still ask which segments are
        # referenced; new operations are refused from here on.
        self._reads_after_close = True
        self._committer.close()
        self._syncer.close()
        self.spool.close()
        if self.segments is not None:
            self.segments.close()
        self._reads_after_close = False
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


def _content_key(spid: str) -> int:
    """The content table's key of message ``spid`` (its 16 hex digits)."""
    try:
        return int(spid, 16)
    except ValueError:
        raise StorageError(f"not a SPID: {spid!r}") from None
