"""What the two SQL flavours (sqlite, postgres) share: the queue table's
columns, row mapping, selectors as WHERE clauses, and the reads that are
the same in both.

SUMMARY
    COLUMNS, entry(row), Dialect, SqlQueue(dialect, reading)

DESCRIPTION
    Both flavours keep one row per recipient entry with the same columns in
    the same order, so a row maps to a QueueEntry the same way and most
    statements differ only in details.  Those details are a Dialect's: the
    placeholder (``?`` or ``%s``), the table names, how a set of values or
    of (spid, idx) keys is matched (IN lists or arrays), case-insensitive
    equality.  Each flavour defines its Dialect next to its driver.

    SqlQueue holds the statements of one dialect, built once.  Its reads
    (get, entries, count, expired, due_at, changes_since) borrow a
    connection from the flavour's ``reading`` context, which also turns
    driver errors into StorageError.

    Per-row work is what the flavours did before: one tuple out of the
    driver and one QueueEntry per row, no more.

SEE ALSO
    sluice.store.sqlite, sluice.store.postgres, sluice.store (the interface).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from sluice.model import QueueEntry, QueueState, Reply, Selector, parse_qid
from sluice.store import Action, Change, Counts

__all__ = ["COLUMNS", "Conn", "Dialect", "SqlQueue", "entry"]

#: The queue table's columns in the order entry() reads them.
COLUMNS = (
    "spid, idx, sender, recipient, domain, state, arrival_at, next_attempt_at, attempts, "
    "last_code, last_enhanced, last_text, priority, tenantid, jobid, transportid, localip, "
    "is_report, size"
)

#: Rows listed per query by entries().
PAGE = 5000


class Cursor(Protocol):
    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...


class Conn(Protocol):
    """What both drivers' connections offer (sqlite3, psycopg)."""

    def execute(self, sql: str, params: Sequence[Any] = ..., /) -> Cursor: ...


def entry(row: Sequence[Any]) -> QueueEntry:
    """The QueueEntry of a row of COLUMNS."""
    reply = None
    if row[9] is not None:
        reply = Reply(int(row[9]), row[10] or "", row[11] or "")
    return QueueEntry(
        spid=row[0], idx=row[1], sender=row[2], recipient=row[3], domain=row[4],
        state=QueueState(row[5]), arrival_at=row[6], next_attempt_at=row[7],
        attempts=row[8], last_reply=reply, priority=row[12], tenantid=row[13],
        jobid=row[14], transportid=row[15],
        localip=tuple(row[16].split(",")) if row[16] else (),
        is_report=bool(row[17]), size=row[18],
    )


class Dialect:
    """What differs between the SQL flavours; subclasses set and define it."""

    #: The parameter placeholder.
    p: str
    #: The queue table and the change feed table.
    queue: str
    changes: str
    #: A condition that is always true (the WHERE of an empty selector).
    true: str
    #: Conditions on the is_report column.
    is_report: str
    not_report: str

    def one_of(self, column: str, values: Sequence[Any]) -> tuple[str, list[Any]]:
        """A condition that ``column`` is one of ``values`` (not empty), and its
        parameters."""
        raise NotImplementedError

    def keys_in(self, spids: list[str], idxs: list[int]) -> tuple[str, list[Any]]:
        """A condition that (spid, idx) is one of the pairs (not empty), and its
        parameters."""
        raise NotImplementedError

    def equal_nocase(self, column: str) -> str:
        """A condition that ``column`` equals one parameter, ignoring case."""
        raise NotImplementedError


