"""What the two SQL flavours (sqlite, postgres) share, as one SqlQueue per dialect.

The queue table's columns, row mapping, selectors as WHERE clauses, and
the statements that read and change the queue the same way in both.

SUMMARY
    COLUMNS, entry(row), queue_rows(submission, ...), Dialect,
    SqlQueue(dialect, reading) (its rows() is ListsRows.list_rows),
    migrate(conn, dialect, latest, steps, where)

DESCRIPTION
    Both flavours keep one row per recipient entry with the same columns in
    the same order, so a row maps to a QueueEntry the same way and most
    statements differ only in details.  Those details are a Dialect's: the
    placeholder (``?`` or ``%s``), the table names, how a set of values or
    of (spid, idx) keys is matched (IN lists or arrays), case-insensitive
    equality, how rows are locked when read for a change, and how one
    change is applied to many rows (one statement per row or one over an
    array).  Each flavour defines its Dialect next to its driver.

    SqlQueue holds the statements of one dialect, built once.  Its reads
    (get, entries, count, expired, due_at, changes_since) borrow a
    connection from the flavour's ``reading`` context, which also turns
    driver errors into StorageError.  Its changes (claim, claim_bounces,
    modifier, insert) run on the connection of the flavour's write
    transaction; when and how that commits stays the flavour's business,
    as do the steps that really differ (the "anything to claim?" probe,
    apply, recover, content, qshape).

    Per-row work is what the flavours did before: one tuple out of the
    driver and one QueueEntry per row, one parameter tuple per changed row
    where the dialect runs a statement per row, no more.  A listing
    (rows(), for ``sluice qlist``) does not even build the QueueEntry: it
    hands out the driver's tuples of LISTING_FIELDS a page at a time.

    Schema versions.  The meta table records the version of the schema a
    queue was created or last brought up to.  Each flavour opens a queue
    in one transaction, under a lock every opening process takes: it
    creates what is missing, then migrate() marks a new queue with the
    version of this code, brings an older one up to date one version at a
    time (the flavour's steps, e.g. a column added with a default, so rows
    written before keep working), and refuses a newer one, rolling back
    the whole open: this code would misread tables it does not know.

SEE ALSO
    sluice.store.sqlite, sluice.store.postgres, sluice.store (the interface).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from sluice.model import (
    Accepted,
    QueueEntry,
    QueueState,
    Reply,
    Selector,
    Submission,
    format_qid,
    parse_qid,
    recipient_domain,
)
from sluice.store import LISTING_FIELDS, Action, Change, Counts, StorageError
from sluice.store._actions import EFFECTS, OperatorChange, Value
from sluice.store._refill import (
    EQUAL,
    TenantWeights,
    fair_pick,
    first_reads,
    interleave,
    split_quota,
)

__all__ = ["COLUMNS", "Conn", "Dialect", "SqlQueue", "entry", "migrate", "queue_rows",
           "reply_columns"]

#: The queue table's columns in the order entry() reads them.
COLUMNS = (
    "spid, idx, sender, recipient, domain, state, arrival_at, next_attempt_at, attempts, "
    "last_code, last_enhanced, last_text, priority, tenantid, jobid, transportid, localip, "
    "is_report, size, smtputf8, last_mta, last_attempt_at"
)

#: Rows listed per query by entries() and rows().
PAGE = 5000


class Cursor(Protocol):
    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...


class Conn(Protocol):
    """What both drivers' connections offer (sqlite3, psycopg)."""

    def execute(self, sql: str, params: Sequence[Any] = ..., /) -> Cursor: ...


#: QueueState by value: a dict lookup costs a tenth of QueueState(value),
#: which counts at a million rows listed.
_STATES = {str(s): s for s in QueueState}


def entry(row: Sequence[Any]) -> QueueEntry:
    """The QueueEntry of a row of COLUMNS."""
    reply = None
    if row[9] is not None:
        reply = Reply(int(row[9]), row[10] or "", row[11] or "", row[20] or "", row[21])
    return QueueEntry(
        spid=row[0], idx=row[1], sender=row[2], recipient=row[3], domain=row[4],
        state=_STATES.get(row[5]) or QueueState(row[5]), arrival_at=row[6], next_attempt_at=row[7],
        attempts=row[8], last_reply=reply, priority=row[12], tenantid=row[13],
        jobid=row[14], transportid=row[15],
        localip=tuple(row[16].split(",")) if row[16] else (),
        is_report=bool(row[17]), size=row[18], smtputf8=bool(row[19]),
    )


