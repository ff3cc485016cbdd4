"""Where bench/relay_floor.py keeps its messages: a journal, or Sluice's SQLite queue.

SUMMARY
    Journal(path, loop)                  append-only file, fdatasync a batch
    SqliteQueue(path, loop, notify=fd)   Sluice's schema, one transaction a batch
    Claimer(path, loop)                  the sending process's side of that queue
    create_schema(path)

DESCRIPTION
    The event loop tells a store three things, each with a callback:
    received (the message must be kept before its 250), sending (the
    attempt starts: the content may go once this returns) and delivered
    (the next hop said 250: the session may be reused once this returns).

    Journal keeps only the first promise, the one every MTA makes before
    its 250: a record a message, fdatasync'ed before the callback.  A
    delivery's record is written with the next batch and waited for by
    nothing.

    SqliteQueue and Claimer keep Sluice's promises with Sluice's own
    schema (indexes, triggers, counters) and the statements of its SQLite
    store: rows a recipient and the content inline on arrival, synced
    before the 250 (a content above Sluice's default inline_max of 64 KiB
    in a file of its own, a batch's files and their directory synced in
    parallel with Sluice's own helpers, as its spool does); "active" when
    claimed and "delivering" as the attempt starts, committed but not
    synced before the content goes (queue.mark_delivering); the rows, the
    content and the message count gone once delivered, synced before the
    session is reused (a success durable before the next message, as in
    Queue.plan_record).  In one process SqliteQueue does all of it and the
    message goes from the receiving side to the sending side in memory;
    with --split the receiving process only inserts and writes a byte to
    a pipe after each commit, and the sending process (Claimer) claims
    what arrived with one UPDATE ... RETURNING and reads the contents with
    one SELECT, as Sluice's queue manager does.

STRATEGIES
    Group commit.  Each store is a Writer: one thread takes whatever the
    loop left pending, applies it as one batch (one write and one sync,
    or one transaction), and calls the batch's callbacks back on the loop,
    so concurrent messages share a sync.

    Sync only what is promised.  A SQLite batch is synced (synchronous=
    FULL) when it holds an arrival or a delivery, and only committed
    (NORMAL) when it holds marks alone.

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

from sluice._fsync import fsync_fds, fsync_path, fsync_paths


class Message:
    """One message: its envelope, its content, and its number in this run."""

    __slots__ = ("content", "mid", "rcpts", "sender")

    def __init__(self, sender: bytes, rcpts: list[bytes], content: bytes, mid: int) -> None:
        self.sender = sender
        self.rcpts = rcpts
        self.content = content
        self.mid = mid

    @property
    def spid(self) -> str:
        """The message's key in the SQLite queue and its spool file's name."""
        return f"{self.mid:016X}"


Op = tuple[str, Message]
Then = Callable[[], None]


class Writer:
    """One thread applies what is pending and calls each waiter back on the loop after."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.pending: list[Op] = []
        self.waiters: list[Then] = []
        self.jobs: list[Callable[[], object]] = []  # run on the thread after the batch
        self.cond = threading.Condition()
        self.closed = False
        #: Told (on the loop) why the writer thread stopped, if it failed
        self.failed: Callable[[str], None] = lambda why: None
        self.thread = threading.Thread(target=self._main, name="writer", daemon=True)
        self.thread.start()

    def received(self, msg: Message, then: Then) -> None:
        """Keep ``msg`` durably, then call ``then``."""
        self._add(("M", msg), then)

    def sending(self, msg: Message, then: Then) -> None:
        """Mark the attempt started, then call ``then`` (the content may go)."""
        self._add(("A", msg), then)

    def delivered(self, msg: Message, then: Then) -> None:
        """Record the delivery, then call ``then`` (the session may be reused)."""
        self._add(("D", msg), then)

    def _add(self, op: Op, then: Then | None) -> None:
        with self.cond:
            self.pending.append(op)
            if then is not None:
                self.waiters.append(then)
            self.cond.notify()

    def _main(self) -> None:
        try:
            self._run()
        except Exception as exc:  # the floor stops with this one line
            self.loop.call_soon_threadsafe(self.failed, f"{type(self).__name__}: {exc!r}")

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.pending and not self.jobs and not self.closed:
                    self.cond.wait()
                if not self.pending and not self.jobs:
                    return
                ops, self.pending = self.pending, []
                waiters, self.waiters = self.waiters, []
                jobs, self.jobs = self.jobs, []
            if ops:
                self.write(ops)
            if waiters:
                self.loop.call_soon_threadsafe(_call_all, waiters)
            for job in jobs:
                job()

    def write(self, ops: list[Op]) -> None:
        """Apply one batch (each store its own way)."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop the thread once what is pending is written."""
        with self.cond:
            self.closed = True
            self.cond.notify()
        self.thread.join()


