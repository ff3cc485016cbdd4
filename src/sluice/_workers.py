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
    that moment stays held in the child for ever.  A read-only command
    has no other thread (the stores start their committer with the first
    write: sluice.store._commit), so it forks; anything with a thread
    running (serve, a test runner, a store that has written) spawns.
    ProcessPoolExecutor with the fork method starts all its processes at
    once, before its own manager thread (CPython does this for fork).

SEE ALSO
    sluice.listing, sluice.store._fs_tally
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import threading

__all__ = ["worker_context"]


def worker_context() -> multiprocessing.context.BaseContext:
    """'fork' while this is the process's only thread (and the system has fork), else 'spawn'."""
    if threading.active_count() == 1 and "fork" in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("fork")
    return multiprocessing.get_context("spawn")
