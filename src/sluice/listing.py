"""qlist's lines: the one formatter of a queue listing, for every store flavour.

SUMMARY
    QLIST_FIELDS, listing_rows(store, selector, limit), entry_rows(entries),
    qlist_blocks(chunks), write_qlist(out, store, selector, limit).

DESCRIPTION
    qlist follows Mailismus: semicolon-separated fields (QLIST_FIELDS),
    the first row names them, as csv.writer would write them with ``;``
    and a line break (a field with a ``;``, a quote or a line break is quoted).
    Times are UTC to the second.  The last column (DSN) tells a delivery
    report from a message.

    The format is defined here once, on listing rows (sluice.store's
    LISTING_FIELDS).  A store that reads such rows cheaply hands them out
    itself (sluice.store.ListsRows, the SQL flavours); for the others
    entry_rows() makes them from entries().

STRATEGIES
    No Python call per row where a C loop does.  A million entries must be
    listed in a few seconds of CPU, and building a QueueEntry, calling a
    function and writing a line per row cost about 7 µs of the 10 an
    entry took.  A chunk of rows (a page of the store's) is turned into
    columns by one zip(); each output column is made by map() over a
    builtin or a dict lookup, or passed through as it is; zip() and
    ``";".join`` make the lines, and a chunk is written as one block of
    bytes.

    Times by value.  The entries of one message, and messages queued in
    the same second, share their times: a dict keyed by the stored float
    formats each distinct time once (and datetime once per second).

    csv only where it would quote.  A block whose ``;`` and line breaks
    are exactly the separators, and that has no quote or carriage return,
    is what csv.writer would write; otherwise its lines are checked one by
    one and those that need it go through csv.writer.

SEE ALSO
    sluice.cli.queue_cmds (the command), sluice.store.ListsRows,
    sluice.store._sql.SqlQueue.rows.
"""

from __future__ import annotations

import csv
import io
import itertools
import re
from collections.abc import Iterable, Iterator, Sequence
from datetime import UTC, datetime
from typing import Any, TextIO

from sluice.model import QueueEntry, Reply, Selector, format_qid, recipient_domain
from sluice.store import ListsRows, Store

__all__ = ["QLIST_FIELDS", "entry_rows", "listing_rows", "qlist_blocks", "write_qlist"]

QLIST_FIELDS = (
    "QueueID", "SPID", "State", "Sender", "Recipient", "Domain", "Arrival", "NextAttempt",
    "Attempts", "Priority", "TenantID", "JobID", "TransportID", "LocalIP", "LastReply",
    "Size", "DSN",
)

#: Rows per chunk that entry_rows() makes (the SQL flavours' pages are theirs).
CHUNK = 5000

#: A line without quoted fields has this many separators, and none of these
#: characters (csv's QUOTE_MINIMAL quotes a field that has one).
_SEPARATORS = len(QLIST_FIELDS) - 1
_NEEDS_QUOTES = re.compile(r'["\r\n]')

#: Distinct times a listing keeps formatted (the cache is emptied when full).
_TIMES_MAX = 65536


