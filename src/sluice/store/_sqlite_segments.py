"""The SQLite store's big contents in spool segments: where each lies, and moving survivors out.

SUMMARY
    InSegments, the base of SqliteStore that keeps table ``content_at``;
    COMPACT_AFTER_S, COMPACT_BELOW, COMPACT_EVERY_S.

DESCRIPTION
    With ``queue.spool.layout: segments`` a content over ``inline_max``
    is appended to the writing process's spool segment
    (sluice.spool.segments) and ``content_at`` records its place -- the
    segment's number, the offset and the length -- in the transaction that
    inserts its rows.  The row goes in the transaction that deletes the
    message's last entry, and the segment once no row names it.

STRATEGIES
    Compaction.  A segment stays on disk while any content in it is
    queued, so a few deferred messages could keep a day's segments.  Every
    COMPACT_EVERY_S the queue manager (the process that recovered the
    queue) looks for segments older than COMPACT_AFTER_S whose queued
    contents fill less than COMPACT_BELOW of the file, and moves those
    contents out: copied to its own active segment and synced, their rows
    pointed at the copies in one durable commit (only rows that still name
    the old segment: a message delivered meanwhile leaves a dead copy),
    then the old segment goes as any free one.  The same pass sweeps the
    segments no row names (a sweep that failed, a writer killed before it
    committed anything).  It holds the old segment's
    lock throughout, so no other process's compaction or sweep works on it
    at the same time.  So a segment older than ten minutes is at least half
    queued content; the space held beyond the queued contents is at most
    their size again, plus the last ten minutes of traffic.

    A reader that looked a content's place up just before it moved may
    find the old segment gone; it looks the place up once more.

SEE ALSO
    sluice.spool.segments (the files, their locks and sweeps),
    sluice.store.sqlite (the store), docs/queue.md ("Durability").
"""

from __future__ import annotations

import concurrent.futures
import os
import sqlite3
from collections.abc import Sequence
from typing import IO, Any

from sluice.model import Accepted, Submission
from sluice.spool import SpoolFile, SpoolIOError, new_spid, spid_time
from sluice.spool.segments import Segments, segment_name, segment_number
from sluice.store import StorageError
from sluice.store._sql import SqlQueue, queue_rows
from sluice.store._sqlite_db import OP_SAVEPOINT, Batch, Database

__all__ = ["COMPACT_AFTER_S", "COMPACT_BELOW", "COMPACT_EVERY_S", "InSegments", "insert_message"]

#: A segment younger than this is left alone: most of it is still on its way out.
COMPACT_AFTER_S = 600.0
#: Compact a segment whose queued contents fill less than this share of it.
COMPACT_BELOW = 0.5
#: How often the queue manager looks.
COMPACT_EVERY_S = 60.0

#: Contents a segment holds, as content_at rows: (id, offset, length).
_Rows = list[tuple[int, int, int]]


