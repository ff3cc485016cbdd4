"""Segments: large contents appended to shared files, one fsync a batch, one unlink a segment.

SUMMARY
    Segments(rootpath, segment_max=16 MiB, segment_age_s=10, bufsize=8192)

DESCRIPTION
    The files spool (sluice.spool.fs) gives every message a file of its
    own: an exclusive create, an fsync, and later an unlink, each a walk
    through the file system's allocator.  For 100 KB messages those three
    cost more CPU than the rest of the spool's work together (docs/
    benchmarks.md, "Segments").  Here each process appends the contents it
    spools to its *active segment*, a file under ROOT/segments named by a
    fresh SPID (so names sort by age), and a store records where each
    content lies: (segment, offset, length).  A batch's contents are made
    durable by one fdatasync of the segment, and a segment is unlinked
    once no content in it is referenced any more -- one unlink for a
    segment's worth of messages.

STRATEGIES
    Appends without a lock held over the write.  write() reserves the
    content's range under a lock and writes it with pwritev outside it, so
    two threads of one process fill one segment side by side.

    A segment is sealed by its writer.  The writing process holds an
    exclusive flock(2) on each segment it may still write or whose writes
    are not yet committed or discarded (``pending``).  A segment is retired
    when it reaches ``segment_max`` bytes or ``segment_age_s`` seconds,
    and its lock is dropped when its last pending write is settled.  The
    lock is taken before the segment has its final name: it is created as
    ``NAME.new``, locked, then renamed to ``NAME.seg`` (the directory
    fsynced before any content in it can be committed), so no sweeper ever
    sees an unlocked segment that a writer is about to fill.  A writer that
    dies loses its locks with it.

    Sweeping.  The store binds two functions: ``referenced`` (which of
    these segments hold a content still queued) and ``barrier`` (its log
    flush).  sweep_soon(segments) queues segments that may have become
    free: those whose last reference a commit removed, and those this
    process has just sealed.  A background thread locks each one without
    waiting (a locked one is still being written, and its writer offers
    it again when it seals it), asks ``referenced``, runs ``barrier`` (so
    the commits that dropped the references are durable) and unlinks the
    rest.  The same thread retires an active segment that has grown old
    without new writes, so an idle spool empties itself.  sweep_all() does
    the same for every segment on disk: the store's start-up recovery,
    which also removes the ``.new`` files of writers that died before
    renaming them.

INVARIANTS
    A segment is unlinked only while this process holds its lock, after
    the store said no content in it is referenced and after ``barrier``
    returned.  Content of a write is durable (data and the file's size)
    when sync() returns, and its segment's name is durable since before the
    write.  Space of discarded writes, and of delivered contents in a
    segment that still holds a deferred one, is given back only when the
    whole segment goes.

LIMITATIONS
    A segment that keeps one long-deferred message keeps its whole size
    on disk until that message leaves the queue (at most segment_max, 16 MiB
    by default, per such message; a lower segment_max trades more unlinks
    for less held space).  Contents handed over as streams of unknown size
    go to the files spool instead.

SEE ALSO
    sluice.spool.fs (the files spool), sluice.store.sqlite (the index of
    contents, table ``content_at``).
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from sluice._batches import take_queued
from sluice._fdio import pwritev_all
from sluice._fsync import fsync_path
from sluice.spool import SpoolFile, SpoolIOError, new_spid, spid_candidates

__all__ = ["Segments", "segment_name", "segment_number"]

_log = logging.getLogger(__name__)

_SEG = ".seg"
_NEW = ".new"
#: A ``.new`` file older than this, and not locked, was left by a writer that died.
_STALE_NEW_S = 60.0
#: A sweep holds at most this many segments' locks (descriptors) at once.
SWEEP_CHUNK = 256



@dataclass(slots=True)
class _Segment:
    """A segment this process writes, or whose writes are not all settled."""

    number: int
    path: str
    fd: int
    born: float
    end: int = 0
    pending: int = 0
    retired: bool = False
    #: Its fdatasync failed once: the kernel may not say so twice, so every
    #: write still pending in it fails too.
    failed: OSError | None = None


def segment_name(number: int) -> str:
    """A segment's file name: its number as 16 hexadecimal digits."""
    return f"{number:016X}{_SEG}"


