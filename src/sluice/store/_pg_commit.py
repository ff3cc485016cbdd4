"""The PostgreSQL flavour's commit: one transaction per batch, content collected after.

SUMMARY
    PgCommitting, a part of PgStore: _op(work) queues an operation for the
    group committer; _commit(batch) runs the batch in one transaction on
    the writer connection and settles each operation's future.

DESCRIPTION
    Every write of a node goes through one committer thread and one
    connection (the writer).  A batch is one transaction: the operations
    run in order against a PgBatch, and the content of messages whose last
    row went in the batch is deleted in the same transaction.  Content of
    rows another node was deleting at the same time is looked at again
    after the commit, on a pooled connection.

STRATEGIES
    Only the failing operation fails.  A batch that fails is retried once
    when the failure is transient (a deadlock with another node), and
    otherwise split: each operation runs in its own transaction, so one
    bad operation fails alone and the others commit.

SEE ALSO
    sluice.store.postgres (the store), sluice.store._commit (the group
    committer), sluice.store._pg_schema (errors and their meaning)
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import psycopg

from sluice.store import StorageError
from sluice.store._commit import GroupCommitter, Op
from sluice.store._pg_content import Pool
from sluice.store._pg_schema import TRANSIENT, fail

__all__ = ["PgBatch", "PgCommitting"]


@dataclass(slots=True)
class PgBatch:
    """What the operations of one transaction leave to do after its commit."""

    conn: psycopg.Connection[Any]
    gone: set[str] = field(default_factory=set)


class PgCommitting:
    """The commit machinery of PgStore (a mixin: PgStore sets the attributes)."""

    _writer: psycopg.Connection[Any] | None
    _pool: Pool
    _closed: bool
    _committer: GroupCommitter

    if TYPE_CHECKING:  # PgStore's
        def _connect(self, *, autocommit: bool) -> psycopg.Connection[Any]: ...

    def _writer_conn(self) -> psycopg.Connection[Any]:
        conn = self._writer
        if conn is None or conn.closed or conn.broken:
            if conn is not None:
                with contextlib.suppress(psycopg.Error):
                    conn.close()
            self._writer = None
            conn = self._connect(autocommit=False)
            self._writer = conn
        return conn

    def _run(self, ops: Sequence[Op]) -> tuple[list[Any], set[str]]:
        """Run ``ops`` in one transaction; raises if any of them fails."""
        conn = self._writer_conn()
        batch = PgBatch(conn)
        values = []
        try:
            with conn.transaction():
                for op in ops:
                    values.append(op.work(batch))
                if batch.gone:
                    # Content goes in the same commit as its message's last row.
                    done = conn.execute(
                        "DELETE FROM sluice_content c WHERE c.spid = ANY(%s) AND c.chunk = 0 "
                        "AND NOT EXISTS (SELECT 1 FROM sluice_queue q WHERE q.spid = c.spid) "
                        "RETURNING c.spid", (sorted(batch.gone),)).fetchall()
                    emptied = [r[0] for r in done]
                    if emptied:
                        conn.execute("DELETE FROM sluice_content WHERE spid = ANY(%s)",
                                     (emptied,))
                    # Rows another node is deleting right now may still have been
                    # visible: look again after the commit.
                    batch.gone.difference_update(emptied)
        except BaseException:
            if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                with contextlib.suppress(psycopg.Error):
                    conn.rollback()
            raise
        return values, batch.gone

    def _commit(self, batch: list[Op]) -> None:
        try:
            try:
                values, gone = self._run(batch)
            except TRANSIENT:
                values, gone = self._run(batch)  # a deadlock with another node: once more
        except Exception:
            # One transaction per operation, so that only the failing one fails.
            for op in batch:
                try:
                    try:
                        (value,), op_gone = self._run([op])
                    except TRANSIENT:
                        (value,), op_gone = self._run([op])
                except Exception as exc:
                    op.future.set_exception(fail(exc))
                    continue
                if op_gone:
                    self._collect_content(op_gone)
                op.future.set_result(value)
            return
        if gone:
            self._collect_content(gone)
        for op, value in zip(batch, values, strict=True):
            op.future.set_result(value)

    def _collect_content(self, spids: set[str]) -> None:
        """Delete the content of messages whose last row is gone (after the commit)."""
        try:
            with self._pool.connection() as conn, conn.transaction():
                conn.execute("SET LOCAL synchronous_commit = off")
                conn.execute(
                    "DELETE FROM sluice_content c WHERE c.spid = ANY(%s) AND NOT EXISTS "
                    "(SELECT 1 FROM sluice_queue q WHERE q.spid = c.spid)",
                    (sorted(spids),))
        except (psycopg.Error, StorageError):
            pass  # recover() removes what is left

    def _op(self, work: Callable[[PgBatch], Any], spid: str | None = None
            ) -> concurrent.futures.Future[Any]:
        if self._closed:
            raise StorageError("the store is closed")
        return self._committer.submit(work, extra=spid)

    def _call(self, work: Callable[[PgBatch], Any]) -> Any:
        return self._op(work).result()
