"""The mark log: which attempts had started, written before their content goes out.

SUMMARY
    paths = mark_paths(queue_path, node_id)
    marked = read_marks(paths)              (at start, before recovery)
    marks = MarkLog.open(paths)             (after the recovery: starts empty)
    token = marks.write([mark_of(e) ...])   (None: not written, wait for the store)
    retired = marks.take_retired()          (a full file to cover, or None)
    marks.covered(retired); marks.close()

DESCRIPTION
    A crash after a message's content went out leaves an entry the next
    hop may have; the next start logs each such entry as "recovered", "in
    flight at crash, may be a duplicate" (docs/queue.md, "What is
    promised").  What tells the start which attempts had begun is a mark
    that reached the operating system before the first byte of content:
    the store's "delivering" state, or a line here.

    The store's mark is a commit, and in SQLite that commit waits for the
    database's one write lock, which the receivers hold for their own
    commits: about 4 ms of each delivery's cycle at 1 KB, measured between
    the next hop's 354 and the content (docs/floor.md).  A line appended
    to a local file is a write(2) to the page cache.  So the queue manager
    writes each step's marks here and its deliveries send at once.  The
    store gets no mark for them at all while the line is kept: applying
    the same marks to the store afterwards, unwaited, took a fifth of the
    queue manager's store thread at 1 KB (docs/benchmarks.md, "The
    store's marks").  A line is needed only as long as its attempts may
    be under way; once an attempt's outcome is in the store, the entry is
    no longer claimed with the attempts the line names.

STRATEGIES
    One line a loop step: a mark per attempt it started, the queue id and
    the attempts so far (``qid/attempts``, mark_of), separated by spaces.
    A write that fails part-way is cut off again, so the next line starts
    clean.

    Two files, in turn, as the success journal's (sluice.journal): lines
    go to one until it has grown past ROTATE_AT; then, if the other is
    empty, to that one, and the full one is *retired* (take_retired).  A
    retired file is emptied (covered) once the store has a "delivering"
    mark for every attempt it names whose outcome is not yet in the store:
    the queue manager keeps those attempts in memory and marks them in the
    store in one operation, a few hundred entries at most every ROTATE_AT
    of lines (sluice.runtime.deliveries).  Until then the current file
    grows past ROTATE_AT.

    Not synced: a mark is for a crash of Sluice, not a power cut, as the
    store's uncommitted-to-disk mark was (the note needs the mark to have
    reached the operating system).  The write(2) runs on the queue
    manager's event loop, as the accounting log's and the success
    journal's do: a few hundred bytes to the page cache.

    A cover whose store mark fails is tried again (sluice.runtime.
    deliveries) until it is in, or until the manager stops: the retired
    file is emptied only then, and while the store fails the current file
    grows by a line a step.  A write that fails and cannot be cut off
    again ends the log for the run.

LIMITATIONS
    Only stores no other node writes: on a queue nodes share (PostgreSQL)
    an entry claimed here may be another node's after a long outage, so
    the queue manager keeps waiting for the store's mark there.

    A mark names an attempt by the entry's attempts before it.  An
    attempt whose outcome the store refused (an operator held the entry
    while it was under way) counts nothing; if the entry is released,
    claimed again and the process dies before it is tried, its old line
    can note it as in flight, one note too many.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from sluice._fdio import open_log, write_all
from sluice.model import QueueEntry

__all__ = ["ROTATE_AT", "MarkLog", "mark_files", "mark_of", "mark_paths", "read_marks"]

log = logging.getLogger("sluice.marks")

#: The size past which lines go to the other file, once it is empty.
ROTATE_AT = 1 << 20


def mark_paths(queue_path: str | os.PathLike[str], node_id: str) -> tuple[Path, Path]:
    """This node's two mark files under queue.path."""
    base, stem = Path(queue_path), f"marks-{node_id}" if node_id else "marks"
    return base / f"{stem}.0.log", base / f"{stem}.1.log"


