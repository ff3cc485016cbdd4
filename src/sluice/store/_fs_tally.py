"""The filesystem flavour's count by names, shared with other processes.

SUMMARY
    tally(root, rel_dirs, domain, jobs, reading): the recipients of each
    directory and the SPIDs of all, once each.

DESCRIPTION
    When the totals in ``counts`` cannot be trusted (after a crash, until
    the check has counted again), qcount counts the control files by
    name: each directory listed as bytes and one pattern run over it
    (sluice.store._fs_files.count_names).  A million control files are
    about 1,100 directories and a second of work, most of it the kernel's
    listing, and the work divides by directory.  With ``jobs`` above 1
    the directories go in pieces of PIECE to ``jobs - 1`` other processes,
    and this process counts too.

STRATEGIES
    The pieces are taken from both ends.  The other processes start at the
    front; this one starts at the back and counts a piece only when
    Future.cancel() succeeds, which it does only while no process has the
    piece.  So this process never waits for the others to start, and each
    piece is counted once.  A process killed midway leaves its pieces to
    this one (BrokenProcessPool).

    The processes are spawned, not forked: the store's committer thread is
    running (as in sluice.listing).  A spawned process has counted its
    first piece about 0.2 s after it was started (a fresh interpreter
    that imports the ``sluice`` script again, which is why sluice.cli
    imports no command and no configuration), so a count of fewer than
    SHARED_DIRS directories starts none.  On two CPUs a million names
    take 0.8-0.9 s shared against 1.3 s alone: the two processes list
    directories at the same time, and each piece takes longer
    (docs/benchmarks.md).

    This process lists each piece under the store's read lock.  The other
    processes take none, as in listing_pieces: beside a running serve a
    count by names is as exact as a listing, which is what an operator
    gets from qcount with no trusted totals.

SEE ALSO
    sluice.store._fs_reading (count, count_in_processes),
    sluice.store._fs_counts (the totals that spare this work)
"""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

from sluice.store._fs_files import count_dirs

#: Directories in a piece: a piece of a full queue is a few milliseconds of work.
PIECE = 8
#: Directories below which no other process starts (its start costs more than it saves).
SHARED_DIRS = 128


def tally(root: Path, rel_dirs: Sequence[str], domain: str | None, jobs: int,
          reading: Callable[[], contextlib.AbstractContextManager[object]]
          ) -> tuple[list[int], set[bytes]]:
    """The recipients in each of ``rel_dirs`` (in order) and their SPIDs, as bytes.

    ``domain``: only the files of that domain (encoded, as NameFilter has
    it).  ``reading``: the store's read lock, held while this process
    lists a piece.
    """
    pieces = [list(rel_dirs[i:i + PIECE]) for i in range(0, len(rel_dirs), PIECE)]
    counts: list[list[int]] = [[] for _ in pieces]
    spids: set[bytes] = set()

    def here(i: int) -> None:
        with reading():
            counts[i], of = count_dirs(str(root), pieces[i], domain)
        spids.update(of)

    if jobs < 2 or len(rel_dirs) < SHARED_DIRS:
        for i in range(len(pieces)):
            here(i)
        return [n for piece in counts for n in piece], spids
    pool = ProcessPoolExecutor(jobs - 1, mp_context=multiprocessing.get_context("spawn"))
    try:
        futures: list[Future[tuple[list[int], set[bytes]]]] = [
            pool.submit(count_dirs, str(root), piece, domain) for piece in pieces]
        for i in reversed(range(len(pieces))):
            if futures[i].cancel():
                here(i)
        for i, future in enumerate(futures):
            if future.cancelled():
                continue
            try:
                counts[i], of = future.result()
            except BrokenProcessPool:
                here(i)
                continue
            spids.update(of)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return [n for piece in counts for n in piece], spids