class InSegments(Database):
    """The segment side of SqliteStore (module doc)."""

    segments: Segments | None
    _sql: SqlQueue

    def _bind_segments(self, segments: Segments) -> None:
        segments.bind(self.segments_referenced, lambda: self._flush_wal())

    def segments_referenced(self, numbers: list[int]) -> set[int]:
        """Which of these segments hold a content some message still has."""
        found: set[int] = set()
        with self._reading() as conn:
            for at in range(0, len(numbers), 500):
                chunk = numbers[at : at + 500]
                found.update(n for n, in conn.execute(
                    "SELECT DISTINCT seg FROM content_at WHERE seg IN "
                    f"({','.join('?' * len(chunk))})", chunk))
        return found

    def _submit_segment(self, submission: Submission, segments: Segments,
                        content: bytes | bytearray | memoryview | list[bytes] | tuple[bytes, ...],
                        now: float) -> concurrent.futures.Future[Accepted]:
        """Content appended to a segment, its place recorded with the rows."""
        pieces: Sequence[bytes | bytearray | memoryview] = (
            [content] if isinstance(content, bytes | bytearray | memoryview) else content)
        size = sum(len(p) for p in pieces)
        try:
            sf = segments.write(pieces, size, submission.spid)
        except SpoolIOError as exc:
            raise StorageError(f"spool write failed: {exc.strerror or exc}") from exc
        where = (segment_number(sf.path), sf.offset, size)

        def work(after: Batch) -> Accepted:
            return insert_message(self._sql, after.conn, submission, sf.spid, size, now,
                                  "INSERT INTO content_at (id, seg, off, len) VALUES (?, ?, ?, ?)",
                                  where)

        try:
            return self._submit_op(work, [sf])
        except BaseException:
            segments.settle((sf,))
            raise

    def _open_segment(self, key: int, spid: str) -> IO[bytes] | None:
        """The content's range in its segment, or None if it is not in one."""
        assert self.segments is not None
        for _ in range(2):  # once more if compaction moved it meanwhile
            with self._reading() as conn:
                row = conn.execute("SELECT seg, off, len FROM content_at WHERE id = ?",
                                   (key,)).fetchone()
            if row is None:
                return None
            try:
                return self.segments.open(*row)
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise StorageError(f"cannot open the content of {spid}: {exc}") from exc
        raise StorageError(f"cannot open the content of {spid}: its spool segment is gone")

    # -- compaction ----------------------------------------------------------------

    def compact_segments(self, now: float) -> int:
        """Move the queued contents out of old, mostly free segments; how many were emptied.

        ``now`` is POSIX time (a segment's age comes from its name).
        """
        segments = self.segments
        if segments is None:
            return 0
        with self._reading() as conn:
            queued = dict(conn.execute("SELECT seg, SUM(len) FROM content_at GROUP BY seg"))
        # Segments nothing refers to that no sweep took: a sweep that failed,
        # or a writer killed before it committed anything.
        segments.drop_stale_new()
        emptied = segments.sweep(set(segments.numbers()) - set(queued))
        for number, held in sorted(queued.items()):
            if now - spid_time(segment_name(number)) < COMPACT_AFTER_S:
                continue
            size = segments.size(number)
            if size is None or held >= COMPACT_BELOW * size:
                continue
            fd = segments.lock(number)
            if fd is None:  # being written, swept or compacted elsewhere
                continue
            try:
                self._move_out(segments, number)
                emptied += segments.sweep_locked({number: fd})
            finally:
                os.close(fd)
        return emptied

    def _move_out(self, segments: Segments, number: int) -> None:
        """Copy the contents still queued in segment ``number``; point their rows at the copies."""
        with self._reading() as conn:
            rows: _Rows = conn.execute(
                "SELECT id, off, len FROM content_at WHERE seg = ?", (number,)).fetchall()
        copies: list[tuple[int, SpoolFile]] = []
        try:
            for key, offset, size in rows:
                with segments.open(number, offset, size) as stream:
                    data = stream.read()
                copies.append((key, segments.write([data], len(data))))
        except BaseException:
            segments.settle(sf for _, sf in copies)
            raise

        def work(after: Batch) -> int:
            moved = 0
            for key, sf in copies:
                moved += after.conn.execute(
                    "UPDATE content_at SET seg = ?, off = ? WHERE id = ? AND seg = ?",
                    (segment_number(sf.path), sf.offset, key, number)).rowcount
            return moved

        # The copies are synced before the commit and settled after it (or
        # dropped, if it fails); only a refusal to take the work is ours to settle.
        try:
            done = self._submit_op(work, [sf for _, sf in copies])
        except BaseException:
            segments.settle(sf for _, sf in copies)
            raise
        done.result()


def insert_message(sql: SqlQueue, conn: sqlite3.Connection, submission: Submission, spid: str,
                   size: int, now: float, content_sql: str, content: tuple[Any, ...]
                   ) -> Accepted:
    """A message's content record (``content_sql``: its key, then ``content``) and its rows.

    SPIDs of different processes can collide (exclusive create settles it
    for files); here the primary keys do: undo the operation so far (its
    savepoint in the batch) and draw again.
    """
    while True:
        try:
            conn.execute(content_sql, (int(spid, 16), *content))
            rows, accepted = queue_rows(submission, spid, size, now)
            sql.insert(conn, rows)
        except sqlite3.IntegrityError:
            conn.execute(f"ROLLBACK TO {OP_SAVEPOINT}")
            spid = new_spid()
            continue
        return accepted
