"""The idempotency index: a client's key -> the queue id its first request got.

SUMMARY
    index = IdempotencyIndex(path, window_s=86400)
    index.lookup(scope, keys, now) -> {key: Hit}
    index.remember(scope, [Claim(key, fingerprint, qid)], now) -> {key: Hit}
                                          # durable on return; hits are keys known before
    index.remember_all({scope: [Claim, ...]}, now) -> {scope: {key: Hit}}   one fsync
    (submit the message under the queue ids claimed; wait until durable)
    index.confirm(scope, {key: qid})       # the submission is durable
    index.forget(scope, keys)              # the submission failed
    index.settle(exists) -> (confirmed, forgotten)   once, before serving
    index.expire(now) -> int
    fingerprint(recipient, sender); in_store(store)   what settle() compares

DESCRIPTION
    A client that did not see our answer sends again.  With a key per
    recipient (the HTTP injection API's ``idempotency_key``, a sendout's
    hash of job and recipient) the second request is answered with the
    queue id of the first and queued nothing.  Keys live in a scope (the
    API: the token's name) so that two clients cannot collide, and carry
    a fingerprint (recipient and sender) so that a key reused for another
    recipient is caught, not silently answered.

    The index is an SQLite database of its own (``<queue.path>/
    idempotency.db``, WAL), shared by every process of the node that
    opens it.  Keys are kept for ``window_s`` (``api.inject.
    idempotency_window``); expire() removes older ones, so the index is
    bounded by the window's traffic.

STRATEGIES
    Durable relative to the submission: claim first, then submit.  The
    caller draws the message's SPID before submitting (Submission.spid),
    so every recipient's queue id is known in advance.  remember()
    records key -> planned queue id as *pending* and fsyncs (WAL,
    synchronous=FULL) before the message is submitted; after the queue
    has made the message durable, confirm() marks the keys done -- not
    flushed, the next durable write carries it.  A crash between the two
    leaves pending keys that name the queue ids their messages would
    have: settle(), run once before a restarted node serves (and before
    its queue manager has delivered anything), asks the queue for each --
    there with the same recipient: confirmed; not there: forgotten, and
    the client's retry queues the message.  So no store flavour needs
    the key in its own transaction, and none records it there (the
    Store interface has no place for it): the index works alike over
    sqlite, fs, postgres and kv, and the answer "queued as X" is only
    ever given for an X that is, or was, in the queue.

    Concurrent requests with one key: remember() inserts only absent
    keys, in one transaction, and returns the rows that were there
    before -- done (answer with the queue id) or pending (another request
    is queueing it now: the caller says "try again").  Exactly one
    request wins a key.

    A store that draws another SPID than the one planned (two processes
    drew the same one in one millisecond) is confirmed with the queue
    id it really gave.

LIMITATIONS
    One node: with the postgres flavour and several nodes, each node
    keeps its own keys, so a retry that reaches another node is queued
    again.  A message confirmed only in memory, delivered and gone,
    whose node then loses power before the next durable write, is
    forgotten by settle(): a retry after that sends it again.

SEE ALSO
    sluice.api.injector (the HTTP injection API), sluice.smtpd.dedupe
    (resent SMTP messages), docs/api.md, docs/queue.md
"""

from __future__ import annotations

import contextlib
import fcntl
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Protocol

from sluice.model import QueueEntry

__all__ = ["Claim", "Hit", "HitState", "IdempotencyIndex", "fingerprint", "in_store"]


def fingerprint(recipient: str, sender: str) -> str:
    """What a key is bound to: the recipient and sender it was claimed for."""
    return f"{recipient.lower()} {sender.lower()}"


class _Entries(Protocol):
    def get(self, qid: str) -> QueueEntry | None: ...