def _format_second(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%d %H:%M:%S")


class _Times(dict[float, str]):
    """Times formatted to the second, by stored value; datetime once per second."""

    def __init__(self) -> None:
        super().__init__()
        self._seconds: dict[int, str] = {}

    def __missing__(self, at: float) -> str:
        second = int(at)
        # datetime rounds to the microsecond: near the next second, ask it.
        if at < 0 or at - second >= 0.9999995:
            text = _format_second(at)
        else:
            text = self._seconds.get(second, "")
            if not text:
                text = self._seconds[second] = _format_second(second)
        self[at] = text
        return text

    def trim(self) -> None:
        """Forget everything once the cache is full (between chunks)."""
        if len(self) + len(self._seconds) > _TIMES_MAX:
            self.clear()
            self._seconds.clear()


def _reply(code: Any, enhanced: str | None, text: str | None, mta: str | None) -> str:
    if code is None:
        return ""
    return Reply(int(code), enhanced or "", text or "", mta or "").describe()


def _entry_row(e: QueueEntry) -> tuple[Any, ...]:
    r = e.last_reply
    return (e.spid, e.idx, e.state.value, e.sender, e.recipient, e.domain, e.arrival_at,
            e.next_attempt_at, e.attempts, e.priority, e.tenantid, e.jobid, e.transportid,
            ",".join(e.localip), None if r is None else r.code, r and r.enhanced,
            r and r.text, r and r.remote_mta, e.size, e.is_report)


def entry_rows(entries: Iterable[QueueEntry]) -> Iterator[list[tuple[Any, ...]]]:
    """Listing rows (LISTING_FIELDS) of ``entries``, CHUNK at a time: the default adapter."""
    it = map(_entry_row, entries)
    while rows := list(itertools.islice(it, CHUNK)):
        yield rows


def listing_rows(store: Store, selector: Selector, limit: int | None = None
                 ) -> Iterator[list[tuple[Any, ...]]]:
    """The store's own rows where it lists them (ListsRows), else rows of its entries()."""
    if isinstance(store, ListsRows):
        return store.list_rows(selector, limit=limit)
    return entry_rows(store.entries(selector, limit=limit))


def _fields(rows: Sequence[Sequence[Any]], times: _Times) -> list[tuple[str, ...]]:
    """The qlist fields (QLIST_FIELDS) of each row, worked out a column at a time."""
    n = len(rows)
    (spids, idxs, states, senders, recipients, domains, arrivals, nexts, attempts, priorities,
     tenants, jobs, transports, localips, codes, enhanced, texts, mtas, sizes,
     reports) = zip(*rows, strict=True)
    if not all(domains):  # as QueueEntry: no domain given, the recipient's
        domains = tuple(d or recipient_domain(r)
                        for d, r in zip(domains, recipients, strict=True))
    replies: Iterable[str] = (
        itertools.repeat("", n) if codes.count(None) == n
        else map(_reply, codes, enhanced, texts, mtas))
    return list(zip(
        map(format_qid, spids, idxs), spids, states, [s or "<>" for s in senders],
        recipients, domains, map(times.__getitem__, arrivals),
        map(times.__getitem__, nexts), map(str, attempts), map(str, priorities), tenants,
        jobs, transports, localips, replies, map(str, sizes),
        ["yes" if r else "no" for r in reports], strict=True,
    ))


def _csv_lines(rows: Iterable[Sequence[str]]) -> str:
    out = io.StringIO()
    csv.writer(out, delimiter=";", lineterminator="\n").writerows(rows)
    return out.getvalue()


def qlist_blocks(chunks: Iterable[Sequence[Sequence[Any]]]) -> Iterator[str]:
    """The qlist text: the header line, then the lines of each chunk of listing rows.

    One block of lines (each ending in a line break) per chunk; no totals.
    """
    yield _csv_lines([QLIST_FIELDS])
    times = _Times()
    for rows in chunks:
        if not rows:
            continue
        times.trim()
        fields = _fields(rows, times)
        lines = list(map(";".join, fields))
        block = "\n".join(lines) + "\n"
        if (block.count(";") == _SEPARATORS * len(lines) and block.count("\n") == len(lines)
                and '"' not in block and "\r" not in block):
            yield block
            continue
        # Some field has a separator, a quote or a line break: csv for its line.
        yield "".join(
            line + "\n" if line.count(";") == _SEPARATORS and not _NEEDS_QUOTES.search(line)
            else _csv_lines([row]) for row, line in zip(fields, lines, strict=True))


def write_qlist(out: TextIO, store: Store, selector: Selector, limit: int | None = None
                ) -> None:
    """Write the qlist lines of the selected entries to ``out`` (without the totals).

    Each block goes to ``out``'s binary buffer in one write, encoded as
    ``out`` would encode it; a stream without one gets the text.
    """
    blocks = qlist_blocks(listing_rows(store, selector, limit))
    raw = getattr(out, "buffer", None)
    if raw is None:
        for block in blocks:
            out.write(block)
        return
    out.flush()
    encoding, errors = out.encoding, out.errors or "strict"
    for block in blocks:
        raw.write(block.encode(encoding, errors))
