"""The postgres flavour's schema: its tables, migrations, SQL dialect and errors.

SUMMARY
    SCHEMA, SCHEMA_VERSION, MIGRATIONS, Postgres (the Dialect of
    sluice.store._sql), TRANSIENT, where_name(conn), storage_error(exc,
    what), fail(exc).

DESCRIPTION
    What the tables of a shared queue look like (see sluice.store.postgres
    for what each holds), how PostgreSQL spells the statements the two SQL
    flavours share, and how driver errors reach callers: as one-line
    StorageErrors that name the queue, never with the password.

STRATEGIES
    Arrays for sets.  A set of values or of (spid, idx) keys goes as one
    array parameter (``= ANY``, ``unnest``), so an operator's selection of
    thousands of ids is one statement and one round trip.

    Locks in key order.  Rows an operator changes are locked ordered by
    key, so nodes changing the same rows take their locks in the same
    order; a refill skips rows another node has locked.

SEE ALSO
    sluice.store.postgres (the store), sluice.store._sql (shared statements).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import psycopg
from psycopg import errors as pgerrors

from sluice.store import StorageError
from sluice.store._sql import Conn, Dialect

__all__ = ["MIGRATIONS", "SCHEMA", "SCHEMA_VERSION", "TRANSIENT", "Postgres", "fail",
           "storage_error", "where_name"]

#: The version of SCHEMA (kept in sluice_meta); MIGRATIONS[v] takes a
#: queue of version v to v + 1 when it is opened (sluice.store._sql.migrate).
SCHEMA_VERSION = 3

MIGRATIONS: dict[int, tuple[str, ...]] = {
    # 2: the message arrived with SMTPUTF8 (RFC 6531); older mail did not say.
    1: ("ALTER TABLE sluice_queue ADD COLUMN smtputf8 boolean NOT NULL DEFAULT false",),
    # 3: who gave the last reply and when (the NDR's Remote-MTA and
    # Last-Attempt-Date); older replies read as Sluice's own, at no time.
    2: ("ALTER TABLE sluice_queue ADD COLUMN last_mta text",
        "ALTER TABLE sluice_queue ADD COLUMN last_attempt_at double precision"),
}

SCHEMA = """
CREATE TABLE IF NOT EXISTS sluice_queue (
    spid            text COLLATE "C" NOT NULL,
    idx             integer NOT NULL,
    sender          text NOT NULL,
    recipient       text NOT NULL,
    domain          text NOT NULL,
    state           text NOT NULL,
    arrival_at      double precision NOT NULL,
    next_attempt_at double precision NOT NULL,
    attempts        integer NOT NULL DEFAULT 0,
    last_code       integer,
    last_enhanced   text,
    last_text       text,
    priority        smallint NOT NULL DEFAULT 0,
    tenantid        text NOT NULL DEFAULT '',
    jobid           text NOT NULL DEFAULT '',
    transportid     text NOT NULL DEFAULT '',
    localip         text NOT NULL DEFAULT '',
    is_report       boolean NOT NULL DEFAULT false,
    size            bigint NOT NULL DEFAULT 0,
    owner           text,
    smtputf8        boolean NOT NULL DEFAULT false,
    last_mta        text,
    last_attempt_at double precision,
    PRIMARY KEY (spid, idx)
);
CREATE INDEX IF NOT EXISTS sluice_queue_pick ON sluice_queue (state, priority, next_attempt_at);
CREATE INDEX IF NOT EXISTS sluice_queue_refill
    ON sluice_queue (state, tenantid, priority, next_attempt_at, spid, idx);
