"""Writes that finish: every byte handed to the kernel, however short each write.

SUMMARY
    write_all(fd, data); writev_all(fd, pieces, total);
    pwritev_all(fd, pieces, total, offset); write_all_by(fd, data, deadline);
    open_log(path) -> fd

DESCRIPTION
    os.write and os.writev may write less than they are given (a signal, a
    full pipe, a file system near its quota).  Every file, pipe and log the
    project writes through a raw descriptor goes through these, so the
    rule "write until done" is kept in one place.  Errors are the callers'
    to name (OSError as raised).  write_all_by is for a pipe whose reader
    may never read (a child process that hangs before it does): it gives
    up at a deadline instead of blocking for good.  open_log opens the
    files that are only ever appended to and emptied whole (the success
    journal's, the mark log's) the one way they are opened.
"""

from __future__ import annotations

import os
import select
import time
from collections.abc import Sequence

__all__ = ["IOV_PIECES", "open_log", "pwritev_all", "write_all", "write_all_by", "writev_all"]

#: Pieces one pwritev takes at most here (IOV_MAX is 1024 on Linux).
IOV_PIECES = 512


def write_all(fd: int, data: bytes | memoryview) -> None:
    """Write all of ``data`` to ``fd``, finishing short writes."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def writev_all(fd: int, pieces: Sequence[bytes | memoryview], total: int) -> None:
    """Write ``pieces`` (``total`` bytes in all) to ``fd``: one writev, finished if short."""
    n = os.writev(fd, pieces)
    if n < total:
        write_all(fd, memoryview(b"".join(pieces))[n:])


def pwritev_all(fd: int, pieces: Sequence[bytes | bytearray | memoryview], total: int,
                offset: int) -> int:
    """Write ``pieces`` (``total`` bytes in all) at ``offset`` of ``fd``; the bytes written.

    One pwritev for each IOV_PIECES pieces, each finished with pwrite if
    short.  The file position is not used, so threads may write at
    offsets of their own through one descriptor.
    """
    at = offset
    for start in range(0, len(pieces), IOV_PIECES):
        group = pieces[start : start + IOV_PIECES]
        size = total if len(pieces) <= IOV_PIECES else sum(len(p) for p in group)
        n = os.pwritev(fd, group, at)
        at += n
        if n < size:
            rest = memoryview(b"".join(group))[n:]
            while rest:
                n = os.pwrite(fd, rest, at)
                at += n
                rest = rest[n:]
    return at - offset


def write_all_by(fd: int, data: bytes | memoryview, deadline: float) -> bool:
    """Write all of ``data`` to ``fd`` before ``deadline`` (time.monotonic()); False if not.

    ``fd`` (a pipe or a socket) is made non-blocking.  What the reader
    took by the deadline stays written; a reader that has gone raises
    BrokenPipeError, as os.write does.
    """
    os.set_blocking(fd, False)
    view = memoryview(data)
    poller = select.poll()  # not select(): a descriptor may be above 1023
    poller.register(fd, select.POLLOUT)
    while view:
        try:
            view = view[os.write(fd, view):]
            continue
        except BlockingIOError:
            pass
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        poller.poll(min(left, 1.0) * 1000)  # (an infinite deadline too)
    return True


def open_log(path: str | os.PathLike[str]) -> int:
    """A descriptor appending to ``path``, created or emptied (0640, closed on exec)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC,
                   0o640)