def segment_number(path: str) -> int:
    """The number of the segment whose file (name or path) this is; segment_name's inverse."""
    return int(os.path.basename(path)[:16], 16)


class Segments:
    """Large contents appended to segment files under ``rootpath/segments``."""

    def __init__(self, rootpath: str | os.PathLike[str], segment_max: int = 16 << 20,
                 segment_age_s: float = 10.0, bufsize: int = 8192,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if segment_max < 1:
            raise ValueError("segment_max must be positive")
        if segment_age_s <= 0:
            raise ValueError("segment_age_s must be positive")
        self.dir = Path(rootpath) / "segments"
        self._dir = str(self.dir)
        self.segment_max = segment_max
        self.segment_age_s = segment_age_s
        self.bufsize = bufsize
        self._clock = clock
        self._lock = threading.Lock()
        self._active: _Segment | None = None
        self._open: dict[str, _Segment] = {}
        self._sweeps: queue.SimpleQueue[set[int] | None] = queue.SimpleQueue()
        self._janitor: threading.Thread | None = None
        self._janitor_lock = threading.Lock()
        self._referenced: Callable[[list[int]], set[int]] = _all_referenced
        self._barrier: Callable[[], None] | None = None
        self._compact: Callable[[float], int] | None = None
        self._compact_every = 0.0
        self._compact_next = 0.0
        self._closing = False
        if not self.dir.is_dir():
            self.dir.mkdir(parents=True, exist_ok=True)
            fsync_path(self._dir)
            fsync_path(str(self.dir.parent))

    def bind(self, referenced: Callable[[list[int]], set[int]],
             barrier: Callable[[], None] | None) -> None:
        """The store's answers for sweeps (module doc, "Sweeping")."""
        self._referenced, self._barrier = referenced, barrier

    def bind_compaction(self, compact: Callable[[float], int], every_s: float) -> None:
        """Run ``compact(time.time())`` every ``every_s`` on the background thread.

        The store's compaction (sluice.store._sqlite_segments); one process
        of a queue binds it, the one that recovered it.
        """
        self._compact, self._compact_every = compact, every_s
        self._compact_next = self._clock() + every_s
        self._start_janitor()

    def path(self, number: int) -> str:
        """The file of segment ``number``."""
        return f"{self._dir}/{segment_name(number)}"

    # -- writing -------------------------------------------------------------

    def write(self, pieces: Sequence[bytes | bytearray | memoryview], size: int,
              spid: str = "") -> SpoolFile:
        """Append ``pieces`` (``size`` bytes in all); not durable until sync().

        The SpoolFile's ``path`` is the segment's, its ``offset`` where the
        content starts, and its ``spid`` the one wanted or a fresh one (the
        store settles collisions when it records the content).
        """
        with self._lock:
            seg = self._active
            if seg is None or seg.end >= self.segment_max or (
                    self._clock() - seg.born >= self.segment_age_s):
                if seg is not None:
                    self._retire(seg)
                seg = self._active = self._create()
            offset = seg.end
            seg.end += size
            seg.pending += 1
        try:
            _pwrite_all(seg.fd, pieces, size, offset, seg.path)
        except BaseException:
            self._settle_one(seg)
            raise
        return SpoolFile(spid=spid or new_spid(), path=seg.path, size=size, fd=-1,
                         offset=offset)

    def _create(self) -> _Segment:
        """A new segment, locked before it has the name sweepers look at."""
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        for candidate in spid_candidates():
            number = int(candidate, 16)
            final = self.path(number)
            temp = final[: -len(_SEG)] + _NEW
            try:
                fd = os.open(temp, flags, 0o640)
            except FileExistsError:
                continue
            except OSError as exc:
                raise SpoolIOError(exc.errno, exc.strerror, temp) from exc
            if os.path.exists(final):  # pragma: no cover - a SPID drawn twice
                os.close(fd)
                os.unlink(temp)
                continue
            break
        else:  # pragma: no cover - 100 collisions in a row means a broken RNG
            raise RuntimeError("could not allocate a unique segment name")
        try:
            # Blocking: a sweeper looking at ``.new`` files holds one briefly.
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.rename(temp, final)
            fsync_path(self._dir)
        except OSError as exc:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise SpoolIOError(exc.errno, exc.strerror, final) from exc
        seg = _Segment(number=number, path=final, fd=fd, born=self._clock())
        self._open[final] = seg
        self._start_janitor()
        return seg

    def _retire(self, seg: _Segment) -> None:
        """No more writes go to ``seg``; it is sealed when its last one settles."""
        seg.retired = True
        if self._active is seg:
            self._active = None
        if seg.pending == 0:
            self._seal(seg)

    def _seal(self, seg: _Segment) -> None:
        """Drop the lock (by closing) and offer the segment to the sweeper."""
        self._open.pop(seg.path, None)
        os.close(seg.fd)
        seg.fd = -1
        self.sweep_soon({seg.number})

    def sync(self, files: Sequence[SpoolFile]) -> None:
        """Make the batch durable: one fdatasync a segment it wrote to (data and size)."""
        paths = dict.fromkeys(f.path for f in files)
        with self._lock:
            segs = [self._open.get(p) for p in paths]
        for seg in segs:
            if seg is None:  # pragma: no cover - a write is pending until settled
                raise SpoolIOError(0, "syncing a segment that is not open", str(paths))
            if seg.failed is not None:
                raise seg.failed
            try:
                os.fdatasync(seg.fd)
            except OSError as exc:
                with self._lock:
                    seg.failed = SpoolIOError(exc.errno, exc.strerror, seg.path)
                    if not seg.retired:
                        self._retire(seg)
                raise seg.failed from exc

    def settle(self, files: Iterable[SpoolFile]) -> None:
        """These writes were committed or discarded: their segments may seal."""
        with self._lock:
            for f in files:
                seg = self._open.get(f.path)
                if seg is not None:
                    self._settle_locked(seg)

    def _settle_one(self, seg: _Segment) -> None:
        with self._lock:
            self._settle_locked(seg)

    def _settle_locked(self, seg: _Segment) -> None:
        seg.pending -= 1
        if seg.pending == 0 and seg.retired:
            self._seal(seg)

    # -- reading -------------------------------------------------------------

    def open(self, number: int, offset: int, size: int) -> IO[bytes]:
        """The content at ``offset`` of segment ``number``, for streaming reads."""
        fd = os.open(self.path(number), os.O_RDONLY | os.O_CLOEXEC)
        return io.BufferedReader(_Range(fd, offset, size), buffer_size=self.bufsize)

    def size(self, number: int) -> int | None:
        """The size of segment ``number``'s file, or None if it is gone."""
        try:
            return os.stat(self.path(number)).st_size
        except FileNotFoundError:
            return None

    def lock(self, number: int) -> int | None:
        """A descriptor holding segment ``number``'s lock, or None if held or gone."""
        return _lock_free(self.path(number))

    def numbers(self) -> list[int]:
        """Every segment on disk, oldest first."""
        try:
            names = os.listdir(self._dir)
        except FileNotFoundError:
            return []
        return sorted(segment_number(n) for n in names if n.endswith(_SEG))

    # -- sweeping ------------------------------------------------------------

    def sweep_soon(self, numbers: set[int]) -> None:
        """Unlink, on a background thread, those of ``numbers`` no content refers to."""
        if numbers:
            self._start_janitor()
            self._sweeps.put(set(numbers))

    def sweep_all(self) -> int:
        """Sweep every segment on disk now; returns how many were unlinked."""
        self.drop_stale_new()
        return self.sweep(set(self.numbers()))

    def _start_janitor(self) -> None:
        with self._janitor_lock:
            if self._janitor is None and not self._closing:
                self._janitor = threading.Thread(target=self._run, name="sluice-segments",
                                                 daemon=True)
                self._janitor.start()

    def _run(self) -> None:
        tick = self.segment_age_s / 2
        while True:
            try:
                item = self._sweeps.get(timeout=tick)
            except queue.Empty:
                item = set()
            if item is None:
                return
            work, stop = take_queued(self._sweeps, item)
            try:
                self._retire_idle()
                numbers = set().union(*(w for w in work if w is not None))
                if numbers:
                    self.sweep(numbers)
            except Exception:  # keep the segments; the next sweep decides
                _log.exception("sweeping spool segments failed")
            if self._compact is not None and self._clock() >= self._compact_next and not stop:
                self._compact_next = self._clock() + self._compact_every
                try:
                    self._compact(time.time())
                except Exception:  # the contents stay where they are; next time
                    _log.exception("compacting spool segments failed")
            if stop:
                return

    def _retire_idle(self) -> None:
        """Retire the active segment once it is old, written to or not."""
        with self._lock:
            seg = self._active
            if seg is not None and self._clock() - seg.born >= self.segment_age_s:
                self._retire(seg)

    def sweep(self, numbers: set[int]) -> int:
        """Unlink those of ``numbers`` that are unlocked and unreferenced, now; how many."""
        listed = sorted(numbers)
        gone = 0
        for at in range(0, len(listed), SWEEP_CHUNK):
            locked: dict[int, int] = {}
            try:
                for number in listed[at : at + SWEEP_CHUNK]:
                    fd = self.lock(number)
                    if fd is not None:
                        locked[number] = fd
                gone += self.sweep_locked(locked)
            finally:
                for fd in locked.values():
                    os.close(fd)
        return gone

    def sweep_locked(self, locked: dict[int, int]) -> int:
        """Unlink those of the segments whose locks the caller holds that nothing refers to.

        ``locked`` maps each number to the descriptor holding its lock; the
        caller closes them.  Returns how many were unlinked.
        """
        if not locked:
            return 0
        kept = self._referenced(list(locked))
        free = [n for n in locked if n not in kept]
        if not free:
            return 0
        if self._barrier is not None:
            self._barrier()
        for number in free:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path(number))
        return len(free)

    def drop_stale_new(self) -> None:
        """Remove the ``.new`` files of writers that died before naming them."""
        try:
            names = os.listdir(self._dir)
        except FileNotFoundError:
            return
        now = time.time()
        for name in names:
            if not name.endswith(_NEW):
                continue
            path = f"{self._dir}/{name}"
            fd = _lock_free(path)
            if fd is None:
                continue
            try:
                if now - os.fstat(fd).st_mtime >= _STALE_NEW_S:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
            finally:
                os.close(fd)

    # -- life ----------------------------------------------------------------

    def close(self) -> None:
        """Retire the active segment and finish the queued sweeps."""
        with self._lock:
            if self._active is not None:
                self._retire(self._active)
        with self._janitor_lock:
            self._closing = True  # no thread starts again, whatever settles late
            janitor, self._janitor = self._janitor, None
        if janitor is not None:
            self._sweeps.put(None)
            janitor.join()