CREATE INDEX IF NOT EXISTS sluice_queue_domain ON sluice_queue (domain);
CREATE INDEX IF NOT EXISTS sluice_queue_tenant ON sluice_queue (tenantid, jobid);
CREATE INDEX IF NOT EXISTS sluice_queue_tenant_key ON sluice_queue (tenantid, spid, idx);
CREATE INDEX IF NOT EXISTS sluice_queue_state_key ON sluice_queue (state, spid, idx);
CREATE INDEX IF NOT EXISTS sluice_queue_owner ON sluice_queue (owner) WHERE owner IS NOT NULL;
CREATE TABLE IF NOT EXISTS sluice_content (
    spid       text COLLATE "C" NOT NULL,
    chunk      integer NOT NULL,
    data       bytea NOT NULL,
    created_at double precision NOT NULL,
    PRIMARY KEY (spid, chunk)
);
CREATE TABLE IF NOT EXISTS sluice_changes (
    seq    bigserial PRIMARY KEY,
    at     double precision NOT NULL,
    qid    text NOT NULL,
    action text NOT NULL
);
CREATE TABLE IF NOT EXISTS sluice_meta (key text PRIMARY KEY, value text);
"""

#: Errors after which a batch is worth running once more (another node
#: held what it needed).
TRANSIENT = (pgerrors.DeadlockDetected, pgerrors.SerializationFailure,
             pgerrors.LockNotAvailable)


class Postgres(Dialect):
    """PostgreSQL's side of the queue statements (sluice.store._sql)."""

    p = "%s"
    queue = "sluice_queue"
    changes = "sluice_changes"
    meta = "sluice_meta"
    true = "true"
    is_report = "is_report"
    not_report = "NOT is_report"
    # Rows an operator changes are locked, in key order so that nodes
    # changing the same rows take their locks in the same order; a refill
    # or a bounce lease skips the rows another node has locked.
    for_change = " ORDER BY spid, idx FOR UPDATE"
    claim_lock = " FOR UPDATE SKIP LOCKED"

    # Arrays, not a chain of ORs or IN lists: an operator may select
    # thousands of ids, and they go as one parameter.

    def one_of(self, column: str, values: Sequence[Any]) -> tuple[str, list[Any]]:
        """``column = ANY(array)``."""
        return f"{column} = ANY(%s)", [list(values)]

    def keys_in(self, spids: list[str], idxs: list[int]) -> tuple[str, list[Any]]:
        """``(spid, idx) IN unnest(spids, idxs)``."""
        return "(spid, idx) IN (SELECT * FROM unnest(%s::text[], %s::int[]))", [spids, idxs]

    def equal_nocase(self, column: str) -> str:
        """``lower(column) = lower(value)``."""
        return f"lower({column}) = lower(%s)"

    def change_rows(self, conn: Conn, head: str, params: Sequence[Any],
                    rows: Sequence[Sequence[Any]]) -> None:
        """One statement over arrays of the rows' keys."""
        # One statement for all the rows: one round trip.
        conn.execute(f"{head} WHERE (spid, idx) IN (SELECT * FROM unnest(%s::text[], %s::int[]))",
                     (*params, [r[0] for r in rows], [r[1] for r in rows]))

    def executemany(self, conn: Conn, sql: str, params: Sequence[Sequence[Any]]) -> None:
        """Run it with the cursor's executemany."""
        with cast("psycopg.Connection[Any]", conn).cursor() as cur:
            cur.executemany(sql, params)


def where_name(conn: psycopg.Connection[Any]) -> str:
    """Which queue ``conn`` is on, for messages (without the password)."""
    row = conn.execute("SELECT current_schema()").fetchone()
    info = conn.info
    return f"postgres {info.dbname} on {info.host}:{info.port}, schema {row[0] if row else '?'}"


def storage_error(exc: BaseException, what: str) -> StorageError:
    """``exc`` as a one-line StorageError prefixed with ``what``."""
    if isinstance(exc, StorageError):
        return exc
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return StorageError(f"{what}: {text}")


def fail(exc: BaseException) -> BaseException:
    """What an operation's caller sees: driver errors become StorageError."""
    if isinstance(exc, psycopg.Error):
        return storage_error(exc, "postgres queue")
    return exc