def in_store(store: _Entries) -> Callable[[str, str], bool]:
    """settle()'s question put to a queue store: is ``qid`` there, as ``fingerprint`` says?

    That is, with the recipient and sender of ``fingerprint``.
    """
    def exists(qid: str, fp: str) -> bool:
        entry = store.get(qid)
        return entry is not None and fingerprint(entry.recipient, entry.sender) == fp

    return exists


class HitState(IntEnum):
    """Where a remembered key stands: claimed, or answered by a durable queue id."""
    PENDING = 0  # claimed; its submission is in flight (or was, at a crash)
    DONE = 1  # its submission is durable; qid is the answer


@dataclass(frozen=True, slots=True)
class Claim:
    """A key to claim for the queue id ``qid`` planned for it."""

    key: str
    fingerprint: str
    qid: str


@dataclass(frozen=True, slots=True)
class Hit:
    """A key the index knows."""

    key: str
    fingerprint: str
    qid: str
    state: HitState
    created_at: float

    @property
    def done(self) -> bool:
        """Whether the key's submission is durable, so ``qid`` is the answer."""
        return self.state is HitState.DONE


_SCHEMA = """
CREATE TABLE IF NOT EXISTS idempotency (
    scope TEXT NOT NULL,
    key TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    qid TEXT NOT NULL,
    state INTEGER NOT NULL,
    created_at REAL NOT NULL,
    PRIMARY KEY (scope, key)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS idempotency_created ON idempotency (created_at);
"""

#: Keys per SQL statement (SQLite's default limit of host parameters is 32766).
_CHUNK = 500


def _chunks(items: Sequence[str]) -> Iterator[Sequence[str]]:
    for i in range(0, len(items), _CHUNK):
        yield items[i:i + _CHUNK]


