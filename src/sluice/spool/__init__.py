"""The spool: message content, one copy per message, named by its SPID.

SUMMARY
    Spool (a Protocol), SpoolFile, Content, new_spid(), iter_chunks().
    The filesystem flavour is sluice.spool.fs.FsSpool.

DESCRIPTION
    A SPID is 16 hexadecimal digits: 11 of milliseconds since the epoch
    (so SPIDs sort by arrival, which the kv flavour relies on to iterate
    "from the oldest message") and 5 that start at a random value in each
    millisecond and count up within it (so the last digits, which pick the
    spool partition, are uniformly distributed, as Mailismus requires, and
    one process's SPIDs sort in the order it drew them).  Uniqueness across
    processes is enforced where the content is created (exclusive create);
    a collision just draws again.

    Writing is two steps so that many submissions can share one fsync
    (group commit): ``write()`` streams the content to disk in ``bufsize``
    pieces and returns a SpoolFile that is not yet durable; ``sync(files)``
    makes a whole batch durable at once.  The meta queue commits only after
    that, so meta never points at content that could be lost.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Protocol

__all__ = ["Content", "Spool", "SpoolFile", "SpoolIOError", "iter_chunks", "new_spid",
           "spid_candidates", "spid_head", "spid_time"]


class SpoolIOError(OSError):
    """Writing the spool failed (full disk, I/O error).

    As opposed to an error raised by the content source, which passes
    through unchanged.
    """

#: What a submitter may hand over: the whole content, pieces of it, or a
#: binary file to be read in ``bufsize`` pieces.
Content = bytes | bytearray | memoryview | Iterable[bytes] | IO[bytes]


_spid_lock = threading.Lock()
_spid_last: list[int] = [-1, 0]  # [millisecond, suffix] of the last SPID drawn here
# A forked child must not continue its parent's sequence within the same ms.
os.register_at_fork(after_in_child=lambda: _spid_last.__setitem__(0, -1))


def new_spid(now_ms: int | None = None) -> str:
    """A fresh SPID: 11 hex digits of milliseconds, then 5 more.

    The suffix starts at a random value in each millisecond and counts up
    within it, so SPIDs drawn by one process sort in the order they were
    drawn, and the last digits still cycle evenly through every partition.
    """
    ms = time.time_ns() // 1_000_000 if now_ms is None else now_ms
    with _spid_lock:
        if ms == _spid_last[0]:
            suffix = (_spid_last[1] + 1) & 0xFFFFF
        else:
            suffix = int.from_bytes(os.urandom(3), "big") & 0xFFFFF
        _spid_last[0], _spid_last[1] = ms, suffix
    return f"{spid_head(ms)}{suffix:05X}"


def spid_head(ms: int) -> str:
    """The 11 hex digits a SPID drawn at ``ms`` (POSIX milliseconds) starts with."""
    return f"{ms & 0xFFFFFFFFFFF:011X}"


def spid_time(spid: str) -> float:
    """When a SPID was drawn (its 11 hex digits of milliseconds), in POSIX seconds."""
    return int(spid[:11], 16) / 1000.0


def spid_candidates(wanted: str = "", tries: int = 100) -> Iterator[str]:
    """SPIDs to try in turn for a new message, ``tries`` in all.

    ``wanted`` first when the caller drew one (Submission.spid), then fresh
    ones.  A store takes the first that is free.
    """
    for attempt in range(tries):
        yield wanted if wanted and attempt == 0 else new_spid()


def iter_chunks(content: Content, bufsize: int) -> Iterator[bytes | memoryview]:
    """Pieces of at most ``bufsize`` bytes, never the whole content at once.

    In-memory content is sliced without copying; files are read piece by
    piece; iterables are passed through (re-sliced when a piece is larger).
    """
    if isinstance(content, bytes | bytearray | memoryview):
        view = memoryview(content).cast("B")
        for start in range(0, len(view), bufsize):
            yield view[start : start + bufsize]
        return
    read = getattr(content, "read", None)
    if read is not None:
        while True:
            piece = read(bufsize)
            if not piece:
                return
            yield piece
    for piece in content:
        if len(piece) <= bufsize:
            if piece:
                yield piece
        else:
            view = memoryview(piece).cast("B")
            for start in range(0, len(view), bufsize):
                yield view[start : start + bufsize]


@dataclass(slots=True)
class SpoolFile:
    """Content written but not yet synced.  ``fd`` stays open until sync/discard.

    ``offset`` is where the content starts in a shared segment
    (sluice.spool.segments), or -1 for a file of its own.
    """

    spid: str
    path: str
    size: int
    fd: int = -1
    offset: int = -1


class Spool(Protocol):
    """Where message content lives (filesystem, or a key-value store)."""

    def write(self, content: Content, spid: str = "") -> SpoolFile:
        """Stream ``content`` under ``spid`` if given and free, else under a new SPID.

        Not durable until sync().
        """
        ...

    def sync(self, files: Sequence[SpoolFile]) -> None:
        """Make written files durable (content and directory entry) and close them."""
        ...

    def discard(self, file: SpoolFile) -> None:
        """Forget a written file that will not be committed."""
        ...

    def open(self, spid: str) -> IO[bytes]:
        """The content, for streaming reads.  FileNotFoundError if absent."""
        ...

    def delete(self, spid: str) -> None:
        """Remove the content; a missing file is not an error."""
        ...

    def exists(self, spid: str) -> bool:
        """Whether content is stored under ``spid``."""
        ...

    def spids(self) -> Iterator[tuple[str, float]]:
        """Every SPID in the spool with its modification time."""
        ...