class SqlQueue:
    """The statements of one dialect on the queue table; see the module doc.

    ``reading()`` lends a connection for reads, raising StorageError on
    driver errors.
    """

    def __init__(self, dialect: Dialect,
                 reading: Callable[[], AbstractContextManager[Conn]]) -> None:
        d = self.dialect = dialect
        self._reading = reading
        p, q = d.p, d.queue
        self._select = f"SELECT {COLUMNS} FROM {q} WHERE "
        self._get = f"SELECT {COLUMNS} FROM {q} WHERE spid = {p} AND idx = {p}"
        self._after = f" AND (spid, idx) > ({p}, {p})"
        self._page = f" ORDER BY spid, idx LIMIT {p}"
        self._expired = (
            f"SELECT {COLUMNS} FROM {q} WHERE state = 'deferred' AND "
            f"(({d.not_report} AND arrival_at <= {p}) OR ({d.is_report} AND arrival_at <= {p})) "
            f"LIMIT {p}")
        self._due_at = f"SELECT min(next_attempt_at) FROM {q} WHERE state = 'deferred'"
        self._changes = f"SELECT seq, qid, action FROM {d.changes} WHERE seq > {p} ORDER BY seq"
        self._top = f"SELECT max(seq) FROM {d.changes}"

    # -- selectors ---------------------------------------------------------------------

    def where(self, selector: Selector) -> tuple[str, list[Any]]:
        """SQL condition (without the keyword) and parameters for a selector."""
        d = self.dialect
        clauses: list[str] = []
        params: list[Any] = []
        if selector.qids:
            whole: list[str] = []
            spids: list[str] = []
            idxs: list[int] = []
            for qid in selector.qids:
                spid, idx = parse_qid(qid)
                if idx is None:
                    whole.append(spid)
                else:
                    spids.append(spid)
                    idxs.append(idx)
            ors = []
            if whole:
                clause, more = d.one_of("spid", whole)
                ors.append(clause)
                params += more
            if spids:
                clause, more = d.keys_in(spids, idxs)
                ors.append(clause)
                params += more
            clauses.append("(" + " OR ".join(ors) + ")")
        if selector.states:
            clause, more = d.one_of("state", [str(s) for s in selector.states])
            clauses.append(clause)
            params += more
        for column, value in (("domain", selector.domain), ("tenantid", selector.tenantid),
                              ("jobid", selector.jobid), ("transportid", selector.transportid)):
            if value is not None:
                clauses.append(f"{column} = {d.p}")
                params.append(value)
        for column, value in (("sender", selector.sender), ("recipient", selector.recipient)):
            if value is not None:
                clauses.append(d.equal_nocase(column))
                params.append(value)
        return (" AND ".join(clauses) or d.true), params

    # -- reading -----------------------------------------------------------------------

    def get(self, qid: str) -> QueueEntry | None:
        spid, idx = parse_qid(qid)
        if idx is None:
            raise ValueError(f"get() needs a full queue id, not a SPID: {qid!r}")
        with self._reading() as conn:
            row = conn.execute(self._get, (spid, idx)).fetchone()
        return None if row is None else entry(row)

    def entries(self, selector: Selector, *, after: str | None = None,
                limit: int | None = None) -> Iterator[QueueEntry]:
        """Pages of PAGE rows in key order, each after the last of the previous."""
        where, params = self.where(selector)
        page = PAGE if limit is None else min(limit, PAGE)
        remaining = limit
        cursor: tuple[str, int] | None = None
        if after is not None:
            spid, idx = parse_qid(after)
            cursor = (spid, -1 if idx is None else idx)
        while remaining is None or remaining > 0:
            n = page if remaining is None else min(page, remaining)
            sql = self._select + where
            p = list(params)
            if cursor is not None:
                sql += self._after
                p += cursor
            sql += self._page
            p.append(n)
            with self._reading() as conn:
                rows = conn.execute(sql, p).fetchall()
            for row in rows:
                yield entry(row)
            if len(rows) < n:
                return
            cursor = (rows[-1][0], rows[-1][1])
            if remaining is not None:
                remaining -= len(rows)

    def count(self, selector: Selector) -> Counts:
        """Counts by scanning the selected rows."""
        where, params = self.where(selector)
        q = self.dialect.queue
        with self._reading() as conn:
            rows = conn.execute(
                f"SELECT state, count(*) FROM {q} WHERE {where} GROUP BY state", params
            ).fetchall()
            messages = conn.execute(
                f"SELECT count(DISTINCT spid) FROM {q} WHERE {where}", params
            ).fetchone()
        by_state = {s: 0 for s in QueueState}
        for state, n in rows:
            by_state[QueueState(state)] = int(n)
        return Counts(by_state=by_state, messages=int(messages[0]) if messages else 0)

    def expired(self, cutoff_at: float, reports_cutoff_at: float, limit: int
                ) -> list[QueueEntry]:
        with self._reading() as conn:
            rows = conn.execute(self._expired, (cutoff_at, reports_cutoff_at, limit)).fetchall()
        return [entry(r) for r in rows]

    def due_at(self) -> float | None:
        with self._reading() as conn:
            row = conn.execute(self._due_at).fetchone()
        return None if row is None or row[0] is None else float(row[0])

    def changes_since(self, seq: int) -> tuple[int, list[Change]]:
        with self._reading() as conn:
            rows = conn.execute(self._changes, (seq,)).fetchall()
            if not rows:
                top = conn.execute(self._top).fetchone()
                return max(seq, int(top[0] or 0) if top else 0), []
        changes = [Change(int(r[0]), r[1], Action(r[2])) for r in rows]
        return changes[-1].seq, changes