def reply_columns(reply: Reply) -> tuple[Any, ...]:
    """The values of the last_* columns for ``reply``.

    That is last_code, last_enhanced, last_text, last_mta and
    last_attempt_at; last_mta is '' (not NULL) for a reply Sluice made, so
    that a reply always replaces the one before.
    """
    return (reply.code, reply.enhanced, reply.text, reply.remote_mta, reply.attempt_at)


class Dialect(ABC):
    """What differs between the SQL flavours; subclasses set and define it."""

    #: The parameter placeholder.
    p: str
    #: The queue table, the change feed table and the meta table (key, value).
    queue: str
    changes: str
    meta: str
    #: A condition that is always true (the WHERE of an empty selector).
    true: str
    #: Conditions on the is_report column.
    is_report: str
    not_report: str
    #: Appended to a SELECT of rows about to be changed by an operator.
    for_change: str
    #: What follows the LIMIT of a refill's or a bounce lease's SELECT.
    claim_lock: str

    @abstractmethod
    def one_of(self, column: str, values: Sequence[Any]) -> tuple[str, list[Any]]:
        """A condition that ``column`` is one of ``values`` (not empty), and its parameters."""

    @abstractmethod
    def keys_in(self, spids: list[str], idxs: list[int]) -> tuple[str, list[Any]]:
        """A condition that (spid, idx) is one of the pairs (not empty), and its parameters."""

    @abstractmethod
    def equal_nocase(self, column: str) -> str:
        """A condition that ``column`` equals one parameter, ignoring case."""

    @abstractmethod
    def change_rows(self, conn: Conn, head: str, params: Sequence[Any],
                    rows: Sequence[Sequence[Any]]) -> None:
        """Run the UPDATE or DELETE ``head`` on the rows whose (spid, idx) are in ``rows``.

        ``head`` is all but the WHERE; ``params`` go with it.
        """

    @abstractmethod
    def executemany(self, conn: Conn, sql: str, params: Sequence[Sequence[Any]]) -> None:
        """Run ``sql`` once for each parameter tuple, in one go."""


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
        self._listing = f"SELECT {', '.join(LISTING_FIELDS)} FROM {q} WHERE "
        self._get = f"SELECT {COLUMNS} FROM {q} WHERE spid = {p} AND idx = {p}"
        self._after = f" AND (spid, idx) > ({p}, {p})"
        self._page = f" ORDER BY spid, idx LIMIT {p}"
        self._expired = (
            f"SELECT {COLUMNS} FROM {q} WHERE state = 'deferred' AND "
            f"(({d.not_report} AND arrival_at <= {p}) OR ({d.is_report} AND arrival_at <= {p})) "
            f"LIMIT {p}")
        self._due_at = f"SELECT min(next_attempt_at) FROM {q} WHERE state = 'deferred'"
        # The first row of a state in key order: one step down the state index.
        self._oldest = (f"SELECT arrival_at FROM {q} WHERE state = {p} "
                        "ORDER BY spid, idx LIMIT 1")
        self._changes = f"SELECT seq, qid, action FROM {d.changes} WHERE seq > {p} ORDER BY seq"
        self._top = f"SELECT max(seq) FROM {d.changes}"
        self._log = f"INSERT INTO {d.changes} (at, qid, action) VALUES ({p}, {p}, {p})"
        # A refill's candidates, per tenant (or of all together when tenants
        # are not told apart), each tenant's priority 1 first, then oldest
        # or due first; the tenants with entries in a state are found by
        # skipping along the (state, tenantid, ...) index, one step each.
        pick = f"SELECT {COLUMNS} FROM {q} WHERE state = {p} AND priority = {p}"
        tail = f" ORDER BY next_attempt_at, spid, idx LIMIT {p}{d.claim_lock}"
        self._pick: dict[tuple[bool, bool], str] = {}
        for fair in (True, False):
            head = f"{pick} AND tenantid = {p}" if fair else pick
            self._pick[fair, False] = head + tail
            self._pick[fair, True] = f"{head} AND next_attempt_at <= {p}{tail}"
        self._tenants = (
            f"WITH RECURSIVE t(tenantid) AS (SELECT * FROM (SELECT tenantid FROM {q} "
            f"WHERE state = {p} ORDER BY tenantid LIMIT 1) AS first UNION ALL "
            f"SELECT (SELECT tenantid FROM {q} WHERE state = {p} AND tenantid > t.tenantid "
            "ORDER BY tenantid LIMIT 1) FROM t WHERE t.tenantid IS NOT NULL) "
            "SELECT tenantid FROM t WHERE tenantid IS NOT NULL")
        self._activate = f"UPDATE {q} SET state = 'active', owner = {p}"
        self._bounces = (
            f"SELECT {COLUMNS} FROM {q} WHERE state = 'bounce' AND next_attempt_at <= {p} "
            f"ORDER BY spid, idx LIMIT {p}{d.claim_lock}")
        self._lease = f"UPDATE {q} SET next_attempt_at = {p}"
        self._insert = (
            f"INSERT INTO {q} (spid, idx, sender, recipient, domain, state, arrival_at, "
            "next_attempt_at, priority, tenantid, jobid, transportid, localip, is_report, "
            f"size, smtputf8) VALUES ({','.join([p] * 16)})")

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
        if len(selector.states) == 1:  # plain equality: the state index gives key order
            clauses.append(f"state = {d.p}")
            params.append(str(selector.states[0]))
        elif selector.states:
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
        """The selected entries in key order (see _pages)."""
        for rows in self._pages(self._select, selector, after, limit):
            yield from map(entry, rows)

    def rows(self, selector: Selector, *, limit: int | None = None
             ) -> Iterator[list[tuple[Any, ...]]]:
        """ListsRows.list_rows: the selected entries as LISTING_FIELDS tuples, a page a chunk."""
        return self._pages(self._listing, selector, None, limit)

    def _pages(self, select: str, selector: Selector, after: str | None,
               limit: int | None) -> Iterator[list[tuple[Any, ...]]]:
        """Pages of PAGE rows of ``select`` in key order, each after the last of the previous.

        The rows of ``select`` start with spid, idx.  Each page is one query
        read to its end before it is handed out, so a slow reader (``sluice
        qlist | less``) holds no read snapshot, which in WAL mode would keep
        the writer's log from being checkpointed.
        """
        where, params = self.where(selector)
        page = PAGE if limit is None else min(limit, PAGE)
        remaining = limit
        cursor: tuple[str, int] | None = None
        if after is not None:
            spid, idx = parse_qid(after)
            cursor = (spid, -1 if idx is None else idx)
        while remaining is None or remaining > 0:
            n = page if remaining is None else min(page, remaining)
            sql = select + where
            p = list(params)
            if cursor is not None:
                sql += self._after
                p += cursor
            sql += self._page
            p.append(n)
            with self._reading() as conn:
                rows = conn.execute(sql, p).fetchall()
            if rows:
                yield rows
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

    def oldest(self) -> dict[QueueState, float]:
        """The arrival time of the first entry of each state in key order (= arrival order).

        One index step per state (the state indexes end in spid, idx), no scan.
        """
        out: dict[QueueState, float] = {}
        with self._reading() as conn:
            for state in QueueState:
                row = conn.execute(self._oldest, (str(state),)).fetchone()
                if row is not None:
                    out[state] = float(row[0])
        return out

    def changes_since(self, seq: int) -> tuple[int, list[Change]]:
        with self._reading() as conn:
            rows = conn.execute(self._changes, (seq,)).fetchall()
            if not rows:
                top = conn.execute(self._top).fetchone()
                return max(seq, int(top[0] or 0) if top else 0), []
        changes = [Change(int(r[0]), r[1], Action(r[2])) for r in rows]
        return changes[-1].seq, changes

    # -- changing, on the write transaction's connection -----------------------------------

    def insert(self, conn: Conn, rows: Sequence[tuple[Any, ...]]) -> None:
        """Queue the rows of queue_rows()."""
        self.dialect.executemany(conn, self._insert, rows)

    def _candidates(self, conn: Conn, state: QueueState, due: bool, n: int, now: float,
                    weights: TenantWeights) -> list[tuple[Any, ...]]:
        """Up to ``n`` candidate rows in ``state``, shared between tenants by weight.

        Each tenant's rows priority 1 first, then by next_attempt_at; its
        share of ``n`` plus one read first (first_reads), up to ``n`` only
        when the tenants together have fewer.
        """
        pick = self._pick[weights.fair, due]

        def read(tenant: str | None, k: int) -> list[tuple[Any, ...]]:
            line: list[tuple[Any, ...]] = []
            for prio in (1, 0):
                if len(line) >= k:
                    break
                params = (str(state), prio, *(() if tenant is None else (tenant,)),
                          *((now,) if due else ()), k - len(line))
                line += conn.execute(pick, params).fetchall()
            return line

        if weights.fair:
            rows = conn.execute(self._tenants, (str(state), str(state))).fetchall()
            ask = first_reads(n, [r[0] for r in rows], weights)
            lines = {t: read(t, k) for t, k in ask.items()}
            if sum(map(len, lines.values())) < n:  # some have less than their share
                lines = {t: read(t, n) if len(line) == ask[t] < n else line
                         for t, line in lines.items()}
        else:
            lines = {"": read(None, n)}
        by_tenant = {weights.key(line[0][13]): line for line in lines.values() if line}
        # Turn order: the tenant with the first entry to take goes first.
        first = sorted(by_tenant, key=lambda t: (-by_tenant[t][0][12], by_tenant[t][0][7],
                                                 by_tenant[t][0][0], by_tenant[t][0][1]))
        return fair_pick({t: by_tenant[t] for t in first}, weights, n)

    def claim(self, conn: Conn, limit: int, now: float, quota_deferred: int, node: str,
              per_domain: int = 0, weights: TenantWeights = EQUAL
              ) -> tuple[list[QueueEntry], bool]:
        """Store.claim's selection and marking, on the write connection.

        Also whether ``per_domain`` (the most entries of one recipient domain
        ``node`` may hold claimed; 0: no cap) left candidates behind.
        """
        incoming = self._candidates(conn, QueueState.INCOMING, False, limit, now, weights)
        deferred = self._candidates(conn, QueueState.DEFERRED, True, limit, now, weights)
        take_d, take_i = split_quota(limit, len(incoming), len(deferred), quota_deferred)
        chosen = interleave(incoming[:take_i], deferred[:take_d])
        capped = False
        if chosen and per_domain > 0:
            chosen, capped = self._within_cap(conn, chosen, node, per_domain)
        if chosen:
            self.dialect.change_rows(conn, self._activate, (node,), chosen)
        return [entry((*row[:5], "active", *row[6:])) for row in chosen], capped

    def _within_cap(self, conn: Conn, rows: list[tuple[Any, ...]], node: str, cap: int
                    ) -> tuple[list[tuple[Any, ...]], bool]:
        """The rows that keep ``node`` within ``cap`` claimed entries per domain."""
        domains = sorted({row[4] for row in rows})
        cond, params = self.dialect.one_of("domain", domains)
        held = dict(conn.execute(
            f"SELECT domain, count(*) FROM {self.dialect.queue} WHERE owner = {self.dialect.p} "
            f"AND state IN ('active', 'delivering') AND {cond} GROUP BY domain",
            (node, *params)).fetchall())
        out = []
        for row in rows:
            n = held.get(row[4], 0)
            if n < cap:
                held[row[4]] = n + 1
                out.append(row)
        return out, len(out) < len(rows)

    def claim_bounces(self, conn: Conn, limit: int, now: float, lease_s: float
                      ) -> list[QueueEntry]:
        """Store.claim_bounces's selection and lease, on the write connection."""
        rows = conn.execute(self._bounces, (now, limit)).fetchall()
        until = now + lease_s
        if rows:
            self.dialect.change_rows(conn, self._lease, (until,), rows)
        return [entry((*r[:7], until, *r[8:])) for r in rows]

    def modifier(self, selector: Selector, action: Action, now: float,
                 priority: int | None = None, reply: Reply | None = None
                 ) -> Callable[[Conn, Callable[[set[str]], None]], list[QueueEntry]]:
        """Store.modify as ``work(conn, deleted)`` for the write connection.

        ``work`` calls ``deleted(spids)`` with the messages that lost rows.

        Checked and prepared here, in the caller's thread.
        """
        change = OperatorChange(action, now, priority, reply)
        d = self.dialect
        p, q = d.p, d.queue
        where, params = self.where(selector)
        clause, more = d.one_of("state", [str(s) for s in change.states])
        params += more
        select = f"{self._select}{where} AND {clause}{d.for_change}"
        if change.removes:
            head, values = f"DELETE FROM {q}", ()
        else:
            sets, values = operator_set(change, p)
            head = f"UPDATE {q} SET {sets}"
        log = self._log
        changed = str(action)

        def work(conn: Conn, deleted: Callable[[set[str]], None]) -> list[QueueEntry]:
            rows = conn.execute(select, params).fetchall()
            if not rows:
                return []
            entries = [entry(r) for r in rows]
            d.change_rows(conn, head, values, rows)
            if change.removes:
                deleted({r[0] for r in rows})
            d.executemany(conn, log, [(now, e.qid, changed) for e in entries])
            return entries

        return work