class _Range(io.RawIOBase):
    """``size`` bytes of a file from ``offset``, read with pread."""

    def __init__(self, fd: int, offset: int, size: int) -> None:
        super().__init__()
        self._fd = fd
        self._pos = offset
        self._left = size

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), self._left)
        if n <= 0:
            return 0
        view = memoryview(buffer).cast("B")[:n]
        got = os.preadv(self._fd, [view], self._pos)
        if got == 0:
            raise OSError(f"spool segment ends {self._left} bytes early")
        self._pos += got
        self._left -= got
        return got

    def close(self) -> None:
        if not self.closed and self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        super().close()


def _all_referenced(numbers: list[int]) -> set[int]:
    """Before a store binds its own: every segment is referenced, none goes."""
    return set(numbers)


def _lock_free(path: str) -> int | None:
    """A descriptor holding ``path``'s exclusive lock, or None if it is held or gone."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _pwrite_all(fd: int, pieces: Sequence[bytes | bytearray | memoryview], size: int, offset: int,
                path: str) -> None:
    """pwritev_all, its errors naming the segment."""
    try:
        written = pwritev_all(fd, pieces, size, offset)
    except OSError as exc:
        raise SpoolIOError(exc.errno, exc.strerror, path) from exc
    if written != size:
        raise SpoolIOError(0, f"wrote {written} bytes of {size}", path)
