"""Due times of deferred control files, read once per file and kept by its stamp.

SUMMARY
    DueTimes().of(rel_dir, files, read) -> [(name, next_at)];
    DueTimes.forget_due(now); stamped(path) -> (name, stamp) of a directory.

DESCRIPTION
    A deferred file lives in ``deferred/<T>``, T its due time rounded up
    by the retry granularity, so a directory with T <= now is due by its
    name alone.  The directory whose window holds now is not: which of its
    files are due needs each file's exact time, which is inside the file.
    A deferral wave puts thousands of files there, and every refill and
    every look for the next due time until T comes would read them all.

STRATEGIES
    Stamp, not name.  A control file is never rewritten in place: a change
    is a new file renamed over the old one.  So (inode, mtime_ns) names
    one version of one file, and a due time kept under it cannot go stale;
    a file whose stamp is new is read.  A file of the caller's own
    uncommitted batch has no stamp and is read each time.

    Only what was seen last.  Each look at a directory keeps the times of
    the files it saw there and drops the rest, and forget_due() drops the
    directories whose time has come, which are due by name: memory follows
    the directories not wholly due that someone looked at, not the queue.

    One memo for both readers.  A refill looks at the directory whose
    window holds now, due_at() at the first directory with a file in it;
    often the same one.  Sharing the memo reads each file once, not once
    for each.

SEE ALSO
    sluice.store.fs (the refill), sluice.store._fs_reading (due_at),
    sluice.store._fs_batch (Batch.stamped, the batch's view of a directory)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from sluice.store import StorageError
from sluice.store._fs_files import SUFFIX, scandir_entries

__all__ = ["DueTimes", "Stamp", "stamped"]

#: (inode, mtime_ns) of a control file on disk; None for one not written yet.
Stamp = tuple[int, int] | None


def stamped(path: Path, skip: Callable[[str], bool] = lambda name: False
            ) -> Iterator[tuple[str, tuple[int, int]]]:
    """The control files of a directory with their stamps, unparsed (none if it is gone)."""
    for entry in scandir_entries(path):
        name = entry.name
        if not name.endswith(SUFFIX) or skip(name):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise StorageError(f"cannot stat {path / name}: {exc}") from exc
        yield name, (st.st_ino, st.st_mtime_ns)


class DueTimes:
    """The due times of the files of a few directories, by stamp; safe across threads."""

    def __init__(self) -> None:
        self._known: dict[str, dict[tuple[int, int], float]] = {}
        self._lock = threading.Lock()

    def of(self, rel_dir: str, files: Iterable[tuple[str, Stamp]],
           read: Callable[[str], float | None]) -> list[tuple[str, float]]:
        """(name, due time) of each of ``files``; ``read(name)`` for a stamp not seen before.

        A file ``read`` finds gone (None) is left out.
        """
        with self._lock:
            known = self._known.get(rel_dir, {})
        kept: dict[tuple[int, int], float] = {}
        out = []
        for name, stamp in files:
            next_at = known.get(stamp) if stamp is not None else None
            if next_at is None:
                next_at = read(name)
                if next_at is None:
                    continue
            if stamp is not None:
                kept[stamp] = next_at
            out.append((name, next_at))
        with self._lock:
            self._known[rel_dir] = kept
        return out

    def forget_due(self, now: float) -> None:
        """Forget the directories ``deferred/<T>`` with T <= ``now``: due by their name."""
        with self._lock:
            for rel_dir in [d for d in self._known if int(d.rsplit("/", 1)[1]) <= now]:
                del self._known[rel_dir]