def migrate(conn: Conn, dialect: Dialect, latest: int, steps: Mapping[int, Sequence[str]],
            where: str) -> None:
    """Bring the queue's schema to version ``latest``.

    Runs on ``conn`` inside the transaction that has just created the
    tables of ``latest`` where they were missing, under the flavour's lock
    (see the module doc).  ``steps[v]`` are the statements that take
    version v to v + 1.  A queue newer than ``latest`` is a StorageError
    that names ``where``; the caller's rollback then undoes the open.
    Running it again on an up-to-date queue changes nothing.
    """
    d = dialect
    row = conn.execute(
        f"SELECT value FROM {d.meta} WHERE key = 'schema_version'").fetchone()
    if row is None:  # a new queue: its tables were just created as they are now
        conn.execute(f"INSERT INTO {d.meta} (key, value) VALUES ('schema_version', {d.p})",
                     (str(latest),))
        return
    found = int(row[0])
    if found > latest:
        raise StorageError(f"the queue at {where} has schema version {found}, newer than "
                           f"the {latest} this version of Sluice knows; use a newer Sluice")
    for version in range(found, latest):
        for statement in steps[version]:
            conn.execute(statement)
    if found < latest:
        conn.execute(f"UPDATE {d.meta} SET value = {d.p} WHERE key = 'schema_version'",
                     (str(latest),))


