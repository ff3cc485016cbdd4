"""Parallel fsync: many files and directories made durable at once.

SUMMARY
    fsync_path(path); fsync_paths(paths, also=None); fsync_fds(fds);
    in_parallel(fn, items)

DESCRIPTION
    The kernel merges fsyncs that are in flight at the same time into few
    journal commits, so a batch of a hundred files costs little more than
    one when the fsyncs are issued together from a small thread pool
    (measured on the project's machine: ~8k files/s in parallel against
    ~3k/s one after the other).  Used by the spool and by every store
    flavour's group commit.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

__all__ = ["fsync_fds", "fsync_path", "fsync_paths", "in_parallel"]

_pool_lock = threading.Lock()
_pool: concurrent.futures.ThreadPoolExecutor | None = None


def _sync_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=16, thread_name_prefix="sluice-store-fsync")
        return _pool


def fsync_path(path: str) -> None:
    """Sync a file or a directory to disk by path (fsync)."""
    flags = os.O_RDONLY | os.O_CLOEXEC
    if os.path.isdir(path):
        flags |= os.O_DIRECTORY
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_paths(paths: Iterable[str], also: Callable[[], None] | None = None) -> None:
    """Sync files and directories by path, in parallel; ``also`` runs meanwhile.

    An fsync through a read-only descriptor flushes the file's dirty pages
    as well as one through the descriptor that wrote them (Linux), so
    writers may close their files before the batch is synced.  Raises the
    first OSError after every fsync has finished.
    """
    todo = list(dict.fromkeys(paths))
    if len(todo) <= 1 and also is None:
        for p in todo:
            fsync_path(p)
        return
    futures = [_sync_pool().submit(fsync_path, p) for p in todo]
    first: BaseException | None = None
    if also is not None:
        try:
            also()
        except BaseException as exc:
            first = exc
    for f in futures:
        failure = f.exception()
        if failure is not None and first is None:
            first = failure
    if first is not None:
        raise first


def fsync_fds(fds: Iterable[int]) -> None:
    """Sync open descriptors in parallel (fsync); raises the first OSError."""
    todo = list(fds)
    if len(todo) <= 1:
        for fd in todo:
            os.fsync(fd)
        return
    futures = [_sync_pool().submit(os.fsync, fd) for fd in todo]
    errors = [f.exception() for f in futures]
    for exc in errors:
        if exc is not None:
            raise exc


def in_parallel(fn: Callable[[Any], Any], items: Sequence[Any]) -> None:
    """Call ``fn`` on every item from the worker pool; raises the first error.

    For metadata calls (unlink) that wait on the filesystem's journal: issued
    together, they wait for one journal commit instead of one each.
    """
    if len(items) <= 2:
        for item in items:
            fn(item)
        return

    def run(part: Sequence[Any]) -> None:
        for item in part:
            fn(item)

    # One job per worker rather than per item: a thousand renames should
    # not cost a thousand futures.
    workers = min(len(items), 16)
    parts = [items[i::workers] for i in range(workers)]
    futures = [_sync_pool().submit(run, part) for part in parts]
    errors = [f.exception() for f in futures]
    for exc in errors:
        if exc is not None:
            raise exc
