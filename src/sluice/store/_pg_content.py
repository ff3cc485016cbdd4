"""The postgres flavour's connections and message content: a pool, chunk rows in and out.

SUMMARY
    Pool(connect, size), ContentReader(pool, spid, chunks, first),
    write_content(pool, content, wanted) -> (spid, size), CHUNK_SIZE,
    READ_CHUNKS.

DESCRIPTION
    Readers and content writers borrow autocommit connections from a small
    pool; the committer has its own.  A message's content is stored as
    rows of at most CHUNK_SIZE bytes in ``sluice_content``, keyed by
    (spid, chunk); chunk 0 is an empty row that reserves the SPID across
    nodes.

STRATEGIES
    Content first, flushed by the rows' commit.  write_content() streams
    the content with binary COPY in its own transaction committed with
    synchronous_commit off; the committer's synchronous commit of the
    rows that follows flushes the WAL past it, so one flush makes both
    durable, content first.

    Bounded reads.  ContentReader fetches READ_CHUNKS rows per query, so
    reading a big message holds at most that many chunks in memory.

SEE ALSO
    sluice.store.postgres (the store and its commit order).
"""

from __future__ import annotations

import contextlib
import io
import queue as queuelib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg

from sluice.spool import Content, iter_chunks, spid_candidates
from sluice.store._pg_schema import storage_error

__all__ = ["CHUNK_SIZE", "READ_CHUNKS", "ContentReader", "Pool", "write_content"]

#: Content rows hold at most this many bytes.
CHUNK_SIZE = 65536

#: Content rows fetched per query when reading (8 x 64 KB: memory stays bounded).
READ_CHUNKS = 8


class Pool:
    """A few autocommit connections for readers and content writers."""

    def __init__(self, connect: Callable[[], psycopg.Connection[Any]], size: int) -> None:
        self._connect = connect
        self._idle: queuelib.LifoQueue[psycopg.Connection[Any]] = queuelib.LifoQueue()
        self._slots = threading.BoundedSemaphore(size)
        self._all: list[psycopg.Connection[Any]] = []
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def connection(self) -> Iterator[psycopg.Connection[Any]]:
        self._slots.acquire()
        conn: psycopg.Connection[Any] | None = None
        try:
            try:
                conn = self._idle.get_nowait()
            except queuelib.Empty:
                conn = None
            if conn is None or conn.closed or conn.broken:
                conn = self._connect()
                with self._lock:
                    self._all.append(conn)
            yield conn
        finally:
            if conn is not None:
                if conn.closed or conn.broken:
                    with contextlib.suppress(psycopg.Error):
                        conn.close()
                else:
                    if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                        with contextlib.suppress(psycopg.Error):
                            conn.rollback()
                    self._idle.put(conn)
            self._slots.release()

    def close(self) -> None:
        with self._lock:
            for conn in self._all:
                with contextlib.suppress(psycopg.Error):
                    conn.close()
            self._all.clear()


class ContentReader(io.RawIOBase):
    """A message's content, a few chunk rows per query (at most READ_CHUNKS)."""

    def __init__(self, pool: Pool, spid: str, chunks: int, first: list[bytes]) -> None:
        self._pool = pool
        self._spid = spid
        self._chunks = chunks
        self._next = 1 + len(first)
        self._pending = first
        self._buf = memoryview(b"")

    def readable(self) -> bool:
        return True

    def _fetch(self) -> None:
        last = min(self._chunks, self._next + READ_CHUNKS - 1)
        try:
            with self._pool.connection() as conn:
                rows = conn.execute(
                    "SELECT chunk, data FROM sluice_content WHERE spid = %s "
                    "AND chunk BETWEEN %s AND %s ORDER BY chunk",
                    (self._spid, self._next, last), binary=True).fetchall()
        except psycopg.Error as exc:
            raise OSError(f"reading {self._spid} failed: {exc}") from exc
        if [r[0] for r in rows] != list(range(self._next, last + 1)):
            raise OSError(f"chunks {self._next}-{last} of {self._spid} are missing")
        self._pending = [bytes(r[1]) for r in rows]
        self._next = last + 1

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        if not self._buf:
            if not self._pending:
                if self._next > self._chunks:
                    return 0
                self._fetch()
            self._buf = memoryview(self._pending.pop(0))
        n = min(len(view), len(self._buf))
        view[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n


def write_content(pool: Pool, content: Content, wanted: str = "") -> tuple[str, int]:
    """Stream the content into chunk rows; (spid, size).

    The rows go under ``wanted`` if that SPID is free, else under a fresh
    one.  Committed without a flush: the caller's synchronous commit of
    the rows that point at it flushes it.
    """
    created = time.time()
    try:
        with pool.connection() as conn, conn.transaction():
            # Flushed by the committer's synchronous commit that follows.
            conn.execute("SET LOCAL synchronous_commit = off")
            for spid in spid_candidates(wanted):
                row = conn.execute(
                    "INSERT INTO sluice_content (spid, chunk, data, created_at) "
                    "VALUES (%s, 0, '', %s) ON CONFLICT DO NOTHING RETURNING 1",
                    (spid, created)).fetchone()
                if row is not None:
                    break
            else:  # pragma: no cover - 100 collisions in a row
                raise RuntimeError("could not allocate a unique SPID")
            size = 0
            n = 0
            buf = bytearray()
            # Binary COPY: the bytes go as they are, not as escaped text.
            with conn.cursor().copy(
                    "COPY sluice_content (spid, chunk, data, created_at) "
                    "FROM STDIN (FORMAT BINARY)"
            ) as copy:
                copy.set_types(["text", "int4", "bytea", "float8"])
                for piece in iter_chunks(content, CHUNK_SIZE):
                    buf += piece
                    while len(buf) >= CHUNK_SIZE:
                        n += 1
                        copy.write_row((spid, n, bytes(buf[:CHUNK_SIZE]), created))
                        del buf[:CHUNK_SIZE]
                        size += CHUNK_SIZE
                if buf:
                    n += 1
                    copy.write_row((spid, n, bytes(buf), created))
                    size += len(buf)
    except psycopg.Error as exc:
        raise storage_error(exc, "writing the content failed") from exc
    return spid, size