def queue_rows(submission: Submission, spid: str, size: int, now: float
               ) -> tuple[list[tuple[Any, ...]], Accepted]:
    """The rows that queue ``submission`` (for SqlQueue.insert), and its answer."""
    state, next_at = submission.initial_state(now)
    localip = ",".join(submission.localip)
    rows = [
        (spid, i, submission.sender, rcpt, recipient_domain(rcpt), str(state), now,
         next_at, submission.priority, submission.tenantid, submission.jobid,
         submission.transportid, localip, submission.is_report, size, submission.smtputf8)
        for i, rcpt in enumerate(submission.recipients)
    ]
    accepted = Accepted(spid=spid, qids=tuple(format_qid(spid, i) for i in range(len(rows))),
                        size=size)
    return rows, accepted


def operator_set(change: OperatorChange, p: str) -> tuple[str, tuple[Any, ...]]:
    """The SET list of the UPDATE an operator action makes, and its parameters.

    Derived from the action's EFFECTS (sluice.store._actions).
    """
    fields = EFFECTS[change.action]
    if fields is None:
        raise ValueError(f"{change.action} is not an UPDATE")
    sets: list[str] = []
    params: list[Any] = []
    for name, value in fields.items():
        if value is Value.INCOMING_IF_UNTRIED:
            sets.append("state = CASE WHEN attempts = 0 THEN 'incoming' ELSE 'deferred' END")
        elif name == "last_reply":
            reply: Reply = change.resolve(value)
            sets.append(f"last_code = {p}, last_enhanced = {p}, last_text = {p}, "
                        f"last_mta = {p}, last_attempt_at = {p}")
            params += reply_columns(reply)
        elif name == "state":
            state: QueueState = change.resolve(value)
            sets.append(f"state = {p}")
            params.append(str(state))
        else:
            sets.append(f"{name} = {p}")
            params.append(change.resolve(value))
    if "state" in fields:
        # An entry an operator moves is in no manager's hands any more.
        sets.append("owner = NULL")
    return ", ".join(sets), tuple(params)
