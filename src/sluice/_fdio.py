"""Writes that finish: every byte handed to the kernel, however short each write.

SUMMARY
    write_all(fd, data); writev_all(fd, pieces, total)

DESCRIPTION
    os.write and os.writev may write less than they are given (a signal, a
    full pipe, a file system near its quota).  Every file, pipe and log the
    project writes through a raw descriptor goes through these two, so the
    rule "write until done" is kept in one place.  Errors are the callers'
    to name (OSError as raised).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["write_all", "writev_all"]


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