class Journal(Writer):
    """An append-only file: a record a message, fdatasync'ed a batch, before the 250."""

    def __init__(self, path: Path, loop: asyncio.AbstractEventLoop) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        fsync_path(str(path.parent))  # the new file's name, before any 250 relies on it
        super().__init__(loop)

    def sending(self, msg: Message, then: Then) -> None:
        """No mark: the content goes at once."""
        then()

    def delivered(self, msg: Message, then: Then) -> None:
        """A record written with the next batch; the session is reused at once."""
        self._add(("D", msg), None)
        then()

    def write(self, ops: list[Op]) -> None:
        """The batch's records in one writev; one fdatasync if a message is among them."""
        records: list[bytes] = []
        arrivals = False
        for kind, msg in ops:
            if kind == "M":
                arrivals = True
                records += [b"M %d %s %s %d\n" % (msg.mid, msg.sender, b" ".join(msg.rcpts),
                                                  len(msg.content)), msg.content]
            else:
                records.append(b"D %d\n" % msg.mid)
        for at in range(0, len(records), 1024):  # IOV_MAX
            os.writev(self.fd, records[at:at + 1024])
        if arrivals:
            os.fdatasync(self.fd)

    def close(self) -> None:
        """Stop the thread, then close the file."""
        super().close()
        os.close(self.fd)


class SqliteQueue(Writer):
    """Sluice's own SQLite schema and the statements of a message's life, nothing around them.

    ``notify``: a pipe to write a byte to after each commit with arrivals
    (the receiving process of --split).  ``claims``: whether entries are
    claimed ("active") elsewhere (Claimer); in one process the mark makes
    them active first.
    """

    def __init__(self, path: Path, loop: asyncio.AbstractEventLoop,
                 notify: int | None = None, claims: bool = False) -> None:
        if not claims:
            create_schema(path)
        self.db = connect(path)
        self.synchronous = ""
        self.notify = notify
        self.claims = claims
        self.spool = spool_of(path)
        super().__init__(loop)

    def write(self, ops: list[Op]) -> None:
        """One transaction; synced when it holds an arrival or a delivery."""
        db = self.db
        big = [msg for kind, msg in ops if kind == "M" and len(msg.content) > INLINE_MAX]
        if big:
            spooled(self.spool, big)
        self._sync("FULL" if any(kind != "A" for kind, _ in ops) else "NORMAL")
        files: list[str] = []
        db.execute("BEGIN IMMEDIATE")
        for kind, msg in ops:
            if kind == "M":
                insert(db, msg)
            elif kind == "A":
                if not self.claims:
                    db.execute("UPDATE queue SET state = 'active', owner = 'floor' "
                               "WHERE spid = ? AND +state = 'incoming'", (msg.spid,))
                db.execute("UPDATE queue SET state = 'delivering' "
                           "WHERE spid = ? AND +state = 'active'", (msg.spid,))
            elif not forget(db, msg):
                files.append(msg.spid)
        db.execute("COMMIT")
        for spid in files:  # only once the delete is durable, as Sluice's store does
            os.unlink(self.spool / spid)
        if self.notify is not None and any(kind == "M" for kind, _ in ops):
            os.write(self.notify, b"!")

    def _sync(self, level: str) -> None:
        if level != self.synchronous:
            self.db.execute(f"PRAGMA synchronous = {level}")
            self.synchronous = level

    def close(self) -> None:
        """Stop the thread, then close the database."""
        super().close()
        self.db.close()


