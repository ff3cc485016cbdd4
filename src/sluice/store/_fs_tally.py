"""The filesystem flavour's count by names, shared with other processes when it is long.

SUMMARY
    tally(root, rel_dirs, domain, jobs, reading, clock): the recipients of
    each directory and the SPIDs of all, once each (Tallied).

DESCRIPTION
    A count by names (the totals in ``counts`` cannot be trusted: after a
    crash, until the check has counted again; or a selection by state or
    domain) lists each directory as bytes and runs one pattern over it
    (sluice.store._fs_files.count_names).  A million control files are
    about 1,100 directories and a second of work, most of it the kernel's
    listing, and the work divides by directory.  With ``jobs`` above 1,
    a count that promises to be long is shared with ``jobs - 1`` other
    processes.

STRATEGIES
    This process starts alone, from the last piece of PIECE directories
    backwards.  From PROBE_S on it knows its pace, and after each piece
    it asks whether the pieces left would take it more than SHARE_ABOVE_S;
    only then does it start the other processes: forked while this
    process has no other thread (a read-only command: sluice._workers),
    ready at once; else spawned, about 0.2 s each before their first
    piece.  So a small queue, or one of many small directories, starts
    none.
    The other processes are then fed from the front, at most two pieces
    each ahead, while this process goes on from the back; where the two
    meet, it waits for what it handed out.  Nothing is cancelled (Python
    3.11.7's pool fails on cancelled futures when a worker dies, CPython
    gh-107219).  A worker that dies breaks the whole pool: every piece
    handed out and not yet back fails with BrokenProcessPool, and this
    process counts those and the rest.  A pool that cannot start (no
    shared memory for its semaphores) or a process that fails to start
    ends the handing out: this process counts what is left alone.

    This process lists each piece under the store's read lock.  The other
    processes take none, as in listing_pieces: beside a running serve a
    count by names is as exact as a listing.

SEE ALSO
    sluice.store._fs_reading (count, count_in_processes),
    sluice.store._fs_counts (the totals that spare this work)
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path

from sluice._workers import worker_context
from sluice.store._fs_files import count_dirs

log = logging.getLogger(__name__)

#: Directories in a piece: a piece of a full queue is a few milliseconds of work.
PIECE = 8
#: How long this process counts alone before it judges the whole count's length.
PROBE_S = 0.05
#: Other processes start only if the pieces left would take this process longer.
SHARE_ABOVE_S = 0.4


@dataclass
class Tallied:
    """What tally found: recipients per directory (in order), SPIDs, pieces counted elsewhere."""

    per_dir: list[int]
    spids: set[bytes]
    elsewhere: int = 0


def tally(root: Path, rel_dirs: Sequence[str], domain: str | None, jobs: int,
          reading: Callable[[], contextlib.AbstractContextManager[object]],
          clock: Callable[[], float] = time.monotonic) -> Tallied:
    """The recipients in each of ``rel_dirs`` and their SPIDs, as bytes.

    ``domain``: only the files of that domain (encoded, as NameFilter has
    it).  ``reading``: the store's read lock, held while this process
    lists a piece.  ``clock``: for the pace, a monotonic one.
    """
    pieces = [list(rel_dirs[i:i + PIECE]) for i in range(0, len(rel_dirs), PIECE)]
    counts: list[list[int]] = [[] for _ in pieces]
    out = Tallied([], set())

    def here(i: int) -> None:
        with reading():
            counts[i], of = count_dirs(str(root), pieces[i], domain)
        out.spids.update(of)

    back = len(pieces)  # pieces[back:] are counted here
    started = clock()
    while back > 0:
        back -= 1
        here(back)
        spent = clock() - started
        if jobs > 1 and back > 0 and spent >= PROBE_S \
                and spent / (len(pieces) - back) * back > SHARE_ABOVE_S:
            _share(pieces[:back], root, domain, jobs - 1, counts, out, here)
            break
    out.per_dir = [n for piece in counts for n in piece]
    return out


def _share(front: list[list[str]], root: Path, domain: str | None, others: int,
           counts: list[list[int]], out: Tallied, here: Callable[[int], None]) -> None:
    """Count ``front`` with ``others`` more processes: theirs from its start, ours from its end."""
    pool: ProcessPoolExecutor | None = None
    try:
        pool = ProcessPoolExecutor(others, mp_context=worker_context())
    except (OSError, NotImplementedError) as exc:  # no semaphores here, for one
        log.info("counting alone: no other process could start (%s)", exc)
    handing = True  # until a process fails to start
    given: deque[tuple[int, Future[tuple[list[int], set[bytes]]]]] = deque()

    def collect(i: int, future: Future[tuple[list[int], set[bytes]]]) -> None:
        try:
            counts[i], of = future.result()
        except BrokenProcessPool:
            here(i)  # the process died: its pieces are ours
            return
        out.spids.update(of)
        out.elsewhere += 1

    try:
        nxt, back = 0, len(front)
        while nxt < back:
            while pool is not None and handing and nxt < back and len(given) < 2 * others:
                try:
                    given.append((nxt, pool.submit(count_dirs, str(root), front[nxt], domain)))
                except (OSError, BrokenProcessPool) as exc:
                    # A process failed to start, or the pool broke: the rest
                    # are ours.  (A submit that failed to start one may leave
                    # its piece queued in the pool; a worker may count it
                    # again, for nothing.)
                    log.info("counting the rest alone: %s", exc)
                    handing = False
                    break
                nxt += 1
            while given and given[0][1].done():
                collect(*given.popleft())
            if nxt < back:
                back -= 1
                here(back)
        while given:
            collect(*given.popleft())
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
