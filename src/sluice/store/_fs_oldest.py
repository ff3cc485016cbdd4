"""The oldest SPID in each directory of the tree, kept by the directory's stamp.

SUMMARY
    OldestSpids().of(path) -> the smallest SPID among a directory's control
    files (None: none); OldestSpids.keep_only(paths).

DESCRIPTION
    /metrics gives the age of the oldest entry of each state at every
    scrape (Store.oldest, at most once a second).  The state is the
    directory and the SPID starts each name, so the answer is in the
    names; but listing the names of a million queued recipients takes
    about a second of CPU, and most directories did not change since the
    last scrape: the deferred directory of a wave hours old, the incoming
    buckets of mail queued a minute ago.

STRATEGIES
    Stamp of the directory.  Adding or removing a name changes a
    directory's mtime, so (inode, mtime_ns) names one version of its
    listing, and the smallest SPID listed under it holds until the stamp
    changes.  The kernel takes the time from a coarse clock (a tick of a
    few ms), so a change in the same tick as a listing would keep the
    stamp: a result is kept only for a directory whose last change is
    SETTLED_NS old, and one still changing is listed every time.

    Only directories seen last.  keep_only() drops the directories a walk
    no longer met (an emptied bucket removed, a deferred directory gone).

SEE ALSO
    sluice.store._fs_reading (oldest), sluice.store._fs_due (the same idea
    for files: a due time kept by a control file's stamp)
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from sluice.store import StorageError
from sluice.store._fs_files import scandir, spid_of_name

__all__ = ["SETTLED_NS", "OldestSpids"]

#: How long a directory must be unchanged for its listing to be kept.
SETTLED_NS = 1_000_000_000


class OldestSpids:
    """The smallest SPID of each directory, by the directory's stamp; safe across threads."""

    def __init__(self, clock_ns: Callable[[], int] = time.time_ns) -> None:
        self._known: dict[Path, tuple[tuple[int, int], str | None]] = {}
        self._lock = threading.Lock()
        self._clock_ns = clock_ns

    def of(self, path: Path) -> str | None:
        """The smallest SPID among the control files in ``path`` (None: none, or no directory)."""
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StorageError(f"cannot stat {path}: {exc}") from exc
        stamp = (st.st_ino, st.st_mtime_ns)
        with self._lock:
            known = self._known.get(path)
        if known is not None and known[0] == stamp:
            return known[1]
        first = min((s for name in scandir(path) if (s := spid_of_name(name)) is not None),
                    default=None)
        if self._clock_ns() - st.st_mtime_ns >= SETTLED_NS:
            with self._lock:
                self._known[path] = (stamp, first)
        return first

    def keep_only(self, paths: set[Path]) -> None:
        """Forget the directories not in ``paths``."""
        with self._lock:
            for gone in self._known.keys() - paths:
                del self._known[gone]
