"""The sqlite flavour's schema: its tables, triggers, migrations and SQL dialect.

SUMMARY
    SCHEMA, SCHEMA_VERSION, MIGRATIONS, Sqlite (the Dialect of
    sluice.store._sql), open_schema(conn, where).

DESCRIPTION
    What the tables of an embedded queue look like (see sluice.store.sqlite
    for what each holds) and how SQLite spells the statements the two SQL
    flavours share.

STRATEGIES
    Counters by trigger.  ``qstats`` holds the count of rows per state and
    of messages; the triggers on ``queue`` keep it equal to COUNT(*) in the
    transaction that changes a row, so counting the whole queue reads seven
    rows, whatever its size.

    One open, one transaction.  open_schema() creates what is missing and
    migrates an older queue (sluice.store._sql.migrate) in a single
    transaction under the write lock, so a refused or failed open leaves
    the queue as it was.

SEE ALSO
    sluice.store.sqlite (the store), sluice.store._sql (shared statements).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from typing import Any, cast

from sluice.store._sql import Conn, Dialect, migrate

__all__ = ["CHECKED", "MIGRATIONS", "SCHEMA", "SCHEMA_VERSION", "Sqlite", "check_whole_queue",
           "open_schema"]

#: The version of SCHEMA (kept in qmeta); MIGRATIONS[v] takes a queue
#: of version v to v + 1 when it is opened (sluice.store._sql.migrate).
SCHEMA_VERSION = 4

MIGRATIONS: dict[int, tuple[str, ...]] = {
    # 2: the message arrived with SMTPUTF8 (RFC 6531); older mail did not say.
    1: ("ALTER TABLE queue ADD COLUMN smtputf8 INTEGER NOT NULL DEFAULT 0",),
    # 3: who gave the last reply and when (the NDR's Remote-MTA and
    # Last-Attempt-Date); older replies read as Sluice's own, at no time.
    2: ("ALTER TABLE queue ADD COLUMN last_mta TEXT",
        "ALTER TABLE queue ADD COLUMN last_attempt_at REAL"),
    # 4: contents in spool segments (table content_at, created with the
    # schema); an older Sluice would not find them, so it must refuse.
    3: (),
}

SCHEMA = """
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
-- refills per tenant: the tenants of a state, and each one's candidates
CREATE INDEX IF NOT EXISTS queue_refill ON queue (state, tenantid, priority, next_attempt_at);
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

-- Where a content kept in a spool segment lies (spool.layout: segments):
-- the segment's number, the offset and the length.
CREATE TABLE IF NOT EXISTS content_at (
    id  INTEGER PRIMARY KEY,
    seg INTEGER NOT NULL,
    off INTEGER NOT NULL,
    len INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS content_at_seg ON content_at (seg, len);
"""


class Sqlite(Dialect):
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
    claim_lock = ""

    # IN lists, not a chain of ORs: SQLite refuses expression trees deeper
    # than 1000, which a selection of many ids would build.

    def one_of(self, column: str, values: Sequence[Any]) -> tuple[str, list[Any]]:
        """``column IN (?, ...)``."""
        return f"{column} IN ({','.join('?' * len(values))})", list(values)

    def keys_in(self, spids: list[str], idxs: list[int]) -> tuple[str, list[Any]]:
        """``(spid, idx) IN (VALUES (?, ?), ...)``."""
        return (f"(spid, idx) IN (VALUES {','.join(['(?,?)'] * len(spids))})",
                [v for key in zip(spids, idxs, strict=True) for v in key])

    def equal_nocase(self, column: str) -> str:
        """``column = ? COLLATE NOCASE``."""
        return f"{column} = ? COLLATE NOCASE"

    # One prepared statement run per row: no round trips in an embedded
    # database, and no limit on the number of rows one change may touch.

    def change_rows(self, conn: Conn, head: str, params: Sequence[Any],
                    rows: Sequence[Sequence[Any]]) -> None:
        """One prepared statement, run once per row."""
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
        """sqlite3's executemany."""
        cast(sqlite3.Connection, conn).executemany(sql, params)


def open_schema(conn: sqlite3.Connection, where: str) -> None:
    """Create what is missing and migrate (sluice.store._sql.migrate).

    All in one transaction; the caller holds the write lock.
    """
    # executescript() commits an open transaction before it starts, so the
    # BEGIN is the script's first statement; the transaction stays open.
    conn.executescript("BEGIN IMMEDIATE;" + SCHEMA)
    try:
        migrate(conn, Sqlite(), SCHEMA_VERSION, MIGRATIONS, where)
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


#: The qmeta key that says check_whole_queue() has run on this queue.
CHECKED = "whole_queue_checked"


def check_whole_queue(conn: sqlite3.Connection) -> None:
    """Repair what only an older version or a hand edit could leave; once a queue.

    Inline content and its rows come and go in one transaction, and the
    triggers keep ``qstats`` in the transaction that changes a row, so
    neither an orphan content row nor a wrong counter can come from a
    crash.  Both checks read every row (2.6 s and 64 MB of page cache at a
    million, under the write lock the receivers need), so they run at the
    first recovery of a queue, and the queue records that they did.
    """
    conn.execute(
        "DELETE FROM content WHERE NOT EXISTS (SELECT 1 FROM queue "
        "WHERE queue.spid = printf('%016X', content.id))"
    )
    conn.execute(
        "UPDATE qstats SET n = (SELECT COUNT(*) FROM queue q WHERE q.state = qstats.key) "
        "WHERE key <> 'messages'"
    )
    conn.execute(
        "UPDATE qstats SET n = (SELECT COUNT(*) FROM (SELECT DISTINCT spid FROM queue)) "
        "WHERE key = 'messages'"
    )
    conn.execute(f"INSERT OR REPLACE INTO qmeta (key, value) VALUES ('{CHECKED}', '1')")
