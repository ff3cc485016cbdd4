"""qlist's lines: the one formatter of a queue listing, for every store flavour.

SUMMARY
    QLIST_FIELDS, listing_rows(store, selector, limit), entry_rows(entries),
    qlist_blocks(chunks), write_qlist(out, store, selector, limit, jobs),
    listing_jobs().

DESCRIPTION
    qlist follows Mailismus: semicolon-separated fields (QLIST_FIELDS),
    the first row names them, as csv.writer would write them with ``;``
    and a line break (a field with a ``;``, a quote or a line break is quoted).
    Times are UTC to the second.  The last column (DSN) tells a delivery
    report from a message.

    The format is defined here once, on listing rows (sluice.store's
    LISTING_FIELDS).  A store that reads such rows cheaply hands them out
    itself (sluice.store.ListsRows: the SQL flavours and fs); for kv
    entry_rows() makes them from entries().

STRATEGIES
    Plain rows, one call a row.  Building a QueueEntry, formatting it and
    writing its line cost about 7 of the 10 µs an entry took at a million.
    A listing row is the driver's tuple; fields(row) gives its 17 strings
    in one call, ``";".join`` makes the line, and a chunk of lines (a page
    of the store's) is written as one block of bytes.  (Working a column at
    a time with zip() and map() was slower: a chunk's worth of tuples alive
    at once wakes the cycle collector, which is paused while listing.)

    Times by value.  The entries of one message, and messages queued in
    the same second, share their times: a dict keyed by the stored float
    formats each distinct time once (and datetime once per second).

    csv only where it would quote.  A block whose ``;`` and line breaks
    are exactly the separators, and that has no quote or carriage return,
    is what csv.writer would write; otherwise its lines are checked one by
    one and those that need it go through csv.writer, from the same fields.

    Pieces in other processes.  Listing a million control files of the
    filesystem flavour is mostly opening, reading and parsing them, each
    file on its own (sluice.store.ListsInPieces).  `sluice qlist` has as
    many processes as it may use CPUs read and format the pages while this
    one walks the tree in SPID order and writes their bytes in that order;
    a short listing (under PIECES_ALONE pages) starts none.

SEE ALSO
    sluice.cli.queue_cmds (the command), sluice.store.ListsRows,
    sluice.store._sql.SqlQueue.rows.
"""

from __future__ import annotations

import csv
import gc
import io
import itertools
import os
import re
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from datetime import UTC, datetime
from typing import Any, TextIO

from sluice._workers import worker_context
from sluice.model import QueueEntry, Reply, Selector, format_qid, recipient_domain
from sluice.store import ListsInPieces, ListsRows, Store

__all__ = ["QLIST_FIELDS", "entry_rows", "listing_jobs", "listing_rows", "qlist_blocks",
           "write_qlist"]

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

#: A listing in pieces of fewer than this many is formatted in this process only.
PIECES_ALONE = 8

#: Distinct times a listing keeps formatted (the cache is emptied when full).
_TIMES_MAX = 65536