#: Contents above this go to a file of their own (Sluice's queue.spool.inline_max).
INLINE_MAX = 65536


def insert(db: sqlite3.Connection, msg: Message) -> None:
    """A new message's rows (one a recipient) and, if small, its content."""
    now = time.time()
    if len(msg.content) <= INLINE_MAX:
        db.execute("INSERT INTO content (id, data) VALUES (?, ?)", (msg.mid, msg.content))
    sender = msg.sender.decode().strip("<>")
    rows = []
    for i, r in enumerate(msg.rcpts):
        rcpt = r.decode().strip("<>")
        rows.append((msg.spid, i, sender, rcpt, rcpt.rpartition("@")[2], now, now,
                     len(msg.content)))
    db.executemany(
        "INSERT INTO queue (spid, idx, sender, recipient, domain, state, arrival_at,"
        " next_attempt_at, size) VALUES (?, ?, ?, ?, ?, 'incoming', ?, ?, ?)", rows)


def forget(db: sqlite3.Connection, msg: Message) -> bool:
    """A delivered message's rows, content row and count gone; False if its content is a file."""
    db.execute("DELETE FROM queue WHERE spid = ?", (msg.spid,))
    db.execute("UPDATE qstats SET n = n - 1 WHERE key = 'messages'")
    return db.execute("DELETE FROM content WHERE id = ? RETURNING id",
                      (msg.mid,)).fetchone() is not None


def spool_of(path: Path) -> Path:
    """The directory beside the queue file for the contents kept apart (synced when new)."""
    spool = path.parent / "spool"
    if not spool.is_dir():
        spool.mkdir(exist_ok=True)
        fsync_path(str(path.parent))
    return spool


def spooled(spool: Path, messages: list[Message]) -> None:
    """Write big contents to files of their own, then sync them and their directory.

    Before the rows' commit, as Sluice's FsSpool.sync does and with its
    helpers: every file and the directory fsync'ed in parallel, so the
    kernel merges them into few journal commits.
    """
    fds = [os.open(spool / msg.spid, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
           for msg in messages]
    try:
        for fd, msg in zip(fds, messages, strict=True):
            os.write(fd, msg.content)
        fsync_paths([str(spool)], also=lambda: fsync_fds(fds))
    finally:
        for fd in fds:
            os.close(fd)


def create_schema(path: Path) -> None:
    """Sluice's SQLite schema in a new queue file (WAL mode), its name synced."""
    from sluice.store._sqlite_schema import SCHEMA

    db = connect(path)
    db.executescript(SCHEMA)
    db.close()
    fsync_path(str(path.parent))


def connect(path: Path) -> sqlite3.Connection:
    """A connection to the queue file in WAL mode, waiting up to 10 s for the other writer."""
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    db.execute("PRAGMA journal_mode = WAL")
    db.execute("PRAGMA busy_timeout = 10000")
    return db


#: Entries one claim takes at most (Sluice's refill asks for a few hundred).
CLAIM_LIMIT = 500


class Claimer(SqliteQueue):
    """The sending process's side of the split: claims, then marks and deletes as above."""

    def __init__(self, path: Path, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(path, loop, claims=True)

    def claim(self, then: Callable[[list[Message], bool], None]) -> None:
        """Claim what arrived; ``then`` gets the messages on the loop, and whether more wait."""
        with self.cond:
            self.jobs.append(lambda: self.loop.call_soon_threadsafe(then, *self._claim()))
            self.cond.notify()

    def _claim(self) -> tuple[list[Message], bool]:
        db = self.db
        self._sync("NORMAL")  # a claim lost in a crash leaves the entries where they were
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
        return [Message(f"<{sender}>".encode(), [f"<{r}>".encode() for _, r in sorted(rcpts)],
                        contents[int(spid, 16)], int(spid, 16))
                for spid, (sender, rcpts) in by_spid.items()], len(rows) >= CLAIM_LIMIT


def _call_all(waiters: list[Callable[[], None]]) -> None:
    for w in waiters:
        w()



