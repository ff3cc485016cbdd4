"""The SQL meta queue on PostgreSQL, for several delivery nodes sharing one queue.

SUMMARY
    PgStore(dsn, node_id=..., pool_size=...) implements sluice.store.Store
    with psycopg 3.  The DSN comes from ``queue.postgres.dsn`` or, when set,
    the environment variable SLUICE_PG_DSN.

DESCRIPTION
    Mailismus's SQL queue (seeds/000 section 4.3.3) keeps one row per
    message per recipient in a table it creates itself (MMTA_SMTPQUEUE).
    So does this flavour, in ``sluice_queue``, created on first use with
    the other tables:

    sluice_queue     one row per recipient entry, keyed by (spid, idx):
                     state, next attempt, attempts, last reply, priority,
                     the policy fields, and ``owner``: the node id of the
                     queue manager that claimed it while it is in flight.
    sluice_content   message content in chunks of at most 64 KB, keyed by
                     (spid, chunk).  Chunk 0 is an empty row that reserves
                     the SPID across nodes.
    sluice_changes   the operator change feed.
    sluice_meta      schema version: opening a queue written by an older
                     Sluice migrates it, in the transaction that creates
                     the tables (sluice.store._sql, "Schema versions");
                     a newer one is refused.

    Why the content is in PostgreSQL too: the nodes that share the queue
    must all be able to deliver every message, and a spool on one node's
    disk is not reachable from the others (a shared network filesystem
    would bring back exactly the remote-spool problems Mailismus warns
    against).  Keeping content in the database also makes "content exists
    while its rows do" a property of one system, and removing the last row
    and the content happen without a filesystem in between.

STRATEGIES
    Claims across nodes.  A refill selects candidates with
    ``FOR UPDATE SKIP LOCKED`` and marks them active with its node id in
    the same transaction, so two nodes never take the same recipient; a
    node only waits for rows nobody else is using.  recover() returns to
    the queue only the in-flight entries that carry this node's id: the
    other nodes are still delivering theirs.

    Group commit.  One committer thread per process runs every write that
    queued up in one transaction, committed with synchronous_commit on: one
    WAL flush for the batch.  If the batch fails (a deadlock with another
    node, a bad operation), it is retried once, then each operation runs in
    its own transaction so that only the failing one fails.

    Content first.  A submitter streams its content with COPY in its own
    transaction, committed with synchronous_commit off (no flush), then
    hands the rows to the committer.  The committer's synchronous commit
    flushes the WAL up to its own commit record, which comes after the
    content's: one flush makes both durable, content first.

    Content is deleted in the transaction that removes its message's last
    row, by a statement that checks no row is left.  When two nodes remove
    the last two rows of a message at the same moment, each may still see
    the other's row; so the messages that kept rows are checked again after
    the commit, and whichever node commits last sees none and deletes the
    content.  A crash in between leaves content without rows, which
    recover() removes once it is an hour old.

INVARIANTS
    Every row is in exactly one state; in-flight rows have an owner.
    Content exists for every spid that has a row.

LIMITATIONS
    A node that never comes back leaves its claims in flight; an operator
    puts them back with ``sluice hold`` and ``sluice release``.  qcount
    counts rows (an index scan; about a second per million recipients).

SEE ALSO
    sluice.store (the interface), sluice.store._pg_schema (tables and
    dialect), sluice.store._pg_commit (the group commit),
    sluice.store._pg_content (the pool and content rows),
    sluice.store.sqlite (the same schema, embedded), seeds/000 section
    4.3.3, docs/storage.md.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import math
import os
from collections.abc import Iterator, Sequence
from typing import IO, TYPE_CHECKING, Any

from sluice.store import StorageError

try:
    import psycopg
except ImportError as exc:  # an optional extra: say which
    raise StorageError(
        "the postgres store needs psycopg: pip install 'sluice-mta[postgres]'") from exc

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
)
from sluice.spool import Content
from sluice.store import (
    CHANGES_KEEP_S,
    ORPHAN_AGE_S,
    Action,
    ApplyByFuture,
    Change,
    Counts,
    StorageError,
    Transition,
    _pg_nodes,
    applied_nothing,
)
from sluice.store._commit import GroupCommitter
from sluice.store._pg_commit import PgBatch, PgCommitting
from sluice.store._pg_content import CHUNK_SIZE, READ_CHUNKS, ContentReader, Pool, write_content
from sluice.store._pg_schema import (
    MIGRATIONS,
    SCHEMA,
    SCHEMA_VERSION,
    Postgres,
    storage_error,
    where_name,
)
from sluice.store._refill import EQUAL, TenantWeights
from sluice.store._sql import COLUMNS, SqlQueue, entry, migrate, queue_rows, reply_columns

if TYPE_CHECKING:
    from sluice.config import Config

__all__ = ["CHUNK_SIZE", "ENV_DSN", "PgStore", "postgres_dsn"]

ENV_DSN = "SLUICE_PG_DSN"


# --------------------------------------------------------------------------
# The store


class PgStore(ApplyByFuture, PgCommitting):
    """Meta queue and content on PostgreSQL; see the module doc."""

    flavour = "postgres"
    shared_access = True
    inline_max = 0  # content always goes to a spool file
    #: Tenants' weights for sharing a refill (from_config: scheduler.tenants).
    tenant_weights: TenantWeights = EQUAL

    def __init__(self, dsn: str, *, node_id: str = "local", pool_size: int = 4,
                 max_batch: int = 2000, connect_timeout_s: float = 10.0) -> None:
        self.dsn = dsn
        self.node_id = node_id
        #: The most entries of one recipient domain this node holds claimed
        #: (0: no cap), and whether the last claim left some behind for it.
        self.per_domain_cap = 0
        self.last_claim_capped = False
        self._connect_timeout = max(1, math.ceil(connect_timeout_s))
        self._closed = False
        self._writer: psycopg.Connection[Any] | None = None
        self._pool = Pool(lambda: self._connect(autocommit=True), max(1, pool_size))
        self._sql = SqlQueue(Postgres(), self._reading)
        conn = self._connect(autocommit=False)
        try:
            with conn.transaction():
                # Two nodes starting at once must not race on CREATE TABLE or
                # on a migration; a refused one rolls back the whole open.
                conn.execute("SELECT pg_advisory_xact_lock(hashtext('sluice schema'))")
                conn.execute(SCHEMA)
                _pg_nodes.ensure(conn)
                migrate(conn, Postgres(), SCHEMA_VERSION, MIGRATIONS, where_name(conn))
        except (psycopg.Error, StorageError) as exc:
            with contextlib.suppress(psycopg.Error):
                conn.close()
            if isinstance(exc, StorageError):
                raise
            raise storage_error(exc, "cannot open the postgres queue") from exc
        self._writer = conn
        self._committer = GroupCommitter(
            self._commit, max_batch=max_batch, name="sluice-pg-commit",
            dropped=lambda op: self._collect_content({op.extra}) if op.extra else None)

    @classmethod
    def from_config(cls, config: Config) -> PgStore:
        """The store a configuration names (queue.postgres)."""
        from sluice.cluster import enabled as cluster_enabled

        q = config.queue
        store = cls(postgres_dsn(config), node_id=config.node.id, pool_size=q.postgres.pool_size,
                    max_batch=q.commit_max_batch)
        if cluster_enabled(config):
            # Several nodes: hold no more of one domain than can start soon.
            store.per_domain_cap = config.cluster.claim_per_destination
        store.tenant_weights = TenantWeights.of(config.scheduler.tenants)
        return store

    # -- connections --------------------------------------------------------------------

    def _connect(self, *, autocommit: bool) -> psycopg.Connection[Any]:
        try:
            conn = psycopg.connect(self.dsn, autocommit=autocommit,
                                   connect_timeout=self._connect_timeout,
                                   application_name=f"sluice {self.node_id}")
        except psycopg.Error as exc:
            raise storage_error(exc, "cannot connect to the postgres queue") from exc
        # Durable on return, whatever the server's default says.
        conn.execute("SET synchronous_commit = on")
        if not autocommit:
            conn.commit()
        return conn

    @contextlib.contextmanager
    def _reading(self) -> Iterator[psycopg.Connection[Any]]:
        if self._closed:
            raise StorageError("the store is closed")
        try:
            with self._pool.connection() as conn:
                yield conn
        except psycopg.Error as exc:
            raise storage_error(exc, "reading the postgres queue failed") from exc

    # -- submission ---------------------------------------------------------------------
    def submit_future(self, submission: Submission, content: Content, now: float
                      ) -> concurrent.futures.Future[Accepted]:
        """Store.submit_future: rows and content in the next group commit."""
        if self._closed:
            raise StorageError("the store is closed")
        spid, size = write_content(self._pool, content, submission.spid)
        rows, accepted = queue_rows(submission, spid, size, now)

        def work(batch: PgBatch) -> Accepted:
            self._sql.insert(batch.conn, rows)
            return accepted

        try:
            fut: concurrent.futures.Future[Accepted] = self._op(work, spid)
        except BaseException:
            self._collect_content({spid})
            raise

        def cleanup(done: concurrent.futures.Future[Accepted]) -> None:
            if not done.cancelled() and done.exception() is not None:
                self._collect_content({spid})  # the rows never came: drop the content

        fut.add_done_callback(cleanup)
        return fut

    def submit(self, submission: Submission, content: Content, now: float) -> Accepted:
        """Store.submit: queue a message and wait until it is durable."""
        result: Accepted = self.submit_future(submission, content, now).result()
        return result

    # -- the queue manager's side -------------------------------------------------------

    def claim(self, limit: int, now: float, quota_deferred: int) -> list[QueueEntry]:
        """Store.claim: FOR UPDATE SKIP LOCKED, so nodes never take the same entry."""
        if limit <= 0:
            return []
        # A queue manager polls often; answer "nothing" from a reader.
        with self._reading() as conn:
            found = conn.execute(
                "SELECT EXISTS (SELECT 1 FROM sluice_queue WHERE state = 'incoming') OR "
                "EXISTS (SELECT 1 FROM sluice_queue WHERE state = 'deferred' AND priority = 1 "
                "AND next_attempt_at <= %s) OR "
                "EXISTS (SELECT 1 FROM sluice_queue WHERE state = 'deferred' AND priority = 0 "
                "AND next_attempt_at <= %s)", (now, now)).fetchone()
        if not found or not found[0]:
            return []
        node = self.node_id

        def work(batch: PgBatch) -> list[QueueEntry]:
            entries, self.last_claim_capped = self._sql.claim(
                batch.conn, limit, now, quota_deferred, node, self.per_domain_cap,
                self.tenant_weights)
            return entries

        result: list[QueueEntry] = self._call(work)
        return result

    def apply_future(self, transitions: Sequence[Transition], *, durable: bool = True,
                     flush_soon: bool = False) -> concurrent.futures.Future[set[str]]:
        """Store.apply_future: runs of deletes and of updates in order, one round trip each."""
        if not transitions:
            return applied_nothing()
        items = []
        for t in transitions:
            spid, idx = parse_qid(t.qid)
            if idx is None:
                raise ValueError(f"a transition needs a full queue id, not {t.qid!r}")
            items.append((spid, idx, t))
        node = self.node_id

        def work(batch: PgBatch) -> set[str]:
            applied: set[str] = set()
            conn = batch.conn
            # Runs of the same kind keep their order and go in one round trip each.
            run: list[tuple[str, int, Transition]] = []
            for item in [*items, None]:
                if run and (item is None or (item[2].state is None) != (run[0][2].state is None)):
                    applied |= self._apply_run(conn, run, node, batch.gone)
                    run = []
                if item is not None:
                    run.append(item)
            return applied

        return self._op(work)

    @staticmethod
    def _apply_run(conn: psycopg.Connection[Any], run: list[tuple[str, int, Transition]],
                   node: str, gone: set[str]) -> set[str]:
        applied: set[str] = set()
        with conn.cursor() as cur:
            if run[0][2].state is None:
                cur.executemany(
                    "DELETE FROM sluice_queue WHERE spid = %s AND idx = %s "
                    "AND (cardinality(%s::text[]) = 0 OR state = ANY(%s::text[])) "
                    "RETURNING spid, idx",
                    [(spid, idx, [str(s) for s in t.expect], [str(s) for s in t.expect])
                     for spid, idx, t in run], returning=True)
            else:
                params = []
                for spid, idx, t in run:
                    assert t.state is not None
                    reply = t.reply
                    params.append((
                        str(t.state), t.next_attempt_at,
                        # code, enhanced, text, mta; the code again, then the time
                        *(reply_columns(reply) if reply is not None else (None,) * 5)[:4],
                        None if reply is None else reply.code,
                        None if reply is None else reply.attempt_at,
                        1 if t.attempted else 0,
                        node if t.state in IN_FLIGHT_STATES else None,
                        spid, idx, [str(s) for s in t.expect], [str(s) for s in t.expect]))
                cur.executemany(
                    "UPDATE sluice_queue SET state = %s, "
                    "next_attempt_at = COALESCE(%s, next_attempt_at), "
                    "last_code = COALESCE(%s, last_code), "
                    "last_enhanced = COALESCE(%s, last_enhanced), "
                    "last_text = COALESCE(%s, last_text), "
                    "last_mta = COALESCE(%s, last_mta), "
                    # A reply without a time replaces the time too.
                    "last_attempt_at = CASE WHEN %s::integer IS NULL THEN last_attempt_at "
                    "ELSE %s::double precision END, "
                    "attempts = attempts + %s, owner = %s "
                    "WHERE spid = %s AND idx = %s "
                    "AND (cardinality(%s::text[]) = 0 OR state = ANY(%s::text[])) "
                    "RETURNING spid, idx", params, returning=True)
            while True:
                for spid, idx in cur.fetchall():
                    applied.add(format_qid(spid, idx))
                    if run[0][2].state is None:
                        gone.add(spid)
                if not cur.nextset():
                    break
        return applied

    def claim_bounces(self, limit: int, now: float, lease_s: float) -> list[QueueEntry]:
        """Store.claim_bounces: entries in the bounce state, leased for the NDR writer."""
        if limit <= 0:
            return []

        def work(batch: PgBatch) -> list[QueueEntry]:
            return self._sql.claim_bounces(batch.conn, limit, now, lease_s)

        result: list[QueueEntry] = self._call(work)
        return result

    def recover(self, now: float) -> int:
        """Store.recover: this node's in-flight entries go back to the queue."""
        node = self.node_id

        def work(batch: PgBatch) -> int:
            conn = batch.conn
            # Only this node's claims: the other nodes are delivering theirs.
            cur = conn.execute(
                "UPDATE sluice_queue SET state = 'deferred', next_attempt_at = %s, owner = NULL "
                "WHERE owner = %s AND state IN ('active', 'delivering')", (now, node))
            conn.execute("DELETE FROM sluice_changes WHERE at < %s", (now - CHANGES_KEEP_S,))
            conn.execute(
                "DELETE FROM sluice_content c WHERE c.created_at < %s AND NOT EXISTS "
                "(SELECT 1 FROM sluice_queue q WHERE q.spid = c.spid)",
                (now - ORPHAN_AGE_S,))
            return int(cur.rowcount)

        result: int = self._call(work)
        return result

    def own_in_flight(self) -> list[QueueEntry]:
        """SharedClaims: this node's attempts that had started (the others' are theirs)."""
        with self._reading() as conn:
            rows = conn.execute(f"SELECT {COLUMNS} FROM sluice_queue WHERE owner = %s "
                                "AND state = 'delivering' ORDER BY spid, idx",
                                (self.node_id,)).fetchall()
        return [entry(r) for r in rows]

    def expired(self, cutoff_at: float, reports_cutoff_at: float, limit: int = 10000
                ) -> list[QueueEntry]:
        """Store.expired: entries past their lifetime (reports by their own cutoff)."""
        return self._sql.expired(cutoff_at, reports_cutoff_at, limit)

    # -- the cluster's nodes (sluice.store._pg_nodes) -------------------------------------

    def heartbeat(self, host: str, started_at: float, now: float, limits: str = "shared"
                  ) -> None:
        """This node is alive (its row in sluice_nodes), its limits so shared."""
        def work(batch: PgBatch) -> None:
            _pg_nodes.heartbeat(batch.conn, self.node_id, host, started_at, now, limits)
        self._call(work)

    def nodes(self) -> list[_pg_nodes.NodeRow]:
        """The nodes that wrote a heartbeat, with their claims in flight."""
        with self._reading() as conn:
            return _pg_nodes.nodes(conn)

    def take_over(self, dead: str, now: float, older_than: float) -> list[QueueEntry]:
        """Return a dead node's claims to the queue (see _pg_nodes.take_over)."""
        def work(batch: PgBatch) -> list[QueueEntry]:
            return _pg_nodes.take_over(batch.conn, dead, now, older_than)
        result: list[QueueEntry] = self._call(work)
        return result

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

        def work(batch: PgBatch) -> list[QueueEntry]:
            return change(batch.conn, batch.gone.update)

        result: list[QueueEntry] = self._call(work)
        return result

    def changes_since(self, seq: int) -> tuple[int, list[Change]]:
        """Store.changes_since: the change log after ``seq``."""
        return self._sql.changes_since(seq)

    # -- reading ------------------------------------------------------------------------

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
        """Store.count: counted by the database (PostgreSQL keeps no totals)."""
        return self._sql.count(selector or Selector())

    def shape(self, selector: Selector, now: float, edges_s: Sequence[float]
              ) -> dict[str, list[int]]:
        """Store.shape: qshape buckets of the selected entries by age."""
        where, params = self._sql.where(selector)
        edges = [float(e) for e in edges_s]
        out: dict[str, list[int]] = {}
        with self._reading() as conn:
            rows = conn.execute(
                "SELECT domain, width_bucket(%s - arrival_at, %s::double precision[]), count(*) "
                f"FROM sluice_queue WHERE {where} GROUP BY 1, 2", [now, edges, *params]
            ).fetchall() if edges else conn.execute(
                f"SELECT domain, 0, count(*) FROM sluice_queue WHERE {where} GROUP BY 1",
                params).fetchall()
        for domain, bucket, n in rows:
            out.setdefault(domain, [0] * (len(edges) + 1))[int(bucket)] += int(n)
        return out

    #: ReadsContentsAhead: a message of one chunk is read ahead.
    ahead_max = CHUNK_SIZE

    def inline_contents(self, spids: Sequence[str]) -> dict[str, bytes]:
        """ReadsContentsAhead.inline_contents: the messages of one chunk, in one round trip.

        The queue manager reads the contents of the deliveries it starts in
        a loop step together, where each delivery's open_content was a round
        trip of its own on the event loop.
        """
        if not spids:
            return {}
        with self._reading() as conn:
            rows = conn.execute(
                "SELECT c.spid, c.data FROM sluice_content c "
                "WHERE c.spid = ANY(%s) AND c.chunk = 1 AND NOT EXISTS "
                "(SELECT 1 FROM sluice_content d WHERE d.spid = c.spid AND d.chunk = 2)",
                (list(spids),), binary=True).fetchall()
        return {str(spid): bytes(data) for spid, data in rows}

    def open_large(self, spid: str) -> IO[bytes]:
        """ReadsContentsAhead.open_large: every content is in the database."""
        return self.open_content(spid)

    def open_content(self, spid: str) -> IO[bytes]:
        """Store.open_content: the message's content from the database."""
        # One round trip for most messages: the chunk count and the first chunks.
        with self._reading() as conn:
            rows = conn.execute(
                "SELECT m.n, c.chunk, c.data FROM "
                "(SELECT max(chunk) AS n FROM sluice_content WHERE spid = %s) AS m "
                "LEFT JOIN sluice_content c ON c.spid = %s "
                "AND c.chunk BETWEEN 1 AND least(m.n, %s) ORDER BY c.chunk",
                (spid, spid, READ_CHUNKS), binary=True).fetchall()
        if not rows or rows[0][0] is None:
            raise StorageError(f"no content for {spid}")
        chunks = int(rows[0][0])
        first = [bytes(r[2]) for r in rows if r[1] is not None]
        if len(first) != min(chunks, READ_CHUNKS):
            raise StorageError(f"the content of {spid} is incomplete")
        return io.BufferedReader(ContentReader(self._pool, spid, chunks, first), CHUNK_SIZE)

    # -- life ---------------------------------------------------------------------------

    def close(self) -> None:
        """Close the committer and the connection pool."""
        if self._closed:
            return
        self._committer.close()
        self._closed = True
        if self._writer is not None:
            with contextlib.suppress(psycopg.Error):
                self._writer.close()
        self._pool.close()

    def __enter__(self) -> PgStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def postgres_dsn(config: Config) -> str:
    """$SLUICE_PG_DSN, else queue.postgres.dsn; ConfigError when neither is set."""
    from sluice.config import ConfigError

    dsn = os.environ.get(ENV_DSN) or config.queue.postgres.dsn
    if not dsn:
        raise ConfigError(config.source, "queue.postgres.dsn",
                          f"the postgres store needs a connection string (or ${ENV_DSN})")
    return dsn
