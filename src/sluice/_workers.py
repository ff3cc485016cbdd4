"""How a command starts its helper processes: forked while it is alone, else spawned.

SUMMARY
    worker_context() -> multiprocessing context for a ProcessPoolExecutor

DESCRIPTION
    `sluice qlist` and `sluice qcount` share a long read of a filesystem
    queue with other processes (sluice.listing, sluice.store._fs_tally).
    A spawned process starts a new interpreter and imports Sluice again:
    about 0.15-0.2 s before its first piece of work, a fifth of a count
    of a million names.  A forked one starts at once, with everything
    imported.

STRATEGY
    Fork only while this process runs a single thread.  A fork copies the
    memory but only the calling thread: a lock another thread held at
    that moment stays held in the child for ever.  Both Python's count of
    its threads and, where there is one, the kernel's (/proc/self/task,
    which also sees threads a C library started) must say one.  A
    read-only command on the filesystem flavour has no other thread (its
    store starts its committer with the first write: sluice.store._commit),
    so it forks; anything with a thread running (serve, a test runner, a
    store that has written, SQLite's WAL syncer, LevelDB's) spawns.

    What the caller keeps to: the check is made when the pool is built
    and the fork happens at its first submit (ProcessPoolExecutor starts
    all its processes then, before its own manager thread), so no thread
    may start in between; and no descriptor holding a lock (flock) may be
    open while it forks, as a child's copy would keep the lock after the
    parent closes its own.

SEE ALSO
    sluice.listing, sluice.store._fs_tally
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import os
import threading

__all__ = ["worker_context"]


def worker_context() -> multiprocessing.context.BaseContext:
    """'fork' while this is the process's only thread (and the system has fork), else 'spawn'."""
    if (threading.active_count() == 1 and _kernel_threads() in (1, None)
            and "fork" in multiprocessing.get_all_start_methods()):
        return multiprocessing.get_context("fork")
    return multiprocessing.get_context("spawn")


def _kernel_threads() -> int | None:
    """This process's threads as the kernel counts them; None where it cannot say."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return None