class IdempotencyIndex:
    """Keys -> queue ids, durable and bounded by a window (thread-safe)."""

    def __init__(self, path: str | Path, window_s: float = 86400.0,
                 clock: Callable[[], float] = time.time) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be positive")
        self.path = Path(path)
        self.window_s = window_s
        self.clock = clock
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._local = threading.local()
        self._all: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        self._connection().executescript(_SCHEMA)

    # -- connections ---------------------------------------------------------------

    def _connection(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self.path, timeout=30.0, isolation_level=None,
                                   check_same_thread=False)
            # Receivers open one index at once; switching a new file to WAL
            # can answer "database is locked" without waiting for the busy
            # timeout, so the switch is made under a lock file of its own.
            with open(f"{self.path}.lock", "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
            self._local.conn = conn
            with self._lock:
                self._all.append(conn)
        return conn

    @contextlib.contextmanager
    def _conn(self, durable: bool = True) -> Iterator[sqlite3.Connection]:
        """One write transaction.

        FULL syncs the WAL at commit, NORMAL leaves it to the next FULL commit
        (or checkpoint).
        """
        conn = self._connection()
        conn.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    def close(self) -> None:
        """Close every thread's connection; a later call opens new ones."""
        with self._lock:
            conns, self._all = self._all, []
        for conn in conns:
            conn.close()
        self._local = threading.local()

    # -- the interface --------------------------------------------------------------

    def _rows(self, conn: sqlite3.Connection, scope: str, keys: Sequence[str],
              since: float) -> dict[str, Hit]:
        out: dict[str, Hit] = {}
        for part in _chunks(list(dict.fromkeys(keys))):
            marks = ",".join("?" * len(part))
            for key, fp, qid, state, created in conn.execute(
                    "SELECT key, fingerprint, qid, state, created_at FROM idempotency "
                    f"WHERE scope = ? AND key IN ({marks}) AND created_at >= ?",
                    (scope, *part, since)):
                out[key] = Hit(key, fp, qid, HitState(state), created)
        return out

    def lookup(self, scope: str, keys: Iterable[str], now: float | None = None
               ) -> dict[str, Hit]:
        """The keys of ``keys`` known within the window."""
        at = self.clock() if now is None else now
        return self._rows(self._connection(), scope, list(keys), at - self.window_s)

    def remember(self, scope: str, claims: Sequence[Claim], now: float | None = None
                 ) -> dict[str, Hit]:
        """Claim keys for their planned queue ids, durably.

        Returns the keys that were known already (within the window), which are
        left as they were.
        """
        return self.remember_all({scope: claims}, now).get(scope, {})

    def remember_all(self, claims: Mapping[str, Sequence[Claim]], now: float | None = None,
                     durable: bool = True) -> dict[str, dict[str, Hit]]:
        """remember() for several scopes in one transaction (one fsync).

        Returns the known keys per scope (scopes with none left out).

        ``durable=False`` leaves the sync to the next durable write: a power
        cut may then lose the claims (never a message: see sluice.smtpd.dedupe).
        """
        at = self.clock() if now is None else now
        for items in claims.values():
            if len(items) != len({c.key for c in items}):
                raise ValueError("a key is claimed twice in one call")
        out: dict[str, dict[str, Hit]] = {}
        with self._conn(durable=durable) as conn:
            for scope, items in claims.items():
                known = self._rows(conn, scope, [c.key for c in items], at - self.window_s)
                if known:
                    out[scope] = known
                # An expired row of the same key is replaced.
                conn.executemany(
                    "INSERT OR REPLACE INTO idempotency "
                    "(scope, key, fingerprint, qid, state, created_at) VALUES (?, ?, ?, ?, ?, ?)",
                    [(scope, c.key, c.fingerprint, c.qid, int(HitState.PENDING), at)
                     for c in items if c.key not in known])
        return out

    def confirm(self, scope: str, done: Mapping[str, str]) -> None:
        """The submissions of these keys are durable, under these queue ids."""
        if not done:
            return
        with self._conn(durable=False) as conn:
            conn.executemany(
                "UPDATE idempotency SET qid = ?, state = ? WHERE scope = ? AND key = ?",
                [(qid, int(HitState.DONE), scope, key) for key, qid in done.items()])

    def forget(self, scope: str, keys: Iterable[str]) -> None:
        """Drop claims whose submission failed (their client will try again)."""
        items = list(keys)
        if not items:
            return
        with self._conn(durable=False) as conn:
            conn.executemany(
                "DELETE FROM idempotency WHERE scope = ? AND key = ? AND state = ?",
                [(scope, key, int(HitState.PENDING)) for key in items])

    def settle(self, exists: Callable[[str, str], bool]) -> tuple[int, int]:
        """After a restart: confirm the pending keys whose queue id exists, forget the rest.

        A pending key whose planned queue id ``exists`` (with that fingerprint)
        is confirmed, any other is forgotten.  Returns (confirmed, forgotten).
        """
        conn = self._connection()
        pending = conn.execute(
            "SELECT scope, key, fingerprint, qid FROM idempotency WHERE state = ?",
            (int(HitState.PENDING),)).fetchall()
        if not pending:
            return 0, 0
        found = {(scope, key) for scope, key, fp, qid in pending if exists(qid, fp)}
        lost = [(scope, key) for scope, key, _, _ in pending if (scope, key) not in found]
        with self._conn(durable=True) as conn:
            conn.executemany("UPDATE idempotency SET state = ? WHERE scope = ? AND key = ?",
                             [(int(HitState.DONE), s, k) for s, k in sorted(found)])
            conn.executemany("DELETE FROM idempotency WHERE scope = ? AND key = ?", lost)
        return len(found), len(lost)

    def expire(self, now: float | None = None) -> int:
        """Remove keys older than the window; returns how many."""
        at = self.clock() if now is None else now
        with self._conn(durable=False) as conn:
            cur = conn.execute("DELETE FROM idempotency WHERE created_at < ?",
                               (at - self.window_s,))
            return int(cur.rowcount)

    def __len__(self) -> int:
        row = self._connection().execute("SELECT count(*) FROM idempotency").fetchone()
        return int(row[0])