def _format_second(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%d %H:%M:%S")


class _Times(dict[float, str]):
    """Times formatted to the second, by stored value; datetime once per second.

    Emptied when it holds _TIMES_MAX times.
    """

    def __init__(self) -> None:
        super().__init__()
        self._seconds: dict[int, str] = {}

    def __missing__(self, at: float) -> str:
        if len(self) >= _TIMES_MAX:
            self.clear()
            self._seconds.clear()
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


def _reply(code: Any, enhanced: str | None, text: str | None, mta: str | None) -> str:
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


def _fields_of(times: _Times) -> Callable[[Sequence[Any]], tuple[str, ...]]:
    """The qlist fields (QLIST_FIELDS) of a listing row, times from ``times``."""
    def fields(row: Sequence[Any]) -> tuple[str, ...]:
        (spid, idx, state, sender, recipient, domain, arrival_at, next_attempt_at, attempts,
         priority, tenantid, jobid, transportid, localip, code, enhanced, text, mta, size,
         is_report) = row
        return (
            format_qid(spid, idx), spid, state, sender or "<>", recipient,
            domain or recipient_domain(recipient),  # as QueueEntry: none given, the recipient's
            times[arrival_at], times[next_attempt_at], str(attempts), str(priority), tenantid,
            jobid, transportid, localip, "" if code is None else _reply(code, enhanced, text, mta),
            str(size), "yes" if is_report else "no",
        )

    return fields


def _csv_lines(rows: Iterable[Sequence[str]]) -> str:
    out = io.StringIO()
    csv.writer(out, delimiter=";", lineterminator="\n").writerows(rows)
    return out.getvalue()


def _block(fields: Callable[[Sequence[Any]], tuple[str, ...]], rows: Sequence[Sequence[Any]]
           ) -> str:
    """The qlist lines of ``rows``, each ending in a line break."""
    lines = list(map(";".join, map(fields, rows)))
    block = "\n".join(lines) + "\n"
    if (block.count(";") == _SEPARATORS * len(lines) and block.count("\n") == len(lines)
            and '"' not in block and "\r" not in block):
        return block
    # Some field has a separator, a quote or a line break: csv for its line.
    return "".join(
        line + "\n" if line.count(";") == _SEPARATORS and not _NEEDS_QUOTES.search(line)
        else _csv_lines([fields(row)]) for row, line in zip(rows, lines, strict=True))


def qlist_blocks(chunks: Iterable[Sequence[Sequence[Any]]]) -> Iterator[str]:
    """The qlist text: the header line, then the lines of each chunk of listing rows.

    One block of lines (each ending in a line break) per chunk; no totals.
    """
    yield _csv_lines([QLIST_FIELDS])
    fields = _fields_of(_Times())
    for rows in chunks:
        if rows:
            yield _block(fields, rows)


#: A worker process's formatter (its times are kept from one piece to the next).
_worker_fields: Callable[[Sequence[Any]], tuple[str, ...]] | None = None


def _worker_start() -> None:
    """A worker process's start: its formatter, and no cycle collector (as write_qlist)."""
    global _worker_fields
    gc.disable()
    _worker_fields = _fields_of(_Times())


def _piece_bytes(rows_of: Callable[[Any], list[tuple[Any, ...]]], piece: Any, encoding: str,
                 errors: str, fields: Callable[[Sequence[Any]], tuple[str, ...]] | None = None
                 ) -> bytes:
    """The qlist lines of one piece, encoded; ``fields`` None: a worker's own."""
    fields = fields or _worker_fields
    assert fields is not None
    rows = rows_of(piece)
    return _block(fields, rows).encode(encoding, errors) if rows else b""


def _pieces_in_order(rows_of: Callable[[Any], list[tuple[Any, ...]]], pieces: Iterator[Any],
                     jobs: int, encoding: str, errors: str) -> Iterator[bytes]:
    """Each piece's lines, in order: the first ones here, the rest from ``jobs`` processes.

    A listing of fewer than PIECES_ALONE pieces starts no process.  Forked
    while this process has no other thread, else spawned
    (sluice._workers).  At most
    2 × ``jobs`` pieces are out at once, so memory stays bounded and the
    lines come as the walk goes; a piece's error is raised here, in order.
    """
    first = list(itertools.islice(pieces, PIECES_ALONE))
    if len(first) < PIECES_ALONE:
        fields = _fields_of(_Times())
        yield from (_piece_bytes(rows_of, piece, encoding, errors, fields) for piece in first)
        return
    pool = ProcessPoolExecutor(jobs, mp_context=worker_context(),
                               initializer=_worker_start)
    try:
        out: deque[Future[bytes]] = deque()
        for piece in itertools.chain(first, pieces):
            out.append(pool.submit(_piece_bytes, rows_of, piece, encoding, errors))
            if len(out) >= 2 * jobs:
                yield out.popleft().result()
        while out:
            yield out.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def listing_jobs() -> int:
    """Processes a listing shares its pieces among: twice the CPUs this process may use, up to 8.

    More than one a CPU, for a queue whose files are not in the page
    cache: each waits on the disk as much as it works (a million control
    files, two CPUs: 42 s with four processes against 63 s with two, and
    15.0 against 15.8 s when cached; docs/benchmarks.md).  Never fewer
    than one a CPU.
    """
    cpus = len(os.sched_getaffinity(0))
    return max(cpus, min(2 * cpus, 8))


def write_qlist(out: TextIO, store: Store, selector: Selector, limit: int | None = None,
                jobs: int = 1) -> None:
    """Write the qlist lines of the selected entries to ``out`` (without the totals).

    Each block goes to ``out``'s binary buffer in one write, encoded as
    ``out`` would encode it; a stream without one gets the text.  The cycle
    collector rests meanwhile: a page of rows makes no cycle, and it would
    walk each page several times.  With ``jobs`` above 1, no limit and a
    store that lists in pieces (ListsInPieces), that many other processes
    read and format the pieces while this one walks and writes.
    """
    raw = getattr(out, "buffer", None)
    collecting = gc.isenabled()
    gc.disable()
    try:
        split = None
        if jobs > 1 and limit is None and raw is not None and isinstance(store, ListsInPieces):
            split = store.listing_pieces(selector)
        if split is not None:
            assert raw is not None
            out.write(_csv_lines([QLIST_FIELDS]))
            out.flush()
            for data in _pieces_in_order(*split, jobs, out.encoding, out.errors or "strict"):
                raw.write(data)
            return
        blocks = qlist_blocks(listing_rows(store, selector, limit))
        if raw is None:
            for block in blocks:
                out.write(block)
            return
        out.flush()
        encoding, errors = out.encoding, out.errors or "strict"
        for block in blocks:
            raw.write(block.encode(encoding, errors))
    finally:
        if collecting:
            gc.enable()