def mark_files(queue_path: str | os.PathLike[str]) -> list[Path]:
    """Every mark file under queue.path, whichever node id named it.

    A queue that no other node writes returns every entry in flight at a
    start, whoever claimed it (a renamed host, a copied queue directory):
    its marks are read the same way.
    """
    return sorted(Path(queue_path).glob("marks*.log"))


def mark_of(entry: QueueEntry) -> str:
    """An attempt's mark: the entry's queue id and its attempts before this one."""
    return f"{entry.qid}/{entry.attempts}"


def read_marks(paths: Iterable[str | os.PathLike[str]]) -> set[str]:
    """The marks (mark_of) the files hold; none from a file that does not exist.

    A last line without its line end (torn by the crash) is read too: the
    marks it holds whole were written before any content went out, and a
    cut one names no attempt.
    """
    out: set[str] = set()
    for path in paths:
        try:
            data = Path(path).read_bytes()
        except FileNotFoundError:
            continue
        out.update(data.decode("ascii", "replace").split())
    return out


class _File:
    """One of the two files: its descriptor and its size."""

    __slots__ = ("fd", "path", "size")

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd = fd
        self.size = 0


class MarkLog:
    """Each step's marks appended from the event loop, to two files emptied in turn."""

    def __init__(self, files: Sequence[_File]) -> None:
        self._files = list(files)
        self._cur = 0
        self._failing = False
        self._retired: int | None = None  # retired, not yet handed to take_retired()

    @classmethod
    def open(cls, paths: Sequence[Path]) -> MarkLog:
        """Open ``paths`` empty: their lines were read by the recovery already."""
        files: list[_File] = []
        try:
            for path in paths:
                files.append(_File(path, open_log(path)))
        except OSError:
            for f in files:
                os.close(f.fd)
            raise
        return cls(files)

    def write(self, marks: Sequence[str]) -> int | None:
        """Append one line of ``marks``; the file's token (for covered()), or None if not written.

        None (a full disk, a closed log): the caller waits for the store's
        mark instead.  The first failure of a series is logged.
        """
        if not self._files:
            return None
        cur = self._files[self._cur]
        if cur.size >= ROTATE_AT:
            full = self._cur
            other = (full + 1) % len(self._files)
            if self._files[other].size == 0:
                self._cur = other
                cur = self._files[other]
                self._retired = full
        line = (" ".join(marks) + "\n").encode("ascii")
        try:
            write_all(cur.fd, line)
        except OSError as exc:
            try:
                os.ftruncate(cur.fd, cur.size)  # a torn line would join the next one
            except OSError as cut:
                log.error("cannot write the mark log %s (%s) nor cut off what was written "
                          "(%s); this run keeps no mark log, deliveries wait for the "
                          "store's mark", cur.path, exc, cut)
                self.close()
                return None
            if not self._failing:
                log.error("cannot write the mark log %s (%s); deliveries wait for the "
                          "store's mark until it works again", cur.path, exc)
            self._failing = True
            return None
        if self._failing:
            log.warning("the mark log %s is written again", cur.path)
            self._failing = False
        cur.size += len(line)
        return self._cur

    def take_retired(self) -> int | None:
        """The token of a file lines no longer go to, once; None if none was retired."""
        retired, self._retired = self._retired, None
        return retired

    def covered(self, token: int) -> None:
        """The store has the marks of every attempt file ``token`` names still under way.

        The file is emptied, unless lines go to it (a late answer).
        """
        if not self._files or token == self._cur:
            return
        f = self._files[token]
        if not f.size:
            return
        try:
            os.ftruncate(f.fd, 0)
        except OSError as exc:  # its lines stay: at worst a note too many at a restart
            log.warning("cannot empty the mark log %s (%s)", f.path, exc)
            return
        f.size = 0

    def close(self) -> None:
        """Close the files; what they hold is read at the next start."""
        files, self._files = self._files, []
        for f in files:
            os.close(f.fd)
