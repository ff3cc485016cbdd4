"""The filesystem flavour's readers: listing, counting, qshape, expiry, the change feed.

SUMMARY
    Reading, a part of FsStore: get, entries, count (and
    count_in_processes), shape, expired, due_at, changes_since,
    open_content.

DESCRIPTION
    Readers walk the tree without the queue's lock.  In-process readers
    take the store's read lock per piece of work (never while a caller
    holds a generator suspended), so they see whole batches; a reader in
    another process may see a file between two directories while a batch
    is applied.  Counting reads directory names only (the state is the
    directory, the recipient count is in the name); selections by sender,
    tenant, job or transport, qshape and expiry read the files.  The
    listing qlist prints (list_rows) makes its rows from each file's JSON
    with no entry objects, in pages that `sluice qlist` may have other
    processes read (listing_pieces).

SEE ALSO
    sluice.store.fs, sluice.store._fs_files
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import operator
import os
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from sluice.listing import entry_rows
from sluice.model import QueueEntry, QueueState, Selector, parse_qid
from sluice.spool import spid_time
from sluice.spool.fs import FsSpool
from sluice.store import Action, Change, Counts, StorageError
from sluice.store._commit import RWLock
from sluice.store._fs_buckets import BUCKET_DIGITS, sorted_buckets
from sluice.store._fs_counts import CountsFile
from sluice.store._fs_due import DueTimes, stamped
from sluice.store._fs_files import (
    STATE_DIRS,
    Control,
    Name,
    NameFilter,
    listdir,
    names_suffice,
    page_rows,
    parse_name,
    read_control,
    read_page,
    rows_of_page,
    spid_of_name,
    state_of,
)
from sluice.store._fs_oldest import OldestSpids
from sluice.store._fs_tally import tally as tally_names

#: Messages entries() reads under one hold of the read lock.
LIST_PAGE = 200
#: How long count() waits for a check of this process before it lists the tree itself.
CHECK_WAIT_S = 60.0


class Reading:
    """The read side of FsStore (a mixin: FsStore sets the attributes)."""

    root: Path
    spool: FsSpool
    _rw: RWLock
    _counts: CountsFile
    _feed_cursor: tuple[tuple[int, int], int, int]
    _due_times: DueTimes  # of directories not wholly due (shared with the refill)
    _oldest: OldestSpids  # oldest()'s, by directory

    if TYPE_CHECKING:  # Checking's, through FsStore
        def wait_check(self, timeout: float | None = None) -> bool: ...

    def expired(self, cutoff_at: float, reports_cutoff_at: float, limit: int = 10000
                ) -> list[QueueEntry]:
        out: list[QueueEntry] = []
        for ctrl in self._controls((QueueState.DEFERRED,)):
            cutoff = reports_cutoff_at if ctrl.meta.is_report else cutoff_at
            if ctrl.meta.arrival_at <= cutoff:
                out += ctrl.entries()
                if len(out) >= limit:
                    return out[:limit]
        return out

    def due_at(self) -> float | None:
        """The earliest due time: of the first deferred directory with a file in it.

        Each file's time is read once and kept by its stamp (_fs_due): a
        queue manager asks after every refill that found too little.
        """
        with self._rw.reading():
            for t in sorted(int(d) for d in listdir(self.root / "deferred") if d.isdigit()):
                rel_dir = f"deferred/{t}"

                def read(name: str, rel_dir: str = rel_dir) -> float | None:
                    ctrl = read_control(self.root, f"{rel_dir}/{name}")
                    return None if ctrl is None else ctrl.next_at

                times = self._due_times.of(rel_dir, stamped(self.root / rel_dir), read)
                if times:
                    return min(at for _, at in times)
        return None

    def changes_since(self, seq: int) -> tuple[int, list[Change]]:
        path = self.root / "changes.log"
        out: list[Change] = []
        top = seq
        try:
            with open(path, "rb") as f:
                # A queue manager polls with the seq we answered last time:
                # start where that answer ended, unless the file was rewritten.
                st = os.fstat(f.fileno())
                inode, last_seq, offset = self._feed_cursor
                if inode == (st.st_dev, st.st_ino) and seq == last_seq and offset <= st.st_size:
                    f.seek(offset)
                end = f.tell()
                for raw in f:
                    if not raw.endswith(b"\n"):
                        break  # a line being written: next time
                    end += len(raw)
                    parts = raw.decode("utf-8", "replace").rstrip("\n").split("\t")
                    if len(parts) != 4 or not parts[0].isdigit():
                        continue
                    n = int(parts[0])
                    if n <= seq:
                        continue
                    with contextlib.suppress(ValueError):
                        out.append(Change(n, parts[2], Action(parts[3])))
                        top = max(top, n)
                self._feed_cursor = ((st.st_dev, st.st_ino), top, end)
        except FileNotFoundError:
            pass
        return top, out

    # -- reading --------------------------------------------------------------------------

    def _dirs(self, states: Iterable[QueueState]) -> list[str]:
        out = []
        for state in dict.fromkeys(states):
            if state is QueueState.DEFERRED:
                out += [f"deferred/{t}" for t in
                        sorted(int(d) for d in listdir(self.root / "deferred") if d.isdigit())]
            elif state is QueueState.INCOMING:
                out += [f"incoming/{b}" for b in sorted_buckets(listdir(self.root / "incoming"))]
            else:
                out.append(STATE_DIRS[state])
        return out

    def _walk(self, states: Iterable[QueueState], selector: Selector | None = None
              ) -> Iterator[tuple[Name, str]]:
        """(parsed name, relative path) of every control file in ``states``, a directory at a time.

        Each directory is listed under the read lock; its names are parsed
        without parse_name's cache, which a walk of a million names would
        only churn, and only one directory's names are held at a time.
        """
        may_match = NameFilter(selector)
        with self._rw.reading():
            rel_dirs = self._dirs(states)
        for rel_dir in rel_dirs:
            with self._rw.reading():
                names = listdir(self.root / rel_dir)
            for name in names:
                parsed = parse_name.__wrapped__(name)
                if parsed is not None and may_match(parsed):
                    yield parsed, f"{rel_dir}/{name}"

    def _controls(self, states: Iterable[QueueState], selector: Selector | None = None
                  ) -> Iterator[Control]:
        """Every control file in ``states`` the selector may pick, read in pieces.

        The read lock is held per piece, never while the caller has the
        generator suspended, so a caller may write to the store meanwhile.
        Expiry reads every deferred file this way: its memory is a piece
        and a directory's names, not a list of the whole backlog.
        """
        walk = self._walk(states, selector)
        while found := list(itertools.islice(walk, 500)):
            with self._rw.reading():
                piece = [read_control(self.root, rel) for _, rel in found]
            yield from (c for c in piece if c is not None)

    def get(self, qid: str) -> QueueEntry | None:
        spid, idx = parse_qid(qid)
        if idx is None:
            raise ValueError(f"get() needs a full queue id, not a SPID: {qid!r}")
        for ctrl in self._controls(tuple(QueueState), Selector(qids=(spid,))):
            for e in ctrl.entries():
                if e.idx == idx:
                    return e
        return None

    def _in_spid_order(self, states: Sequence[QueueState], selector: Selector,
                       after_spid: str | None) -> Iterator[tuple[str, list[str]]]:
        """(SPID, paths of its control files) of ``states``, in SPID order.

        The directories of other states are listed first, the incoming
        buckets as the walk reaches them: a bucket's name starts with its
        files' SPIDs, so the first lines of a million come after the
        first buckets, not after every name.
        """
        may_match = NameFilter(selector)
        incoming = QueueState.INCOMING in states
        with self._rw.reading():
            dirs = self._dirs([s for s in states if s is not QueueState.INCOMING])
            buckets = sorted_buckets(listdir(self.root / "incoming")) if incoming else []

        def listed(rel_dirs: Iterable[str]) -> list[tuple[str, str]]:
            out = []
            for rel_dir in rel_dirs:
                with self._rw.reading():
                    names = listdir(self.root / rel_dir)
                if may_match.everything:  # only the SPID is needed: no Name built
                    for name in names:
                        spid = spid_of_name(name)
                        if spid is not None and (after_spid is None or spid >= after_spid):
                            out.append((spid, f"{rel_dir}/{name}"))
                    continue
                for name in names:
                    parsed = parse_name.__wrapped__(name)  # not through the cache
                    if parsed is not None and may_match(parsed) and (
                            after_spid is None or parsed.spid >= after_spid):
                        out.append((parsed.spid, f"{rel_dir}/{name}"))
            out.sort()
            return out

        by_digits: dict[str, list[str]] = defaultdict(list)  # priorities and tenants together
        for bucket in buckets:
            by_digits[bucket[3:3 + BUCKET_DIGITS]].append(f"incoming/{bucket}")

        def incoming_files() -> Iterator[tuple[str, str]]:
            for digits in sorted(by_digits):
                if after_spid is None or digits >= after_spid[:BUCKET_DIGITS]:
                    yield from listed(by_digits[digits])

        merged = heapq.merge(listed(dirs), incoming_files())
        for spid, group in itertools.groupby(merged, key=operator.itemgetter(0)):
            yield spid, [rel for _, rel in group]

    def entries(self, selector: Selector, *, after: str | None = None,
                limit: int | None = None) -> Iterator[QueueEntry]:
        states = selector.states or tuple(QueueState)
        cursor: tuple[str, int] | None = None
        if after is not None:
            spid, idx = parse_qid(after)
            cursor = (spid, -1 if idx is None else idx)
        walk = self._in_spid_order(states, selector, None if cursor is None else cursor[0])
        remaining = limit
        while True:
            chunk = list(itertools.islice(walk, LIST_PAGE))
            if not chunk:
                return
            out: list[QueueEntry] = []
            with self._rw.reading():
                for _, rels in chunk:
                    message: dict[int, QueueEntry] = {}
                    for rel in rels:
                        ctrl = read_control(self.root, rel)
                        if ctrl is not None:
                            # A file that moved while the walk listed appears once.
                            message.update((e.idx, e) for e in ctrl.entries())
                    out += [e for _, e in sorted(message.items()) if selector.matches(e)
                            and (cursor is None or (e.spid, e.idx) > cursor)]
            for e in out:
                if remaining is not None:
                    if remaining <= 0:
                        return
                    remaining -= 1
                yield e

    def list_rows(self, selector: Selector, *, limit: int | None = None
                  ) -> Iterator[list[tuple[Any, ...]]]:
        """ListsRows.list_rows: rows straight from the files' JSON, no QueueEntry.

        Only for a selection the walk's names and directories answer (by
        state or domain); any other goes through entries() and
        Selector.matches, the reference.  (A thread reading the next page's
        files while this one made rows was tried: 6 % slower at a million,
        as both need the GIL between the system calls; other processes
        can share that work: listing_pieces.)
        """
        if not names_suffice(selector):
            yield from entry_rows(self.entries(selector, limit=limit))
            return
        remaining = -1 if limit is None else limit
        for piece in self._pages(selector):
            if not remaining:
                return
            with self._rw.reading():  # the reads only; the rows are made after
                files = read_page(piece)
            out = rows_of_page(piece[0], files)
            if remaining > 0:
                out = out[:remaining]
                remaining -= len(out)
            if out:
                yield out

    def listing_pieces(self, selector: Selector
                       ) -> tuple[Callable[[Any], list[tuple[Any, ...]]], Iterator[Any]] | None:
        """ListsInPieces.listing_pieces: the pages list_rows reads, for other processes.

        A page is the queue's directory, the selected states and the
        paths of LIST_PAGE messages; page_rows() reads it anywhere.  (A
        reader in another process does not take this process's read lock:
        it may see a file between two directories while a batch of this
        process is applied, as `sluice qlist` beside `sluice serve` may.)
        """
        if not names_suffice(selector):
            return None
        return page_rows, self._pages(selector)

    def _pages(self, selector: Selector
               ) -> Iterator[tuple[str, tuple[QueueState, ...], list[list[str]]]]:
        states = selector.states or tuple(QueueState)
        walk = self._in_spid_order(states, selector, None)
        root = str(self.root)
        while page := list(itertools.islice(walk, LIST_PAGE)):
            yield root, selector.states, [rels for _, rels in page]

    def oldest(self) -> dict[QueueState, float]:
        """The oldest entry of each state, by its SPID's time (see Store.oldest).

        The state is the directory and the SPID is in the name: no file
        read, and a directory listed again only once it changed
        (sluice.store._fs_oldest).
        """
        out: dict[QueueState, float] = {}
        seen: set[Path] = set()
        for state in QueueState:
            with self._rw.reading():
                rel_dirs = self._dirs((state,))
            firsts = []
            for rel_dir in rel_dirs:
                path = self.root / rel_dir
                seen.add(path)
                with self._rw.reading():
                    first = self._oldest.of(path)
                if first is not None:
                    firsts.append(first)
            if firsts:
                out[state] = spid_time(min(firsts))
        self._oldest.keep_only(seen)
        return out

    def count(self, selector: Selector | None = None) -> Counts:
        """Store.count: the committer's totals, else from names, else from the files.

        The whole queue is read from ``counts`` when it can be trusted
        (sluice.store._fs_counts); otherwise, and for a selection by state
        or domain, from the names, a few directories at a time under the
        read lock.
        """
        return self.count_in_processes(selector, 1)

    def count_in_processes(self, selector: Selector | None, jobs: int) -> Counts:
        """CountsInProcesses.count_in_processes: count, its names shared among ``jobs`` processes.

        Only a count by names is shared, and only one that promises to be
        long (sluice.store._fs_tally); the totals and a count that reads
        the files are this process's.
        """
        if selector is None or selector.is_empty:
            tally = self._counts.trusted()
            if tally is None and self.wait_check(CHECK_WAIT_S):
                # This process's check (after a restart) counts them sooner
                # than a listing of our own would.
                tally = self._counts.trusted()
            if tally is not None:
                return Counts(by_state=dict(tally.by_state), messages=tally.messages)
        by_state = {s: 0 for s in QueueState}
        if selector is None or selector.is_empty or names_suffice(selector):
            states = tuple(QueueState) if selector is None or not selector.states \
                else selector.states
            with self._rw.reading():
                rel_dirs = self._dirs(states)
            found = tally_names(self.root, rel_dirs, NameFilter(selector).domain, jobs,
                                self._rw.reading)
            for rel_dir, n in zip(rel_dirs, found.per_dir, strict=True):
                by_state[state_of(rel_dir)] += n
            return Counts(by_state=by_state, messages=len(found.spids))
        spids: set[str] = set()
        states = selector.states or tuple(QueueState)
        for ctrl in self._controls(states, selector):
            for e in ctrl.entries():
                if selector.matches(e):
                    by_state[e.state] += 1
                    spids.add(e.spid)
        return Counts(by_state=by_state, messages=len(spids))

    def shape(self, selector: Selector, now: float, edges_s: Sequence[float]
              ) -> dict[str, list[int]]:
        edges = list(edges_s)
        out: dict[str, list[int]] = {}
        for ctrl in self._controls(selector.states or tuple(QueueState), selector):
            for e in ctrl.entries():
                if not selector.matches(e):
                    continue
                age = now - e.arrival_at
                bucket = next((i for i, edge in enumerate(edges) if age < edge), len(edges))
                out.setdefault(e.domain, [0] * (len(edges) + 1))[bucket] += 1
        return out

    def open_content(self, spid: str) -> IO[bytes]:
        try:
            return self.spool.open(spid)
        except OSError as exc:
            raise StorageError(f"cannot open the content of {spid}: {exc}") from exc

