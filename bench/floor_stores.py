"""Where bench/relay_floor.py keeps its messages: a journal, or Sluice's SQLite queue.

SUMMARY
    Journal(path, loop)                  append-only file, fdatasync a batch
    SqliteQueue(path, loop, notify=fd)   Sluice's schema, one transaction a batch
    Claimer(path, loop)                  the other process's side of that queue
    create_schema(path)

DESCRIPTION
    Each is a Writer: one thread takes whatever the event loop left
    pending, applies it, and calls the waiters back on the loop, so
    concurrent messages share a sync (a group commit).  The loop tells a
    writer three things: a message arrived (received: the callback runs
    once it is durable), it goes out now (sending), it was delivered
    (delivered: nothing waits for that).

    SqliteQueue and Claimer make the transitions Sluice's SQLite store
    makes, with its own schema (indexes, triggers, counters): rows a
    recipient and the content inline on arrival (in a file of its own
    above Sluice's default inline_max of 64 KiB, the batch's files and
    their directory synced in parallel as Sluice's spool does), "active" when claimed,
    "delivering" as it goes out, all of it gone once delivered.  In one
    process SqliteQueue does all of it and the message goes from the
    receiving side to the sending side in memory; with --split the
    receiving process only inserts and writes a byte to a pipe after each
    commit, and the sending process claims what arrived with one UPDATE
    ... RETURNING and reads the contents with one SELECT, as Sluice's queue
    manager does.

SEE ALSO
    bench/relay_floor.py
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path

from sluice._fsync import fsync_fds, fsync_paths


class Message:
    __slots__ = ("content", "mid", "rcpts", "sender")

    def __init__(self, sender: bytes, rcpts: list[bytes], content: bytes, mid: int) -> None:
        self.sender = sender
        self.rcpts = rcpts
        self.content = content
        self.mid = mid


Op = tuple[str, Message]


class Writer:
    """One thread applies what is pending and calls each waiter back on the loop after."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.pending: list[Op] = []
        self.waiters: list[Callable[[], None]] = []
        self.cond = threading.Condition()
        self.closed = False
        #: Told (on the loop) why the writer thread stopped, if it failed
        self.failed: Callable[[str], None] = lambda why: None
        self.thread = threading.Thread(target=self._main, name="writer", daemon=True)
        self.thread.start()

    def received(self, msg: Message, then: Callable[[], None]) -> None:
        """Keep ``msg`` durably, then call ``then``."""
        self._add(("M", msg), then)

    def sending(self, msg: Message) -> None:
        """``msg`` goes out now (nothing waits for what this writes)."""

    def delivered(self, msg: Message) -> None:
        """``msg`` is delivered (nothing waits for what this writes)."""
        self._add(("D", msg), None)

    def _add(self, op: Op, then: Callable[[], None] | None) -> None:
        with self.cond:
            self.pending.append(op)
            if then is not None:
                self.waiters.append(then)
            self.cond.notify()

    def _main(self) -> None:
        try:
            self._run()
        except BaseException as exc:
            self.loop.call_soon_threadsafe(self.failed, f"{type(self).__name__}: {exc!r}")
            raise

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.pending and not self.closed:
                    self.cond.wait()
                if not self.pending:
                    return
                ops, self.pending = self.pending, []
                waiters, self.waiters = self.waiters, []
            self.write(ops)
            if waiters:
                self.loop.call_soon_threadsafe(_call_all, waiters)

    def write(self, ops: list[Op]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify()
        self.thread.join()


class Journal(Writer):
    """An append-only file: a record a message and one a delivery, fdatasync'ed a batch."""

    def __init__(self, path: Path, loop: asyncio.AbstractEventLoop) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        super().__init__(loop)

    def write(self, ops: list[Op]) -> None:
        records: list[bytes] = []
        for kind, msg in ops:
            if kind == "M":
                records += [b"M %d %s %s %d\n" % (msg.mid, msg.sender, b" ".join(msg.rcpts),
                                                  len(msg.content)), msg.content]
            else:
                records.append(b"D %d\n" % msg.mid)
        for at in range(0, len(records), 1024):  # IOV_MAX
            os.writev(self.fd, records[at:at + 1024])
        os.fdatasync(self.fd)

    def close(self) -> None:
        super().close()
        os.close(self.fd)


class SqliteQueue(Writer):
    """Sluice's own SQLite schema and the statements of a message's life, nothing around them.

    A row a recipient and the content inline on arrival (committed before
    the 250); "active" then "delivering" as it goes out; the rows, the
    content and the message count gone once delivered -- the transitions
    Sluice's SQLite store makes, with its indexes and triggers, each batch
    one transaction in WAL mode with synchronous=FULL.
    """

    def __init__(self, path: Path, loop: asyncio.AbstractEventLoop,
                 notify: int | None = None) -> None:
        create_schema(path)
        self.db = connect(path, synchronous="FULL")
        self.notify = notify
        self.spool = spool_of(path)
        super().__init__(loop)

    def sending(self, msg: Message) -> None:
        self._add(("A", msg), None)

    def write(self, ops: list[Op]) -> None:
        db = self.db
        now = time.time()
        big = [msg for kind, msg in ops if kind == "M" and len(msg.content) > INLINE_MAX]
        if big:
            spooled(self.spool, big)
        db.execute("BEGIN IMMEDIATE")
        for kind, msg in ops:
            spid = f"{msg.mid:016X}"
            if kind == "M":
                if len(msg.content) <= INLINE_MAX:
                    db.execute("INSERT INTO content (id, data) VALUES (?, ?)",
                               (msg.mid, msg.content))
                sender = msg.sender.decode()
                db.executemany(
                    "INSERT INTO queue (spid, idx, sender, recipient, domain, state, arrival_at,"
                    " next_attempt_at, size) VALUES (?, ?, ?, ?, ?, 'incoming', ?, ?, ?)",
                    [(spid, i, sender, r.decode(), r.rpartition(b"@")[2].decode(), now, now,
                      len(msg.content)) for i, r in enumerate(msg.rcpts)])
            elif kind == "A":
                db.execute("UPDATE queue SET state = 'active', owner = 'floor' "
                           "WHERE spid = ? AND +state = 'incoming'", (spid,))
                marked_and_gone(db, self.spool, kind, msg)
            else:
                marked_and_gone(db, self.spool, kind, msg)
        db.execute("COMMIT")
        if self.notify is not None:
            os.write(self.notify, b"!")

    def close(self) -> None:
        super().close()
        self.db.close()


#: Contents above this go to a file of their own (Sluice's queue.spool.inline_max).
INLINE_MAX = 65536


def spool_of(path: Path) -> Path:
    """The directory beside the queue file for the contents kept apart."""
    spool = path.parent / "spool"
    spool.mkdir(exist_ok=True)
    return spool


def spooled(spool: Path, messages: list[Message]) -> None:
    """Write big contents to files of their own, then sync them and their directory.

    Before the rows' commit, as Sluice's FsSpool.sync does and with its
    helpers: every file and the directory fsync'ed in parallel, so the
    kernel merges them into few journal commits.
    """
    fds = [os.open(spool / f"{msg.mid:016X}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
           for msg in messages]
    try:
        for fd, msg in zip(fds, messages, strict=True):
            os.write(fd, msg.content)
        fsync_paths([str(spool)], also=lambda: fsync_fds(fds))
    finally:
        for fd in fds:
            os.close(fd)


def marked_and_gone(db: sqlite3.Connection, spool: Path, kind: str, msg: Message) -> None:
    """An active message marked "delivering" ("A"), or a delivered one gone ("D")."""
    spid = f"{msg.mid:016X}"
    if kind == "A":
        db.execute("UPDATE queue SET state = 'delivering' WHERE spid = ? AND +state = 'active'",
                   (spid,))
        return
    db.execute("DELETE FROM queue WHERE spid = ?", (spid,))
    unspool(db, spool, msg)
    db.execute("UPDATE qstats SET n = n - 1 WHERE key = 'messages'")


def unspool(db: sqlite3.Connection, spool: Path, msg: Message) -> None:
    """A delivered message's content gone: its row, or else its file."""
    if db.execute("DELETE FROM content WHERE id = ? RETURNING id", (msg.mid,)).fetchone() is None:
        os.unlink(spool / f"{msg.mid:016X}")


def create_schema(path: Path) -> None:
    """Sluice's SQLite schema in a new queue file (WAL mode)."""
    from sluice.store._sqlite_schema import SCHEMA

    db = connect(path, synchronous="FULL")
    db.executescript(SCHEMA)
    db.close()


def connect(path: Path, synchronous: str) -> sqlite3.Connection:
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    db.execute("PRAGMA journal_mode = WAL")
    db.execute(f"PRAGMA synchronous = {synchronous}")
    db.execute("PRAGMA busy_timeout = 10000")
    return db


#: Entries one claim takes at most (Sluice's refill asks for a few hundred).
CLAIM_LIMIT = 500


class Claimer(SqliteQueue):
    """The sending process's side of the split: claims, marks and deletes.

    Its commits are not synced (synchronous=NORMAL): a claim, a mark or a
    delete lost in a crash makes a message go out again, the at-least-once
    window every MTA has; only the arrivals must be durable, and the
    receiving process syncs those.
    """

    def __init__(self, path: Path, loop: asyncio.AbstractEventLoop) -> None:
        self.db = connect(path, synchronous="NORMAL")
        self.notify = None
        self.spool = spool_of(path)
        self.claimed: list[Callable[[list[Message], bool], None]] = []
        Writer.__init__(self, loop)

    def claim(self, then: Callable[[list[Message], bool], None]) -> None:
        """Claim what arrived; ``then`` gets the messages on the loop, and whether more wait."""
        with self.cond:
            self.claimed.append(then)
            self.cond.notify()

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.pending and not self.claimed and not self.closed:
                    self.cond.wait()
                if not self.pending and not self.claimed:
                    return
                ops, self.pending = self.pending, []
                claims, self.claimed = self.claimed, []
            if ops:
                self.write(ops)
            for then in claims:
                self.loop.call_soon_threadsafe(then, *self._claim())

    def _claim(self) -> tuple[list[Message], bool]:
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        rows = db.execute(
            "UPDATE queue SET state = 'active', owner = 'floor' WHERE +state = 'incoming' AND "
            "spid IN (SELECT spid FROM queue WHERE state = 'incoming' "
            "ORDER BY priority DESC, next_attempt_at LIMIT ?) "
            "RETURNING spid, idx, sender, recipient", (CLAIM_LIMIT,)).fetchall()
        by_spid: dict[str, tuple[str, list[tuple[int, str]]]] = {}
        for spid, idx, sender, rcpt in rows:
            by_spid.setdefault(spid, (sender, []))[1].append((idx, rcpt))
        ids = [int(spid, 16) for spid in by_spid]
        contents = dict(db.execute(
            f"SELECT id, data FROM content WHERE id IN ({','.join('?' * len(ids))})", ids)
        ) if ids else {}
        db.execute("COMMIT")
        for spid in by_spid:
            if int(spid, 16) not in contents:
                contents[int(spid, 16)] = (self.spool / spid).read_bytes()
        return [Message(sender.encode(), [r.encode() for _, r in sorted(rcpts)],
                        contents[int(spid, 16)], int(spid, 16))
                for spid, (sender, rcpts) in by_spid.items()], len(rows) >= CLAIM_LIMIT

    def write(self, ops: list[Op]) -> None:
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        for kind, msg in ops:
            marked_and_gone(db, self.spool, kind, msg)
        db.execute("COMMIT")


def _call_all(waiters: list[Callable[[], None]]) -> None:
    for w in waiters:
        w()



